"""Structural dedup: saturate each distinct repeated structure once.

A Graph is split into regions: one per indexed submodule its nodes came from (the `N` in
`model.layers.N`, read from each node's source), and one per connected group of the other
compute nodes. Constants, iotas and their views are copied into every region that reads
them; inputs, weights and other regions' values become the region's placeholders `p0, p1, ...`
in order of first use (a weight's placeholder is a weight). A region's canonical graph (placeholders, no source text) is its
structure: its digest keys the saturation, so the layers of a transformer are saturated once,
and the result is kept in the action cache for every later compile and every replica. The
optimized regions are then assembled into one Graph (partition still fuses across them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph
from kiln.ir.ops import Op

_MODULE = re.compile(r"in module '([^']*)'")
_INDEXED = re.compile(r"^(.*?\.\d+)(?:\.|$)")


class RegionCycle(Exception):
    """Regions depend on each other in a cycle: the graph is optimized whole instead."""


@dataclass
class Region:
    name: str
    nodes: list[int] = field(default_factory=list)    # owned compute nodes, topological
    inputs: list[int] = field(default_factory=list)   # placeholders, in order of first use
    outputs: list[int] = field(default_factory=list)  # owned nodes read outside the region


def module_region(source: str) -> str:
    """`model.layers.3` for a node from `model.layers.3.self_attn`; "" when not in an indexed module."""
    m = _MODULE.search(source)
    if not m:
        return ""
    k = _INDEXED.match(m.group(1))
    return k.group(1) if k else ""


def _free_nodes(g: Graph) -> list[bool]:
    """Constants, iotas and views of them: cheap to copy into every region that reads them."""
    free = [False] * len(g.nodes)
    for i, n in enumerate(g.nodes):
        free[i] = n.op in (Op.CONSTANT, Op.IOTA) or (n.op is Op.VIEW and free[n.inputs[0]])
    return free


def split(g: Graph) -> list[Region]:
    free = _free_nodes(g)
    leaf = [n.op in (Op.INPUT, Op.WEIGHT) for n in g.nodes]
    owner: list[str] = [""] * len(g.nodes)
    # other compute nodes: connected groups (union-find over edges between them)
    parent = list(range(len(g.nodes)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, n in enumerate(g.nodes):
        if free[i] or leaf[i]:
            continue
        owner[i] = module_region(n.source)
        if not owner[i]:
            for j in n.inputs:
                if not (free[j] or leaf[j]) and not module_region(g.nodes[j].source):
                    parent[find(i)] = find(j)
    regions: dict[str, Region] = {}
    for i in range(len(g.nodes)):
        if free[i] or leaf[i]:
            continue
        if not owner[i]:
            owner[i] = f"rest.{find(i)}"
        regions.setdefault(owner[i], Region(owner[i])).nodes.append(i)
    outputs = set(g.outputs)
    users = g.consumers()
    for r in regions.values():
        seen = set()
        for i in r.nodes:
            for j in _external_inputs(g, i, owner, free, r.name):
                if j not in seen:
                    seen.add(j)
                    r.inputs.append(j)
            if i in outputs or any(owner[u] != r.name and not free[u] for u in users[i]):
                r.outputs.append(i)
    return list(regions.values())


def _external_inputs(g, i, owner, free, name):
    """Inputs of node i from outside its region, looking through copied (free) nodes."""
    out, stack = [], list(g.nodes[i].inputs)
    while stack:
        j = stack.pop(0)
        if free[j]:
            stack[:0] = list(g.nodes[j].inputs)
        elif owner[j] != name:
            out.append(j)
    return out


def canonical(g: Graph, r: Region) -> Graph:
    """The region alone: placeholders for its inputs, copies of the free nodes it reads."""
    b = GraphBuilder()
    local: dict[int, int] = {}
    for k, j in enumerate(r.inputs):  # a weight stays a weight: the search may fold work on it
        leaf = b.weight if g.nodes[j].op is Op.WEIGHT else b.input
        local[j] = leaf(f"p{k}", g.nodes[j].shape, g.nodes[j].dtype)
    free = _free_nodes(g)

    def get(j):
        if j not in local:  # a free node: copy it (and its free inputs)
            assert free[j], f"node {j} reaches region {r.name} neither as input nor as copy"
            n = g.nodes[j]
            local[j] = b.copy(n, [get(k) for k in n.inputs])
        return local[j]

    for i in r.nodes:
        local[i] = b.copy(g.nodes[i], [get(j) for j in g.nodes[i].inputs])
    return b.build([local[i] for i in r.outputs], symbols=g.symbols)


def assemble(g: Graph, regions: list[Region], optimized: dict[str, Graph]) -> Graph:
    """One Graph from the optimized regions, wired as the original regions were."""
    b = GraphBuilder()
    new: dict[int, int] = {}
    for t in g.inputs:
        b.input(t.name, t.shape, t.dtype)
    for t in g.weights:
        b.weight(t.name, t.shape, t.dtype)
    by_node = {i: r for r in regions for i in r.nodes}
    state: dict[str, str] = {}

    def get(i: int) -> int:
        if i in new:
            return new[i]
        r = by_node.get(i)
        if r is None:  # a leaf or a free node
            n = g.nodes[i]
            new[i] = b.copy(n, [get(j) for j in n.inputs])
            return new[i]
        instantiate(r)
        return new[i]

    def instantiate(r: Region) -> None:
        if state.get(r.name) == "open":
            raise RegionCycle(r.name)
        state[r.name] = "open"
        args = [get(j) for j in r.inputs]
        og = optimized[r.name]
        local: dict[int, int] = {}
        for k, n in enumerate(og.nodes):
            local[k] = args[int(n.name[1:])] if n.op in (Op.INPUT, Op.WEIGHT) else b.copy(n, [local[j] for j in n.inputs])
        for old, k in zip(r.outputs, og.outputs):
            new[old] = local[k]
        state[r.name] = "done"

    outputs = [get(o) for o in g.outputs]
    return b.build(outputs, g.output_names, g.output_tree, g.symbols)
