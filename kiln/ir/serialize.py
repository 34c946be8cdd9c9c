"""Conversion between the IR dataclasses and their protobuf form (the only place that does it)."""

from __future__ import annotations

from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node, TensorSpec
from kiln.ir.ops import Op
from kiln.ir.shape import Dim, Sym
from kiln.ir.view import ViewSpec
from kiln.v1 import ir_pb2

_DTYPE_TO_PB = {DType.F32: ir_pb2.F32, DType.F16: ir_pb2.F16, DType.BF16: ir_pb2.BF16,
                DType.I32: ir_pb2.I32, DType.I64: ir_pb2.I64, DType.BOOL: ir_pb2.BOOL}
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}
_OPS = {op.value: op for op in Op}


def dtype_to_pb(d: DType) -> int:
    return _DTYPE_TO_PB[d]


def dtype_from_pb(v: int) -> DType:
    if v not in _PB_TO_DTYPE:
        raise ValueError(f"unknown or unspecified dtype enum value {v}")
    return _PB_TO_DTYPE[v]


def dim_to_pb(d: Dim, out: ir_pb2.Dim) -> ir_pb2.Dim:
    terms = d.terms if isinstance(d, Sym) else ((((), int(d)),) if d != 0 else ())
    for mono, coeff in terms:
        out.terms.add(coefficient=coeff, symbols=list(mono))
    return out


def dim_from_pb(p: ir_pb2.Dim) -> Dim:
    acc: dict[tuple[str, ...], int] = {}
    for t in p.terms:
        for s in t.symbols:
            if not s.isidentifier():
                raise ValueError(f"bad symbol name {s!r} in a dim")
        m = tuple(sorted(t.symbols))
        acc[m] = acc.get(m, 0) + t.coefficient
    return Sym._make(acc)


def _dims_to_pb(dims, field) -> None:
    for d in dims:
        dim_to_pb(d, field.add())


def _dims_from_pb(field) -> tuple[Dim, ...]:
    return tuple(dim_from_pb(d) for d in field)


def view_to_pb(v: ViewSpec, out: ir_pb2.ViewSpec) -> None:
    _dims_to_pb(v.shape, out.shape)
    _dims_to_pb(v.strides, out.strides)
    dim_to_pb(v.offset, out.offset)
    if v.mask is not None:
        out.masked = True
        for lo, hi in v.mask:
            r = out.mask.add()
            dim_to_pb(lo, r.lo)
            dim_to_pb(hi, r.hi)


def view_from_pb(p: ir_pb2.ViewSpec) -> ViewSpec:
    mask = tuple((dim_from_pb(r.lo), dim_from_pb(r.hi)) for r in p.mask) if p.masked else None
    return ViewSpec(_dims_from_pb(p.shape), _dims_from_pb(p.strides), dim_from_pb(p.offset), mask)


def tensor_spec_to_pb(t: TensorSpec, out: ir_pb2.TensorSpec) -> None:
    out.name = t.name
    _dims_to_pb(t.shape, out.shape)
    out.dtype = dtype_to_pb(t.dtype)


def tensor_spec_from_pb(p: ir_pb2.TensorSpec) -> TensorSpec:
    return TensorSpec(p.name, _dims_from_pb(p.shape), dtype_from_pb(p.dtype))


def graph_to_pb(g: Graph) -> ir_pb2.Graph:
    out = ir_pb2.Graph()
    for n in g.nodes:
        p = out.nodes.add(op=n.op.value, inputs=list(n.inputs), dtype=dtype_to_pb(n.dtype), name=n.name,
                          value=n.value, axis=n.axis, source=n.source, kernel=n.kernel,
                          schedule=n.schedule)
        _dims_to_pb(n.shape, p.shape)
        if n.view is not None:
            view_to_pb(n.view, p.view)
    for t in g.inputs:
        tensor_spec_to_pb(t, out.inputs.add())
    for t in g.weights:
        tensor_spec_to_pb(t, out.weights.add())
    out.outputs.extend(g.outputs)
    out.output_names.extend(g.output_names)
    out.output_tree = g.output_tree
    for name, lo, hi in g.symbols:
        out.symbols.add(name=name, min=lo, max=hi)
    return out


def graph_from_pb(p: ir_pb2.Graph) -> Graph:
    """Decode and validate; a malformed graph raises ValueError."""
    from kiln.ir.graph import validate

    nodes = []
    for i, n in enumerate(p.nodes):
        if n.op not in _OPS:
            raise ValueError(f"node %{i} has unknown op {n.op!r}")
        op = _OPS[n.op]
        nodes.append(Node(op, tuple(n.inputs), _dims_from_pb(n.shape), dtype_from_pb(n.dtype), n.name, n.value,
                          view_from_pb(n.view) if op is Op.VIEW else None, n.axis, n.source, n.kernel,
                          n.schedule))
    g = Graph(tuple(nodes), tuple(tensor_spec_from_pb(t) for t in p.inputs),
              tuple(tensor_spec_from_pb(t) for t in p.weights), tuple(p.outputs), tuple(p.output_names),
              p.output_tree, tuple((s.name, s.min, s.max) for s in p.symbols))
    validate(g)
    return g
