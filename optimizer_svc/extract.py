"""Extraction: from the saturated e-graph, the cheapest program, rebuilt as a Graph.

Per e-class, the cheapest e-node by a bottom-up fixpoint over cost.enode_cost (schedules priced
by cost.schedule_costs under the target's Pool); values that several e-classes can share (a
merged GEMM's slices) are chosen together where the whole program gets cheaper (share_values);
weight-only work is free (the optimizer hoists it, fold.py). The chosen e-nodes are rebuilt
through GraphBuilder, so shapes and dtypes are re-inferred and checked, and each kernel's
schedule is recorded on its node.
"""

from __future__ import annotations

from typing import Optional

from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import evaluate_dim, numel
from optimizer_svc.cost import KERNEL_CALL_COST, NODE_COST, SCHEDULED, Pool, enode_cost, schedule_costs
from optimizer_svc.encode import BY_NAME, OP_OF_TERM, Encoder, literal
from optimizer_svc.rules.norms import layer_norm_primitives, rms_norm_primitives, softmax_primitives


def class_shapes(g: Graph, enc: "Encoder", nodes: dict, classes: dict[str, list[str]]) -> dict[str, tuple]:
    """The shape of each e-class's value (all members of a class have one shape), inferred
    bottom-up from the leaves."""
    leaf = {t.name: t.shape for t in list(g.inputs) + list(g.weights)}
    shape: dict[str, tuple] = {}
    changed = True
    while changed:
        changed = False
        for cls, members in classes.items():
            if cls in shape:
                continue
            for nid in members:
                n = nodes[nid]
                name = BY_NAME[n["op"]]
                kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["op"] in BY_NAME]
                lits = [literal(nodes[ch]) for ch in n["children"] if nodes[ch]["op"] not in BY_NAME]
                if name in ("merged_weight", "scheduled"):  # a concatenation's name; a kernel's schedule
                    continue
                if name in ("input", "weight"):
                    shape[cls] = tuple(leaf[lits[0]])
                elif name == "const":
                    shape[cls] = ()
                elif name == "view":
                    shape[cls] = tuple(enc.specs[lits[0]].shape)
                elif name == "iota":
                    shape[cls] = tuple(enc.shapes[lits[0]])
                elif not all(k in shape for k in kids):
                    continue
                elif name in ("sum_reduce", "max_reduce", "gemm"):
                    s = list(shape[kids[0]])
                    s[int(lits[0])] = 1
                    shape[cls] = tuple(s)
                elif name == "attention":  # P · V: V's broadcast view, reduced along k
                    s = list(shape[kids[1]])
                    s[int(lits[1])] = 1
                    shape[cls] = tuple(s)
                elif name == "gather":
                    shape[cls] = shape[kids[1]]
                else:  # elementwise ops and scatter: the first operand's shape
                    shape[cls] = shape[kids[0]]
                changed = True
                break
    return shape


def weight_only(g: Graph, enc: Encoder, nodes: dict, classes: dict[str, list[str]],
                 elements: dict[str, int]) -> set[str]:
    """The e-nodes computed from weights and constants alone, at a static shape no larger than
    all the weights together: the optimizer hoists them out of the program (fold.py), so they
    cost nothing per run."""
    limit = sum(evaluate_dim(numel(t.shape), {}) for t in g.weights if all(isinstance(d, int) for d in t.shape))
    static = {c for c in classes if c in elements}
    ok_class: set[str] = set()
    ok_node: set[str] = set()
    changed = True
    while changed:
        changed = False
        for cls, members in classes.items():
            for nid in members:
                if nid in ok_node:
                    continue
                n = nodes[nid]
                name = BY_NAME[n["op"]]
                if name in ("input", "iota", "merged_weight", "scheduled", "output"):
                    continue
                if name not in ("weight", "const") and (cls not in static or elements[cls] > limit):
                    continue
                if name == "view" and not all(isinstance(d, int) for d in enc.specs[literal(
                        nodes[n["children"][1]])].shape):
                    continue
                kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["op"] in BY_NAME]
                if all(k in ok_class for k in kids):
                    ok_node.add(nid)
                    ok_class.add(cls)
                    changed = True
    return ok_node


def share_values(nodes: dict, classes: dict[str, list[str]], choice: dict[str, str], own: dict[str, float],
           folded: set[str], roots: list[str]) -> dict[str, str]:
    """Improve the per-e-class choice where e-classes can share one value: for each e-class S read
    through views by several e-classes (a merged GEMM's slices), choose those views for all of
    them at once, and keep the change when the whole program (each e-class counted once, each
    GEMM call at KERNEL_CALL_COST, each op at NODE_COST) gets cheaper."""
    def kids(nid):
        return [nodes[ch]["eclass"] for ch in nodes[nid]["children"] if nodes[ch]["eclass"] in classes]

    def dag_cost(ch: dict[str, str]) -> float:
        total, state, stack = 0.0, {}, [(r, False) for r in roots]
        while stack:
            c, done = stack.pop()
            if done:
                state[c] = 2
                continue
            if state.get(c) == 2:
                continue
            if state.get(c) == 1:
                return float("inf")  # a cycle through the new choices
            state[c] = 1
            nid = ch[c]
            total += own[nid]
            if nid not in folded:
                total += NODE_COST
                if BY_NAME[nodes[nid]["op"]] in ("gemm", "attention"):
                    total += KERNEL_CALL_COST
            stack.append((c, True))
            stack.extend((k, False) for k in kids(nid) if state.get(k) != 2)
        return total

    readers: dict[str, list[tuple[str, str]]] = {}
    for cls, members in classes.items():
        for nid in members:
            if nodes[nid]["op"] == "Term.view":
                src = nodes[nodes[nid]["children"][0]]["eclass"]
                if src != cls:
                    readers.setdefault(src, []).append((cls, nid))
    # e-classes of GEMMs, and of elementwise epilogues on them (a merged GEMM's bias)
    gemms = {c for c, members in classes.items() if any(BY_NAME[nodes[m]["op"]] in ("gemm", "attention")
                                                         for m in members)}
    epilogues = {c for c, members in classes.items() if any(
        nodes[m]["op"] in ("Term.add", "Term.mul") and set(kids(m)) & gemms for m in members)}
    shared = sorted(s for s, r in readers.items() if len({c for c, _ in r}) >= 2 and s in gemms | epilogues)
    cost = dag_cost(choice)
    for s in shared:
        trial = dict(choice)
        for cls, nid in readers[s]:
            trial[cls] = nid
        c = dag_cost(trial)
        if c < cost - 1e-9:
            choice, cost = trial, c
    return choice


def extract(g: Graph, enc: Encoder, ser: dict, pool: Optional[Pool] = None) -> Graph:
    """The cheapest program in the serialized e-graph `ser`, rebuilt as a Graph."""
    nodes = ser["nodes"]
    classes: dict[str, list[str]] = {}
    for nid, n in nodes.items():
        if n["op"] in BY_NAME and n["op"] != "Term.output":
            classes.setdefault(n["eclass"], []).append(nid)
    largest = {name: hi for name, _, hi in g.symbols}
    shapes = class_shapes(g, enc, nodes, classes)
    elements = {c: evaluate_dim(numel(s), largest) for c, s in shapes.items()}
    folded = weight_only(g, enc, nodes, classes, elements)
    own = {nid: 0.0 if nid in folded else enode_cost(nodes[nid], cls, nodes, elements)
           for cls, members in classes.items() for nid in members}
    schedule = choose_schedules(nodes, classes, shapes, largest, own, folded, pool)
    # Term.output(k, x) nodes mark the e-class of output k
    out_class = {literal(nodes[n["children"][0]]): nodes[n["children"][1]]["eclass"]
                 for n in nodes.values() if n["op"] == "Term.output"}
    choice = share_values(nodes, classes, cheapest(nodes, classes, own), own, folded, list(out_class.values()))
    return build_graph(g, enc, nodes, classes, choice, schedule, out_class)


def choose_schedules(nodes: dict, classes: dict[str, list[str]], shapes: dict, largest: dict,
                     own: dict[str, float], folded: set[str], pool: Optional[Pool]) -> dict[str, str]:
    """Each kernel e-node's cheapest schedule among those its e-class offers; its own cost
    (in `own`) becomes that schedule's."""
    schedule: dict[str, str] = {}
    for cls, members in classes.items():
        offered = {literal(nodes[nodes[m]["children"][1]]) for m in members if nodes[m]["op"] == "Term.scheduled"}
        if not offered or pool is None:
            continue
        for nid in members:
            if BY_NAME[nodes[nid]["op"]] in SCHEDULED and nid not in folded:
                costs = schedule_costs(nodes[nid], cls, nodes, shapes, largest, own[nid], pool)
                usable = [s for s in costs if s in offered]
                if usable:
                    schedule[nid] = min(usable, key=lambda s: (costs[s], len(s), s))  # ties: the smaller tile
                    own[nid] = costs[schedule[nid]]
    return schedule


def cheapest(nodes: dict, classes: dict[str, list[str]], own: dict[str, float]) -> dict[str, str]:
    """Per e-class, the e-node of least total cost (its own plus its children's), by a bottom-up
    fixpoint."""
    best: dict[str, tuple[float, str]] = {}
    changed = True
    while changed:
        changed = False
        for cls, members in classes.items():
            for nid in members:
                n = nodes[nid]
                total = own[nid]
                ok = True
                for ch in n["children"]:
                    ccls = nodes[ch]["eclass"]
                    if ccls in classes:
                        if ccls not in best:
                            ok = False
                            break
                        total += best[ccls][0]
                if ok and (cls not in best or total < best[cls][0] - 1e-12):
                    best[cls] = (total, nid)
                    changed = True
    return {c: nid for c, (_, nid) in best.items()}


def build_graph(g: Graph, enc: Encoder, nodes: dict, classes: dict[str, list[str]], choice: dict[str, str],
                schedule: dict[str, str], out_class: dict[int, str]) -> Graph:
    """The chosen e-nodes rebuilt through GraphBuilder (shapes and dtypes inferred and checked
    again), each kernel with its schedule, the outputs in g's order."""
    b = GraphBuilder()
    for t in g.inputs:
        b.input(t.name, t.shape, t.dtype)
    for t in g.weights:
        b.weight(t.name, t.shape, t.dtype)
    leaves = {t.name: t for t in list(g.inputs) + list(g.weights)}
    built: dict[str, int] = {}

    def build(cls: str) -> int:
        if cls in built:
            return built[cls]
        stack = [(cls, False)]
        while stack:
            c, ready = stack.pop()
            if c in built:
                continue
            nid = choice[c]
            n = nodes[nid]
            kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["eclass"] in classes]
            if not ready:
                stack.append((c, True))
                stack.extend((k, False) for k in kids if k not in built)
                continue
            built[c] = rebuild(b, enc, leaves, n, nodes, [built[k] for k in kids])
            if nid in schedule:
                b.set_schedule(built[c], schedule[nid])
        return built[cls]

    outputs = []
    for k, o in enumerate(g.outputs):
        cls = out_class.get(k)
        if cls is None:
            raise RuntimeError(f"output %{o} lost its e-class during saturation")
        outputs.append(build(cls))
    return b.build(outputs, g.output_names, g.output_tree, g.symbols)


def rebuild(b: GraphBuilder, enc: Encoder, shapes, n: dict, nodes: dict, kids: list[int]) -> int:
    name = BY_NAME[n["op"]]
    lits = [literal(nodes[ch]) for ch in n["children"] if nodes[ch]["op"] not in BY_NAME]
    if name in ("input", "weight"):
        t = shapes[lits[0]]
        return (b.input if name == "input" else b.weight)(t.name, t.shape, t.dtype)
    if name == "const":
        return b.const(float(lits[0]), DType(lits[1]))
    if name == "view":
        return b.view(kids[0], enc.specs[lits[0]])
    op = OP_OF_TERM.get(name)
    if op in GroupOp.Unary:
        return b.unary(op, kids[0])
    if op in GroupOp.Binary:
        return b.binary(op, kids[0], kids[1])
    if name == "where":
        return b.where(*kids)
    if name in ("sum_reduce", "max_reduce"):
        return b.reduce(Op.SUM_REDUCE if name == "sum_reduce" else Op.MAX_REDUCE, kids[0], int(lits[0]))
    if name == "gemm":
        return b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, kids[0], kids[1]), int(lits[0]), kernel="gemm")
    if name == "softmax":
        return softmax_primitives(b, kids[0], int(lits[0]))
    if name == "rms_norm":
        return rms_norm_primitives(b, kids[0], int(lits[0]), float(lits[1]), float(lits[2]))
    if name == "layer_norm":
        return layer_norm_primitives(b, kids[0], int(lits[0]), float(lits[1]), float(lits[2]))
    if name == "attention":
        p = b.view(kids[0], enc.specs[lits[0]])
        return b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, p, kids[1]), int(lits[1]), kernel="attention")
    if name == "iota":
        return b.iota(enc.shapes[lits[0]], int(lits[1]), DType(lits[2]))
    if name == "gather":
        return b.gather(kids[0], kids[1], int(lits[0]))
    if name == "scatter":
        return b.scatter(kids[0], kids[1], kids[2], int(lits[0]))
    if name == "cast":
        return b.cast(kids[0], DType(lits[0]))
    raise ValueError(name)
