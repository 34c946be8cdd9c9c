"""Weight folding: work on weights alone is done once, when a session loads, not on every run.

The search may choose programs that compute on weights only (a merged GEMM's concatenated
weights, rules/matmul.py). Such work is hoisted out of the program into a separate `prepare`
Graph whose inputs are the model's weights and whose outputs are new, derived weights named
`kiln:fold:K`; the program reads those as weights. The executor evaluates `prepare` when it binds
a session's weights, so a weight-only change still reuses every compiled artifact.

A node is hoisted when it reads only weights and constants (through any ops but iotas and
inputs), its shape is static and it is no larger than the model's weights together. Views of
weights stay in the program: they cost nothing there.
"""

from __future__ import annotations

from typing import Optional

from kiln.ir.builder import GraphBuilder
from kiln.ir.graph import Graph
from kiln.ir.kernel import DERIVED_PREFIX
from kiln.ir.ops import Op
from kiln.ir.shape import is_static, numel


def foldable_nodes(g: Graph) -> list[bool]:
    """Per node: computed from weights and constants alone, at a bounded static shape, with a
    compute op on the way (so not a weight, a constant or a view of them)."""
    limit = sum(numel(t.shape) for t in g.weights if is_static(t.shape))
    const = [False] * len(g.nodes)  # weight-only values, leaves included
    work = [False] * len(g.nodes)
    for i, n in enumerate(g.nodes):
        if n.op in (Op.WEIGHT, Op.CONSTANT):
            const[i] = True
        elif n.op in (Op.INPUT, Op.IOTA) or not is_static(n.shape) or numel(n.shape) > limit:
            const[i] = False
        else:
            const[i] = all(const[j] for j in n.inputs)
        work[i] = const[i] and n.op not in (Op.WEIGHT, Op.CONSTANT) and \
            (n.op is not Op.VIEW or work[n.inputs[0]])
    return work


def hoist(g: Graph) -> tuple[Graph, Optional[Graph]]:
    """(the program, reading derived weights; the prepare Graph computing them, or None when the
    program does no weight-only work)."""
    work = foldable_nodes(g)
    # derived weights: weight-only results that the rest of the program reads (views of them
    # are rebuilt on the derived weight)
    roots: list[int] = []
    needed = [False] * len(g.nodes)
    for o in g.outputs:
        needed[o] = True
    for i in range(len(g.nodes) - 1, -1, -1):
        if not needed[i]:
            continue
        n = g.nodes[i]
        if work[i] and n.op is not Op.VIEW:
            roots.append(i)
            continue
        for j in n.inputs:
            needed[j] = True
    if not roots:
        return g, None
    roots.sort()
    name = {r: f"{DERIVED_PREFIX}{k}" for k, r in enumerate(roots)}

    b = GraphBuilder()
    new: dict[int, int] = {}
    used = {g.nodes[i].name for i, n in enumerate(g.nodes) if needed[i] and n.op is Op.WEIGHT}
    for t in g.inputs:
        b.input(t.name, t.shape, t.dtype)
    for t in g.weights:
        if t.name in used:
            b.weight(t.name, t.shape, t.dtype)
    for i, n in enumerate(g.nodes):
        if not needed[i]:
            continue
        if i in name:
            new[i] = b.weight(name[i], n.shape, n.dtype)
        else:
            new[i] = b.copy(n, [new[j] for j in n.inputs])
    program = b.build([new[o] for o in g.outputs], g.output_names, g.output_tree, g.symbols)

    p = GraphBuilder()
    reach = [False] * len(g.nodes)
    for r in roots:
        reach[r] = True
    for i in range(len(g.nodes) - 1, -1, -1):
        if reach[i]:
            for j in g.nodes[i].inputs:
                reach[j] = True
    local: dict[int, int] = {}
    for i, n in enumerate(g.nodes):
        if reach[i]:
            local[i] = p.copy(n, [local[j] for j in n.inputs])
    prepare = p.build([local[r] for r in roots], tuple(name[r] for r in roots))
    return program, prepare
