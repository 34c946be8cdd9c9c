"""Conversion between the IR's artifacts and their protobuf form (the only place that does it):
graphs, kernel graphs, weight manifests and bundles, and the dtypes, dims and specs in them."""

from __future__ import annotations

from kiln.ir.dtypes import DType
from kiln.ir.graph import ATTENTION_TILES, GEMM_TILES, VECTOR_WIDTHS, Graph, Node, TensorSpec
from kiln.ir.kernel import KERNEL_KINDS, Kernel, KernelGraph, check_prepare, gemm_axes, gemm_dims, kernel_gemm
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


def kernel_graph_to_pb(kg: KernelGraph, source_graph=None):
    # the optimizer's candidates share one graph: it is serialized once (0.1 s at 30 layers)
    p = ir_pb2.KernelGraph()
    p.graph.CopyFrom(kg.graph.fact("pb", None, lambda: graph_to_pb(kg.graph)))
    for k in kg.kernels:
        p.kernels.add(name=k.name, kind=k.kind, nodes=list(k.nodes), output=k.output, reads=list(k.reads),
                      parallel=k.parallel, axis=k.axis, scores=max(k.scores, 0), order=k.order,
                      tile=k.tile, collapse=k.collapse, vector=k.vector)
    if source_graph is not None:
        p.source_graph.CopyFrom(source_graph.to_pb())
    if kg.prepare is not None:
        p.prepare.CopyFrom(graph_to_pb(kg.prepare))
    return p


def kernel_graph_from_pb(p) -> KernelGraph:
    g = graph_from_pb(p.graph)
    kernels = []
    for k in p.kernels:
        ids = list(k.nodes) + list(k.reads) + [k.output]
        if any(not 0 <= i < len(g.nodes) for i in ids) or k.kind not in KERNEL_KINDS:
            raise ValueError(f"kernel {k.name!r} is malformed (unknown kind or node out of range)")
        if k.kind == "row" and not 0 <= k.axis < len(g.nodes[k.output].shape):
            raise ValueError(f"row kernel {k.name!r} has no valid axis")
        if k.kind == "attention":
            pv = gemm_axes(g, k.output)
            if k.scores not in k.nodes or gemm_axes(g, k.scores) is None or pv is None or \
                    pv.a_root not in k.nodes or not 0 <= k.axis < len(g.nodes[pv.a_root].shape):
                raise ValueError(f"attention kernel {k.name!r} does not name its two GEMMs and its row axis")
        if k.order not in ("", "axis-outer") or (k.order and k.kind != "reduce"):
            raise ValueError(f"kernel {k.name!r} has an unknown loop order {k.order!r} for a {k.kind} kernel")
        if k.tile and k.tile not in {"attention": ATTENTION_TILES, "gemm": GEMM_TILES}.get(k.kind, ()):
            raise ValueError(f"kernel {k.name!r}: a tile of {k.tile} rows for a {k.kind} kernel")
        if k.collapse and (k.kind not in ("reduce", "row") or not k.parallel):
            raise ValueError(f"kernel {k.name!r}: only a parallel reduce or row kernel collapses its loops")
        if k.vector and k.vector not in VECTOR_WIDTHS:
            raise ValueError(f"kernel {k.name!r}: a vector width of {k.vector} bits (known: {VECTOR_WIDTHS})")
        kernel = Kernel(k.name, k.kind, tuple(k.nodes), k.output, tuple(k.reads), k.parallel, k.axis,
                        k.scores if k.kind == "attention" else -1, k.order, k.tile, k.collapse, k.vector)
        if k.tile and k.kind == "gemm" and (kernel_gemm(g, kernel) is None
                                            or gemm_dims(g, kernel_gemm(g, kernel))[1] != 1):
            raise ValueError(f"kernel {k.name!r}: a batched GEMM has no tile of rows (one BLAS call per matrix)")
        kernels.append(kernel)
    prepare = graph_from_pb(p.prepare) if p.HasField("prepare") else None
    check_prepare(g, prepare)
    return KernelGraph(g, tuple(kernels), prepare)


def manifest_to_pb(weights) -> ir_pb2.WeightManifest:
    """A weight manifest from (name, dtype, shape, blob digest) per weight."""
    m = ir_pb2.WeightManifest()
    for name, dtype, shape, digest in weights:
        m.weights.add(name=name, dtype=dtype_to_pb(dtype), shape=list(shape), digest=digest.to_pb())
    return m


def bundle_to_pb(target: str, program, kg: KernelGraph, kg_d) -> ir_pb2.Bundle:
    """A Bundle: codegen's Program for `target` (its kernels' and entry's source, outputs and
    memory plan: codegen_svc.program.Program) for the kernel graph kg, stored as kg_d."""
    g = kg.graph
    bundle = ir_pb2.Bundle(target=target, module_source=program.module_source, entry=program.entry,
                           kernel_graph=kg_d.to_pb(), output_tree=g.output_tree, output_names=list(g.output_names))
    for k in program.kernels:
        bundle.kernels.add(name=k.name, kind=k.kind, source=k.source, symbol=k.symbol)
    for t in g.inputs:
        tensor_spec_to_pb(t, bundle.inputs.add())
    for t in program.outputs:
        tensor_spec_to_pb(t, bundle.outputs.add())
    for t in g.weights:
        tensor_spec_to_pb(t, bundle.weights.add())
    bundle.weight_names.extend(t.name for t in g.weights)
    for name, lo, hi in g.symbols:
        bundle.symbols.add(name=name, min=lo, max=hi)
    if kg.prepare is not None:
        bundle.prepare.CopyFrom(graph_to_pb(kg.prepare))
    memory = program.memory
    for slot in memory.slots:
        p = bundle.memory.slots.add(slot=slot.slot, dtype=dtype_to_pb(slot.dtype), offset=slot.offset or 0)
        dim_to_pb(slot.elements, p.elements)
    for node, slot in memory.node_slot.items():
        bundle.memory.node_slot[node] = slot
    bundle.memory.peak_bytes = memory.peak_bytes
    bundle.memory.arena_bytes = memory.arena_bytes
    return bundle
