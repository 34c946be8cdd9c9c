"""Encoding: a primitive Graph as egglog terms, and the e-graph read back.

Each node becomes a `Term` e-node named by the op it is (the names derive from kiln.ir.ops: a
new primitive needs a Term constructor of the same name, nothing more here). View specs are
interned by key; the facts every rule family reads about them (plain_view, row_bcast,
reduce_view) are entered from Python as new specs appear. Facts one family needs (view
compositions, GEMM layouts and merges, reshapes that merge or split reduced axes) are that
family's, entered by its `Facts` (rules/<family>.py) through the hooks `encode` and `discover`.
"""

from __future__ import annotations

import json
import re
from egglog import EGraph, String, i64, set_

from kiln.ir.graph import Graph
from kiln.ir.kernel import flat_preserving, row_broadcast_axis
from kiln.ir.ops import GroupOp, Op
from kiln.ir.view import ViewSpec
from optimizer_svc.terms import Term, plain_view, pool_threads, pool_vector_bits, reduce_view, row_bcast

# Op -> the Term constructor that encodes it: the op's name in snake case (Constant: const)
TERM_NAME = {op: "const" if op is Op.CONSTANT else re.sub(r"(?<!^)(?=[A-Z])", "_", op.value).lower() for op in Op}
OP_OF_TERM = {name: op for op, name in TERM_NAME.items()}
# e-nodes the rules add beside the primitives: kernels they recognise, schedules, output markers
KERNEL_TERMS = ("gemm", "softmax", "rms_norm", "layer_norm", "attention", "scheduled", "output")
BY_NAME = {"Term." + n: n for n in (*TERM_NAME.values(), *KERNEL_TERMS)}
# rules/matmul.py names a concatenation of weights with these; never extracted
BY_NAME.update(merged_weight="merged_weight", merged_bias="merged_weight")
for _name in BY_NAME.values():
    if _name != "merged_weight" and not hasattr(Term, _name):
        raise ImportError(f"optimizer_svc.terms.Term has no constructor {_name!r} for that op")


class Encoder:
    """The graph being searched and its interned view specs (and iota shapes), by key."""

    def __init__(self, g: Graph):
        self.g = g
        self.specs: dict[str, ViewSpec] = {}
        self.shapes: dict[str, tuple] = {}
        self.pending: list[str] = []  # specs whose tables are not yet in the e-graph

    def spec_key(self, v: ViewSpec) -> str:
        k = v.key()
        if k not in self.specs:
            self.specs[k] = v
            self.pending.append(k)
        return k

    def flush_tables(self, eg: EGraph) -> bool:
        """Enter the Python-computed facts of new specs: plain_view for views without a mask,
        row_bcast for views that read a row value back along its axis, reduce_view for
        broadcast scalars. True when anything was added."""
        added = False
        while self.pending:
            k = self.pending.pop()
            v = self.specs[k]
            if v.mask is None:
                eg.register(plain_view(String(k)))
                added = True
            for axis, (d, st) in enumerate(zip(v.shape, v.strides)):
                src = tuple(1 if j == axis else x for j, x in enumerate(v.shape))
                # along an axis of size 1: a view that reads its source in order
                if (row_broadcast_axis(v, src) == axis if d != 1 else flat_preserving(v, src)):
                    eg.register(row_bcast(String(k), axis))
                    added = True
            if v.mask is None and v.offset == 0 and all(st == 0 for st in v.strides):
                for axis in range(len(v.shape)):
                    r = ViewSpec(tuple(1 if j == axis else d for j, d in enumerate(v.shape)), v.strides)
                    eg.register(set_(reduce_view(k, axis)).to(String(self.spec_key(r))))
                    added = True
        return added

    def term(self, n, args):
        op = n.op
        make = getattr(Term, TERM_NAME[op])
        if op in (Op.INPUT, Op.WEIGHT):
            return make(n.name)
        if op is Op.CONSTANT:
            return make(n.value, n.dtype.value)
        if op is Op.VIEW:
            return make(args[0], self.spec_key(n.view))
        if op is Op.IOTA:
            key = ",".join(map(str, n.shape))
            self.shapes[key] = n.shape
            return make(key, n.axis, n.dtype.value)
        if op is Op.CAST:
            return make(args[0], n.dtype.value)
        if op in GroupOp.Reduce or op in (Op.GATHER, Op.SCATTER):
            return make(*args, n.axis)
        if op in GroupOp.Elementwise:
            return make(*args)
        raise ValueError(f"cannot encode {op}")


class Facts:
    """A rule family's facts entered from Python (rules/<family>.py subclasses it): `encode` runs per
    node as the graph is encoded, `see` per e-node after each iteration and `finish` after them;
    the latter two return whether they entered anything."""

    def __init__(self, enc: Encoder):
        self.enc = enc

    def encode(self, eg: EGraph, g: Graph, i: int, refs: list, pool) -> None:
        pass

    def see(self, eg: EGraph, view: "EGraphView", n: dict) -> bool:
        return False

    def finish(self, eg: EGraph, view: "EGraphView") -> bool:
        return False


def encode(eg: EGraph, enc: Encoder, families: list[Facts], pool) -> list:
    """Every node of enc.g as a let-bound term, each family's encode-time facts, the outputs, the
    target's pool; returns the terms by node index."""
    g = enc.g
    refs: list = []
    for i, n in enumerate(g.nodes):
        refs.append(eg.let(f"n{i}", enc.term(n, [refs[j] for j in n.inputs])))
        for family in families:
            family.encode(eg, g, i, refs, pool)
    for k, o in enumerate(g.outputs):
        eg.register(Term.output(k, refs[o]))
    if pool is not None:
        eg.register(set_(pool_threads()).to(i64(pool.threads)))
        if pool.widest_vector:
            eg.register(set_(pool_vector_bits()).to(i64(pool.widest_vector)))
    enc.flush_tables(eg)
    return refs


def serialize(eg: EGraph) -> dict:
    return json.loads(eg._serialize(split_primitive_outputs=False).to_json())


def literal(node: dict):
    op = node["op"]
    if op.startswith('"'):
        return json.loads(op)
    try:
        return int(op)
    except ValueError:
        return float(op.replace("NaN", "nan"))


class EGraphView:
    """The serialized e-graph as the families' discover hooks read it."""

    def __init__(self, enc: Encoder, ser: dict):
        self.enc = enc
        self.nodes = ser["nodes"]
        self.by_class: dict[str, list[dict]] = {}
        for n in self.nodes.values():
            self.by_class.setdefault(n["eclass"], []).append(n)

    def eclass(self, child: str) -> str:
        return self.nodes[child]["eclass"]

    def literal(self, child: str):
        return literal(self.nodes[child])

    def view_specs(self, cls: str) -> list[str]:
        """The (interned) specs of the views in e-class cls."""
        return [k for m in self.by_class.get(cls, []) if m["op"] == "Term.view"
                for k in [self.literal(m["children"][1])] if k in self.enc.specs]

    def weight_views(self, cls: str) -> list[tuple[str, str]]:
        """(weight name, spec) of the views of a weight in e-class cls."""
        out = []
        for m in self.by_class.get(cls, []):
            if m["op"] == "Term.view":
                k = self.literal(m["children"][1])
                for leaf in self.by_class.get(self.eclass(m["children"][0]), []):
                    if leaf["op"] == "Term.weight" and k in self.enc.specs:
                        out.append((self.literal(leaf["children"][0]), k))
        return out


def discover(eg: EGraph, families: list[Facts], view: EGraphView) -> bool:
    """Each family's facts for what the last iteration added, node by node in e-graph order; True
    when any was entered."""
    added = False
    for n in view.nodes.values():
        for family in families:
            added |= family.see(eg, view, n)
    for family in families:
        added |= family.finish(eg, view)
    return added
