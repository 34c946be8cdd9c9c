"""Memory plan: intermediate buffers share slots by liveness, and outputs that only reshape an
intermediate take its place.

Slots: each buffer takes a free slot of its dtype (free once the previous occupant's last
reader ran), the smallest that holds it, else the largest free one grown to fit (slots are
allocated once per run at their final size), else a new one.

Output aliases: a kernel that only copies an intermediate into an output through a reshape
(the flat order kept, as a model's last `view` gives) is not run; the intermediate is written
into the output's buffer directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.dtypes import DType
from kiln.ir.kernel import KernelGraph, compose_chain, flat_preserving, view_root
from kiln.ir.ops import Op
from kiln.ir.shape import Dim, evaluate_dim, numel


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
    aliases: dict[int, int]  # intermediate node -> the graph output whose buffer it is written into
    skipped: frozenset[int]  # kernels (by index) not run: the copies the aliases make unnecessary


def _bytes(elements: Dim, dtype: DType, env) -> int:
    return evaluate_dim(elements, env) * dtype.itemsize


def output_aliases(kg: KernelGraph) -> dict[int, tuple[int, int]]:
    """{kernel index: (intermediate, output)} for each kernel that only copies an intermediate
    (made by an earlier kernel, not itself an output) into an output through flat-preserving views."""
    g = kg.graph
    outputs = set(g.outputs)
    made = {k.output for k in kg.kernels}
    out: dict[int, tuple[int, int]] = {}
    taken: set[int] = set()
    for t, k in enumerate(kg.kernels):
        o = k.output
        if o not in outputs or g.nodes[o].op is not Op.VIEW or len(k.reads) != 1:
            continue
        root, chain = view_root(g, o)
        r = g.nodes[root]
        if root != k.reads[0] or root not in made or root in outputs or root in taken or \
                r.dtype is not g.nodes[o].dtype:
            continue
        if any(g.nodes[j].op is not Op.VIEW for j in k.nodes if j != root) or \
                not flat_preserving(compose_chain(chain), r.shape):
            continue
        out[t] = (root, o)
        taken.add(root)
    return out


def plan_memory(kg: KernelGraph) -> MemoryPlan:
    g = kg.graph
    outputs = set(g.outputs)
    alias_of = output_aliases(kg)
    aliases = {root: o for root, o in alias_of.values()}
    last_use: dict[int, int] = {}
    for t, k in enumerate(kg.kernels):
        if t not in alias_of:
            for j in k.reads:
                last_use[j] = t
    slots: list[Slot] = []
    free_at: list[int] = []   # kernel index after which the slot is free
    node_slot: dict[int, int] = {}
    naive = 0
    out_bytes = 0
    env = {name: hi for name, _, hi in g.symbols}
    for t, k in enumerate(kg.kernels):
        if t in alias_of:
            continue
        o = k.output
        n = g.nodes[o]
        elems = numel(n.shape)
        if o in outputs or o in aliases:
            out_bytes += _bytes(elems, n.dtype, env)
            continue
        naive += _bytes(elems, n.dtype, env)
        end = last_use.get(o, t)
        free = [s for s, slot in enumerate(slots) if slot.dtype is n.dtype and free_at[s] < t]
        fits = [s for s in free if _fits(elems, slots[s].elements)]
        grows = [s for s in free if isinstance(elems, int) and isinstance(slots[s].elements, int)]
        if fits:
            choice = min(fits, key=lambda s: evaluate_dim(slots[s].elements, env))
        elif grows:
            choice = max(grows, key=lambda s: slots[s].elements)
            slots[choice] = Slot(choice, n.dtype, elems)
        else:
            slots.append(Slot(len(slots), n.dtype, elems))
            free_at.append(end)
            choice = len(slots) - 1
        free_at[choice] = end
        node_slot[o] = choice
    peak = sum(_bytes(s.elements, s.dtype, env) for s in slots) + out_bytes
    return MemoryPlan(tuple(slots), node_slot, peak, naive + out_bytes, aliases, frozenset(alias_of))


def _fits(need: Dim, have: Dim) -> bool:
    if isinstance(need, int) and isinstance(have, int):
        return need <= have
    return need == have
