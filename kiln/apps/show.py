"""`kiln show`: print a stored artifact (graph, kernel graph, bundle, manifest) readably."""

from __future__ import annotations

from google.protobuf.message import DecodeError

from kiln.cas.digest import Digest
from kiln.core.errors import InvalidArgument
from kiln.ir.serialize import kernel_graph_from_pb
from kiln.ir.serialize import dtype_from_pb, graph_from_pb, tensor_spec_from_pb
from kiln.ir.shape import format_shape
from kiln.cas.store import BlobStore
from kiln.v1 import ir_pb2


def _parse(data: bytes, cls):
    m = cls()
    try:
        m.ParseFromString(data)
    except DecodeError:
        return None
    return m


def identify(data: bytes):
    """(kind, message) of a blob; artifacts are told apart by their required fields."""
    b = _parse(data, ir_pb2.Bundle)
    if b is not None and b.target and b.entry and b.module_source:
        return "bundle", b
    kg = _parse(data, ir_pb2.KernelGraph)
    if kg is not None and kg.kernels and kg.graph.nodes:
        try:
            return "kernel_graph", kernel_graph_from_pb(kg)
        except ValueError:
            pass
    g = _parse(data, ir_pb2.Graph)
    if g is not None and g.nodes:
        try:
            return "graph", graph_from_pb(g)
        except ValueError:
            pass
    m = _parse(data, ir_pb2.WeightManifest)
    if m is not None and m.weights and all(w.name and w.digest.hash for w in m.weights):
        return "manifest", m
    return "blob", data


def show(store: BlobStore, digest: Digest) -> str:
    data = store.get(digest)
    kind, obj = identify(data)
    if kind == "graph":
        return f"Graph {digest}\n" + obj.format()
    if kind == "kernel_graph":
        lines = [f"KernelGraph {digest}: {len(obj.kernels)} kernels over {len(obj.graph.nodes)} nodes"]
        for k in obj.kernels:
            lines.append(f"  {k.name}: {k.kind}, writes %{k.output}, reads "
                         f"{', '.join('%' + str(r) for r in k.reads) or 'nothing'}, computes "
                         f"{len(k.nodes)} nodes{', parallel' if k.parallel else ''}")
        lines.append(obj.graph.format())
        return "\n".join(lines)
    if kind == "bundle":
        ins = ", ".join(f"{t.name}: {s.dtype.value}{format_shape(s.shape)}"
                        for t, s in ((t, tensor_spec_from_pb(t)) for t in obj.inputs))
        outs = ", ".join(f"{t.name}: {s.dtype.value}{format_shape(s.shape)}"
                         for t, s in ((t, tensor_spec_from_pb(t)) for t in obj.outputs))
        lines = [f"Bundle {digest} (target {obj.target}), {len(obj.kernels)} kernels",
                 f"  inputs:  {ins}", f"  outputs: {outs}",
                 f"  weights: {len(obj.weight_names)}", f"  peak memory: {obj.memory.peak_bytes} bytes",
                 "", obj.module_source]
        for k in obj.kernels:
            lines += [f"# ---- {k.name} ({k.kind}): module kiln_{k.symbol}", k.source]
        return "\n".join(lines)
    if kind == "manifest":
        lines = [f"WeightManifest {digest}: {len(obj.weights)} tensors"]
        for w in obj.weights:
            lines.append(f"  {w.name}: {dtype_from_pb(w.dtype).value}{list(w.shape)} -> "
                         f"{w.digest.hash}/{w.digest.size_bytes}")
        return "\n".join(lines)
    return f"blob {digest}: {len(data)} bytes, not a kiln artifact"
