"""Memory plan: intermediate buffers share slots by liveness (greedy first fit, same dtype)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.dtypes import DType
from kiln.ir.ops import Op
from kiln.ir.shape import Dim, evaluate_dim, numel
from kiln.ir.kernel import KernelGraph


@dataclass(frozen=True)
class Slot:
    slot: int
    dtype: DType
    elements: Dim


@dataclass(frozen=True)
class MemoryPlan:
    slots: tuple[Slot, ...]
    node_slot: dict[int, int]
    peak_bytes: int          # intermediates + outputs, symbolic dims at their largest
    naive_bytes: int         # what one buffer per intermediate would take


def _bytes(elements: Dim, dtype: DType, env) -> int:
    return evaluate_dim(elements, env) * dtype.itemsize


def plan_memory(kg: KernelGraph) -> MemoryPlan:
    g = kg.graph
    outputs = set(g.outputs)
    last_use: dict[int, int] = {}
    for t, k in enumerate(kg.kernels):
        for j in k.reads:
            last_use[j] = t
    slots: list[Slot] = []
    free_at: list[int] = []   # kernel index after which the slot is free
    node_slot: dict[int, int] = {}
    naive = 0
    out_bytes = 0
    env = {name: hi for name, _, hi in g.symbols}
    for t, k in enumerate(kg.kernels):
        o = k.output
        n = g.nodes[o]
        elems = numel(n.shape)
        if o in outputs:
            out_bytes += _bytes(elems, n.dtype, env)
            continue
        naive += _bytes(elems, n.dtype, env)
        end = last_use.get(o, t)
        choice = None
        for s, slot in enumerate(slots):
            if slot.dtype is n.dtype and free_at[s] < t and _fits(elems, slot.elements):
                choice = s
                break
        if choice is None:
            slots.append(Slot(len(slots), n.dtype, elems))
            free_at.append(end)
            choice = len(slots) - 1
        else:
            free_at[choice] = end
        node_slot[o] = choice
    peak = sum(_bytes(s.elements, s.dtype, env) for s in slots) + out_bytes
    return MemoryPlan(tuple(slots), node_slot, peak, naive + out_bytes)


def _fits(need: Dim, have: Dim) -> bool:
    if isinstance(need, int) and isinstance(have, int):
        return need <= have
    return need == have
