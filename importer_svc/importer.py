"""Importer stage: a torch.export program -> primitive Graph + one blob per weight tensor."""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from importer_svc.lowerings import KEEP_UNDECOMPOSED, LOWERINGS
from importer_svc.safe_load import load_program
from kiln.cas import cache
from kiln.cas.digest import Digest
from kiln.core.errors import FailedPrecondition, InvalidArgument, KilnError
from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, prune
from kiln.ir.serialize import graph_to_pb, manifest_to_pb
from kiln.ir.shape import Sym, format_shape, from_sympy
from kiln.cas.store import BlobStore
from kiln.core.telemetry import span
from kiln.ir.dtypes import torch_to_numpy
from kiln.v1 import ir_pb2

aten = torch.ops.aten

STAGE_VERSION = "importer-1-" + cache.code_version("importer_svc", "kiln.ir")


@dataclass(frozen=True)
class ImportResult:
    graph: Digest
    manifest: Digest
    node_count: int


def source_of(node) -> str:
    """`file:line` of the user code that produced an FX node, and its module path."""
    trace = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in [^\n]*\n\s*([^\n]*)', trace)
    user = [f for f in frames if "/torch/" not in f[0] and "/transformers/" not in f[0]] or frames
    where = f"{user[-1][0]}:{user[-1][1]} `{user[-1][2].strip()}`" if user else "unknown source line"
    stack = node.meta.get("nn_module_stack") or {}
    module = list(stack.values())[-1][0] if stack else ""
    return f"{where}" + (f" in module '{module}'" if module else "")


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return torch_to_numpy(t).tobytes()


def decompose(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """Core ATen, except the ops kiln lowers whole (see KEEP_UNDECOMPOSED)."""
    table = torch.export.default_decompositions()
    for op in KEEP_UNDECOMPOSED:
        table.pop(op, None)
    with warnings.catch_warnings():
        # torch's own deepcopy of the program's call specs trips torch's own deprecation notice
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        return ep.run_decompositions(table)


@dataclass(frozen=True)
class OpUse:
    op: str
    count: int
    supported: bool
    first_use: str


def required_ops(ep: torch.export.ExportedProgram) -> list[OpUse]:
    """The ATen ops a program needs after decomposition, and whether each has a lowering."""
    uses: dict[str, list] = {}
    for node in decompose(ep).graph.nodes:
        if node.op == "call_function":
            entry = uses.setdefault(str(node.target), [0, node.target in LOWERINGS, source_of(node)])
            entry[0] += 1
    return [OpUse(op, n, ok, where) for op, (n, ok, where) in sorted(uses.items())]


# ops that decomposition would rewrite but whose lowering takes every form of them, so a program may
# keep them: a Llama's linear, its mask's new_ones, ones_like and &, its rotary embedding's arange
# and transpose, silu (a Llama's prefill and decode must both qualify, or neither: their programs
# then bind the same weight arrays). matmul is not here: its lowering takes only what decomposition leaves of it.
WHOLE = frozenset((aten.linear.default, aten.new_ones.default, aten.ones_like.default, aten.zeros_like.default,
                   aten.full_like.default, aten.__and__.Tensor, aten.__or__.Tensor, aten.arange.default,
                   aten.transpose.int, aten.silu.default, aten.sym_size.int))


@functools.lru_cache(maxsize=1)
def _decomposed() -> frozenset:
    """The ops decompose() rewrites."""
    return frozenset(op for op in torch.export.default_decompositions().keys() if op not in KEEP_UNDECOMPOSED)


def lowered_whole(ep: torch.export.ExportedProgram) -> bool:
    """Whether the exported program can be lowered without decomposing it first: every op has a
    lowering, and is one decomposition would leave as it is (so its lowering sees the forms it
    always sees) or one in WHOLE. Decomposition traces the whole program again (an 8-layer Llama's
    prefill: 14 s); a program with any other op still goes through it."""
    decomposed = _decomposed()
    return all(n.target in LOWERINGS and (n.target not in decomposed or n.target in WHOLE)
               for n in ep.graph.nodes if n.op == "call_function")


def lower_program(ep: torch.export.ExportedProgram) -> tuple[Graph, dict[str, torch.Tensor]]:
    whole = lowered_whole(ep)
    with span("importer.decompose", **{"kiln.decomposed": not whole}):
        if not whole:
            ep = decompose(ep)
    sig = ep.graph_signature
    weight_of: dict[str, str] = {}
    for spec in sig.input_specs:
        if spec.kind.name in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            weight_of[spec.arg.name] = spec.target
    tensors: dict[str, torch.Tensor] = {}
    b = GraphBuilder()
    env: dict[str, object] = {}

    def lookup(a):
        if isinstance(a, torch.fx.Node):
            return env[a.name]
        if isinstance(a, torch.SymInt):
            return _dim(a, "an argument")
        if isinstance(a, (list, tuple)):
            return type(a)(lookup(x) for x in a)
        return a

    outputs: list[int] = []
    for node in ep.graph.nodes:
        b.source = ""
        if node.op == "placeholder":
            val = node.meta.get("val")
            if val is None or isinstance(val, (bool, int, float, str)):
                # export specialized the program on this non-tensor argument: a constant here
                env[node.name] = val
                continue
            if not isinstance(val, torch.Tensor):
                raise FailedPrecondition(f"input {node.name!r} is a {type(val).__name__}; kiln takes tensors and "
                                         "constant Python scalars only")
            shape = _dims(val.shape, node)
            dtype = DType.from_torch(val.dtype)
            if node.name in weight_of:
                name = weight_of[node.name]
                tensor = ep.state_dict.get(name)
                if tensor is None:
                    tensor = ep.constants.get(name)
                if tensor is None:
                    raise InvalidArgument(f"weight {name!r} is missing from the program's state dict")
                tensors[name] = tensor
                env[node.name] = b.weight(name, shape, dtype)
            else:
                env[node.name] = b.input(node.name, shape, dtype)
        elif node.op == "call_function":
            fn = LOWERINGS.get(node.target)
            b.source = f"{node.target} at {source_of(node)}"
            if fn is None:
                raise FailedPrecondition(f"ATen op {node.target} has no kiln lowering "
                                         f"(used at {source_of(node)})")
            try:
                result = fn(b, node, *lookup(node.args), **{k: lookup(v) for k, v in node.kwargs.items()})
            except (FailedPrecondition, InvalidArgument):
                raise
            except NotImplementedError as e:
                raise FailedPrecondition(f"ATen op {node.target} is not supported with these arguments: {e} "
                                         f"(used at {source_of(node)})") from e
            except (KilnError, AssertionError):
                raise
            except Exception as e:  # a bug in a lowering: INTERNAL, with the op that hit it
                raise KilnError(f"internal error lowering {node.target} (used at {source_of(node)}): "
                                f"{type(e).__name__}: {e}") from e
            _check_meta(b, node, result)
            env[node.name] = result
        elif node.op == "output":
            outs = node.args[0]
            outputs = [env[o.name] for o in outs]
        elif node.op == "get_attr":
            raise FailedPrecondition(f"get_attr node {node.target!r} is not supported")
    user_outputs = [s.arg.name for s in sig.output_specs if s.kind.name == "USER_OUTPUT"]
    if len(user_outputs) != len(outputs):
        raise FailedPrecondition("programs that mutate buffers or return non-user outputs are not supported")
    from torch.utils import _pytree as pytree

    tree = pytree.treespec_dumps(ep.call_spec.out_spec) if ep.call_spec.out_spec is not None else ""
    graph = prune(b.build(outputs, user_outputs, tree))
    return dataclasses.replace(graph, symbols=_symbol_ranges(ep, _symbols_in(graph))), tensors


def _symbol_ranges(ep, used: set[str]) -> tuple[tuple[str, int, int], ...]:
    """The program's symbols that the graph uses, with their ranges. (Decomposing a program as
    exported in this process, not loaded from its archive, leaves torch's range for a symbol that
    no shape uses, [2, inf]: no input would bind it.)"""
    out = []
    for sym, vr in ep.range_constraints.items():
        if getattr(sym, "is_Symbol", False) and sym.name in used:
            out.append((sym.name, _bound(vr.lower, 0), _bound(vr.upper, (1 << 31) - 1)))
    return tuple(sorted(out))


def _symbols_in(g: Graph) -> set[str]:
    """Every symbol in the graph's shapes and views."""
    dims = [d for t in g.inputs + g.weights for d in t.shape]
    for n in g.nodes:
        dims += n.shape
        if n.view is not None:
            dims += [*n.view.shape, *n.view.strides, n.view.offset, *(x for r in n.view.mask or () for x in r)]
    return {name for d in dims if isinstance(d, Sym) for name in d.symbols()}


def _bound(v, unbounded: int) -> int:
    """A range end as an int; an infinite one (sympy's oo, or torch's int_oo, which int() refuses)
    is `unbounded`."""
    try:
        return int(v) if v.is_finite else unbounded
    except (AttributeError, TypeError, ValueError, OverflowError):
        return unbounded


def _dim(d, what: str):
    if isinstance(d, int):
        return d
    try:
        return from_sympy(d.node.expr)
    except (AttributeError, ValueError) as e:
        raise FailedPrecondition(f"symbolic dim {d} of {what} is not a polynomial of the input dims") from e


def _dims(shape, node) -> tuple:
    return tuple(_dim(d, repr(node.name)) for d in shape)


def _check_meta(b: GraphBuilder, node, result) -> None:
    """A lowering whose shape or dtype disagrees with torch's is a kiln bug: fail loudly."""
    vals = node.meta.get("val")
    if isinstance(vals, torch.Tensor):
        vals, results = [vals], [result]
    elif isinstance(vals, (tuple, list)):
        results = result
    else:
        return
    for v, r in zip(vals, results):
        if not isinstance(v, torch.Tensor) or r is None:
            continue
        want = _dims(v.shape, node)
        if tuple(b.shape(r)) != want or b.dtype(r) is not DType.from_torch(v.dtype):
            raise AssertionError(f"lowering of {node.target} gave {b.dtype(r).value}{format_shape(b.shape(r))}, "
                                 f"torch says {v.dtype}{format_shape(want)}")


# torch.export's loading and decomposition keep process-wide state (dispatch modes, op
# registrations): two imports at once in one process fail inside torch (seen: "Trying to
# override a python impl ..."), so an importer lowers one program at a time; replicas scale it
_torch_export_lock = threading.Lock()


def import_program(store: BlobStore, program: Digest, deadline: Optional[float] = None) -> ImportResult:
    key = cache.action_key("import", STAGE_VERSION, {"program": program}, {})
    with cache.flight(store, key, deadline) as hit:  # one replica does it; the others wait
        if hit is not None:
            g = store.get_message(hit["graph"], ir_pb2.Graph)
            return ImportResult(hit["graph"], hit["manifest"], len(g.nodes))
        data = store.get(program)
        with _torch_export_lock:
            with span("importer.load", **{"kiln.program": str(program)}):
                ep = load_program(data)
                del data  # the archive (every weight once more) is not held while the program is lowered
            with span("importer.lower"):
                graph, tensors = lower_program(ep)
        result = _stored(store, graph, tensors)
        cache.record(store, key, {"graph": result.graph, "manifest": result.manifest})
        return result


def import_exported(store: BlobStore, ep: torch.export.ExportedProgram) -> ImportResult:
    """A program exported in this process, lowered as it is: what import_program does with its
    archive, without the archive. kiln.compile and compile_causal_lm import this way in local mode:
    writing a 30-layer model's two programs as .pt2 archives and loading them back took 25 s of
    a 130 s compile, and the archives held every weight twice more. (The graph is the same one
    import_program gives, but the action cache knows it by the program's export key
    (kiln.exportkey), not by an archive's digest.)"""
    with _torch_export_lock:
        with span("importer.lower"):
            graph, tensors = lower_program(ep)
    return _stored(store, graph, tensors)


def _stored(store: BlobStore, graph: Graph, tensors: dict[str, torch.Tensor]) -> ImportResult:
    """The graph and one blob per weight, with the manifest naming them, written to the store."""
    with span("importer.upload_weights", **{"kiln.weights": len(tensors)}):
        blobs = [(w.name, w.dtype, tensors[w.name].shape, store.put(_tensor_bytes(tensors[w.name])))
                 for w in graph.weights]
        manifest_d = store.put_message(manifest_to_pb(blobs))
    graph_d = store.put_message(graph_to_pb(graph))
    return ImportResult(graph_d, manifest_d, len(graph.nodes))
