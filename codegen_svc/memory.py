"""Memory plan: intermediate buffers share memory by liveness, and outputs that only reshape an
intermediate take its place.

Arena (every intermediate's size static): one allocation per run, each buffer at a byte offset
in it. Buffers are placed largest first, each at the lowest 64-byte-aligned offset where it
overlaps no buffer live at the same time (a buffer is live from the kernel that writes it to
the last kernel that reads it, both included, so no kernel's output overlaps its inputs). The
arena is then as large as the most memory live at any one kernel, or close: for tiny Llama at
seq 128, 442,368 bytes, where slots took 546,816.

Slots (some size symbolic): each buffer takes a free slot of its dtype (free once the previous occupant's last
reader ran), the smallest that holds it, else the largest free one grown to fit (slots are
allocated once per run at their final size), else a new one.

Output aliases: a kernel that only copies an intermediate into an output through a reshape
(the flat order kept, as a model's last `view` gives) is not run; the intermediate is written
into the output's buffer directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kiln.ir.dtypes import DType
from kiln.ir.kernel import KernelGraph, compose_chain, flat_preserving, view_root
from kiln.ir.ops import Op
from kiln.ir.shape import Dim, evaluate_dim, numel


@dataclass(frozen=True)
class Slot:
    slot: int
    dtype: DType
    elements: Dim
    offset: Optional[int] = None  # bytes into the arena, in a plan that packs one


ALIGN = 64  # bytes: a cache line, and an AVX-512 vector


@dataclass(frozen=True)
class MemoryPlan:
    slots: tuple[Slot, ...]
    node_slot: dict[int, int]
    peak_bytes: int          # intermediates + outputs, symbolic dims at their largest
    naive_bytes: int         # what one buffer per intermediate would take
    aliases: dict[int, int]  # intermediate node -> the graph output whose buffer it is written into
    skipped: frozenset[int]  # kernels (by index) not run: the copies the aliases make unnecessary
    arena_bytes: int = 0     # the arena every slot lies in; 0: each slot is allocated on its own


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


def plan_memory(kg: KernelGraph, arena: bool = True) -> MemoryPlan:
    """`arena`: place the buffers in one arena when every size is static (else slots)."""
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
    lives = [(o, t, last_use.get(o, t)) for t, k in enumerate(kg.kernels) for o in [k.output] if o in node_slot]
    if arena and all(isinstance(numel(g.nodes[o].shape), int) for o, _, _ in lives):
        slots, node_slot, top = _pack(g, lives)
        return MemoryPlan(tuple(slots), node_slot, top + out_bytes, naive + out_bytes, aliases, frozenset(alias_of),
                          top)
    peak = sum(_bytes(s.elements, s.dtype, env) for s in slots) + out_bytes
    return MemoryPlan(tuple(slots), node_slot, peak, naive + out_bytes, aliases, frozenset(alias_of))


def _pack(g, lives: list[tuple[int, int, int]]) -> tuple[list[Slot], dict[int, int], int]:
    """(a slot per buffer, at its offset; node -> slot; arena bytes) for buffers (node, first
    kernel, last kernel): largest first, each at the lowest aligned offset clear of the buffers
    placed so far whose lives overlap its own."""
    placed: list[tuple[int, int, int, int]] = []  # offset, bytes, first, last
    slots: list[Slot] = []
    node_slot: dict[int, int] = {}
    top = 0
    for o, first, last in sorted(lives, key=lambda x: (-numel(g.nodes[x[0]].shape) * g.nodes[x[0]].dtype.itemsize,
                                                       x[1])):
        n = g.nodes[o]
        size = numel(n.shape) * n.dtype.itemsize
        offset = 0
        for lo, hi in sorted((p, p + b) for p, b, f, e in placed if f <= last and first <= e):
            if offset + size <= lo:
                break
            offset = max(offset, -(-hi // ALIGN) * ALIGN)
        placed.append((offset, size, first, last))
        node_slot[o] = len(slots)
        slots.append(Slot(len(slots), n.dtype, numel(n.shape), offset))
        top = max(top, offset + size)
    return slots, node_slot, -(-top // ALIGN) * ALIGN


def _fits(need: Dim, have: Dim) -> bool:
    if isinstance(need, int) and isinstance(have, int):
        return need <= have
    return need == have
