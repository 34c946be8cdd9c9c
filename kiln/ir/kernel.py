"""KernelGraph: a Graph partitioned into kernels, the contract between optimizer and codegen."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional

from kiln.ir.graph import ATTENTION_TILES, GEMM_TILES, VECTOR_WIDTHS, Graph
from kiln.ir.ops import Op
from kiln.ir.shape import contiguous_strides, evaluate_dim, numel
from kiln.ir.view import ViewSpec, compose


@dataclass(frozen=True)
class Kernel:
    name: str
    kind: str                 # elementwise | reduce | gemm | gather | scatter | row | attention
    nodes: tuple[int, ...]    # nodes computed inside, in topological order (the last is `output`)
    output: int
    reads: tuple[int, ...]    # materialized nodes read
    parallel: bool
    axis: int = -1            # row and attention kernels: the axis their reductions run along
    scores: int = -1          # attention kernels: the first GEMM (Q·Kᵀ); `output` is the second (P·V)
    order: str = ""           # reduce kernels: "axis-outer" loops the reduced axis outside the axes after it
    tile: int = 0             # attention: query rows per tile; GEMM: rows of C per BLAS call (0: codegen's default)
    collapse: bool = False    # parallel reduce and row kernels: one pool loop over all their outer loops
    vector: int = 0           # cpu: the widest SIMD vector its loops use, in bits (0: LLVM's choice)


@dataclass(frozen=True)
class KernelGraph:
    graph: Graph
    kernels: tuple[Kernel, ...]
    # weight-only work hoisted out of `graph` (optimizer_svc/fold.py): from the model's weights to
    # the derived weights `graph` reads, evaluated once when a session binds its weights
    prepare: Optional[Graph] = None


def check_prepare(g: Graph, prepare: Optional[Graph]) -> None:
    """The prepare graph reads weights only and produces exactly the graph's derived weights."""
    derived = {t.name: t for t in g.weights if t.name.startswith(DERIVED_PREFIX)}
    if prepare is None:
        if derived:
            raise ValueError(f"graph reads derived weights {sorted(derived)} but has no prepare graph")
        return
    if prepare.inputs or prepare.symbols:
        raise ValueError("a prepare graph reads weights only")
    made = {}
    for name, o in zip(prepare.output_names, prepare.outputs):
        n = prepare.nodes[o]
        made[name] = (tuple(n.shape), n.dtype)
    if len(made) != len(prepare.outputs) or set(made) != set(derived) or \
            any(made[k] != (tuple(t.shape), t.dtype) for k, t in derived.items()):
        raise ValueError("the prepare graph's outputs are not the graph's derived weights")
    if any(t.name.startswith(DERIVED_PREFIX) for t in prepare.weights):
        raise ValueError("a prepare graph reads the model's weights, not derived ones")


DERIVED_PREFIX = "kiln:fold:"  # a derived weight's name: no model's weight name holds a colon


KERNEL_KINDS = ("elementwise", "reduce", "gemm", "gather", "scatter", "row", "attention")

# generated kernels are content-addressed: the function is written as KERNEL_PLACEHOLDER, the
# module text hashed, and the placeholder replaced by the symbol the hash gives
KERNEL_PLACEHOLDER = "KILN_KERNEL"


def kernel_symbol(text: str) -> str:
    return "k_" + hashlib.sha256(text.encode()).hexdigest()[:24]


def name_kernel(text: str) -> tuple[str, str]:
    """(symbol, text with the placeholder replaced by it)."""
    symbol = kernel_symbol(text)
    return symbol, text.replace(f"def {KERNEL_PLACEHOLDER}(", f"def {symbol}(")


def kernel_named_by_content(symbol: str, source: str) -> bool:
    return symbol.isidentifier() and \
        kernel_symbol(source.replace(f"def {symbol}(", f"def {KERNEL_PLACEHOLDER}(")) == symbol


@dataclass(frozen=True)
class Gemm:
    """A SumReduce of a broadcast Mul read as a GEMM: per operand the Mul's input node, the
    buffer under its views and their composed view (None when the chain does not compose
    or pads: the operand is then packed element by element through the views), and the
    Mul's axes classified as M (only A varies), N (only B varies) and batch (both vary)."""
    a_node: int
    a_root: int
    a_spec: Optional[ViewSpec]
    b_node: int
    b_root: int
    b_spec: Optional[ViewSpec]
    m_axes: tuple[int, ...]
    n_axes: tuple[int, ...]
    batch_axes: tuple[int, ...]


def largest_elements(g: Graph, i: int) -> int:
    """Node i's element count with every symbol at its largest (what the optimizer sizes kernels by)."""
    return g.fact("largest_elements", i,
                  lambda: evaluate_dim(numel(g.nodes[i].shape), {name: hi for name, _, hi in g.symbols}))


def kernel_gemm(g: Graph, k: Kernel) -> Optional[int]:
    """The GEMM a gemm kernel computes: its output, or a SumReduce inside it whose result the
    kernel's epilogue reads (every other reduction is its own kernel)."""
    if k.kind != "gemm":
        return None
    return next((j for j in (k.output,) + k.nodes if g.nodes[j].op is Op.SUM_REDUCE), None)


def view_root(g: Graph, i: int) -> tuple[int, list[ViewSpec]]:
    """The non-view node under a chain of views, and the chain (innermost first)."""
    chain = []
    while g.nodes[i].op is Op.VIEW:
        chain.append(g.nodes[i].view)
        i = g.nodes[i].inputs[0]
    return i, list(reversed(chain))


def compose_chain(chain: list[ViewSpec]):
    spec = chain[0] if chain else None
    for v in chain[1:]:
        spec = compose(spec, v)
        if spec is None:
            return None
    return spec


def broadcasts(v: ViewSpec) -> bool:
    return any(st == 0 and d != 1 for d, st in zip(v.shape, v.strides))


def gemm_axes(g: Graph, reduce_id: int) -> Optional[Gemm]:
    """The GEMM that reduce_id computes, or None when it is not one."""
    return g.fact("gemm_axes", reduce_id, lambda: _gemm_axes(g, reduce_id))


def _gemm_axes(g: Graph, reduce_id: int) -> Optional[Gemm]:
    r = g.nodes[reduce_id]
    if r.op is not Op.SUM_REDUCE or not r.dtype.is_float:
        return None
    m = g.nodes[r.inputs[0]]
    if m.op is not Op.MUL:
        return None
    operands = []
    for x in m.inputs:
        root, chain = view_root(g, x)
        if g.nodes[root].op is Op.CONSTANT:
            return None
        spec = compose_chain(chain) if chain else ViewSpec.contiguous(g.nodes[root].shape)
        # which axes the operand varies along: the view that feeds the Mul says (an axis an
        # inner view broadcasts counts as varying, which only costs a packed copy)
        strides = spec.strides if spec is not None else chain[-1].strides
        if spec is not None and spec.mask is not None:
            spec = None
        operands.append((x, root, spec, strides))
    (xa, ra, sa, st_a), (xb, rb, sb, st_b) = operands
    k = r.axis
    if st_a[k] == 0 or st_b[k] == 0:
        return None
    axes = {(True, False): [], (False, True): [], (True, True): [], (False, False): []}
    for j, d in enumerate(m.shape):
        if j != k and d != 1:
            axes[(st_a[j] != 0, st_b[j] != 0)].append(j)
    m_axes, n_axes = axes[(True, False)], axes[(False, True)]
    if axes[(False, False)] or not (m_axes or n_axes):
        return None
    return Gemm(xa, ra, sa, xb, rb, sb, tuple(m_axes), tuple(n_axes), tuple(axes[(True, True)]))


def gemm_dims(g: Graph, gi: int):
    """(Mul shape, batch, M, N, K sizes) of the GEMM that SumReduce gi computes."""
    return g.fact("gemm_dims", gi, lambda: _gemm_dims(g, gi))


def _gemm_dims(g: Graph, gi: int):
    ga = gemm_axes(g, gi)
    F = g.nodes[g.nodes[gi].inputs[0]].shape
    prod = lambda axes: numel(tuple(F[j] for j in axes))  # noqa: E731
    return F, prod(ga.batch_axes), prod(ga.m_axes), prod(ga.n_axes), F[g.nodes[gi].axis]


def gemm_writes_rows(g: Graph, gi: int) -> bool:
    """Whether the GEMM's result is laid out as C[batch, M, N] (its buffer is the GEMM's C)."""
    ga = gemm_axes(g, gi)
    F = g.nodes[g.nodes[gi].inputs[0]].shape
    order = ga.batch_axes + ga.m_axes + ga.n_axes
    strides = contiguous_strides(g.nodes[gi].shape)
    return tuple(strides[j] for j in order) == contiguous_strides(tuple(F[j] for j in order))


def flat_preserving(spec: Optional[ViewSpec], src_shape) -> bool:
    """A view that reads its source's elements in their own order: a reshape (size-1 dims aside)."""
    if spec is None or spec.mask is not None or spec.offset != 0 or numel(spec.shape) != numel(src_shape):
        return False
    want = contiguous_strides(spec.shape)
    return all(d == 1 or st == w for d, st, w in zip(spec.shape, spec.strides, want))


def row_broadcast_axis(v: ViewSpec, src_shape) -> Optional[int]:
    """The axis a when view v reads a [.., 1, ..] tensor back along a (stride 0 there, its own
    contiguous strides elsewhere but on dims of size 1, no offset or mask), else None."""
    if v.mask is not None or v.offset != 0 or len(v.shape) != len(src_shape):
        return None
    axes = [k for k, (d, sd) in enumerate(zip(v.shape, src_shape)) if d != sd]
    if len(axes) != 1 or src_shape[axes[0]] != 1:
        return None
    want = list(contiguous_strides(src_shape))
    want[axes[0]] = 0
    # a dim of size 1 is never stepped along, whatever its stride
    same = all(d == 1 or st == w for d, st, w in zip(v.shape, v.strides, want))
    return axes[0] if same else None


def flat_reads(g: Graph, nodes: set[int], members: set[int]) -> bool:
    """Every read of one of `nodes` from `members` sees its elements at their own flat positions
    (a broadcast constant is the same everywhere)."""
    for m in members:
        if g.nodes[m].op is Op.VIEW:
            continue
        for x in g.nodes[m].inputs:
            root, chain = view_root(g, x)
            if root in nodes and chain and g.nodes[root].op is not Op.CONSTANT and \
                    not flat_preserving(compose_chain(chain), g.nodes[root].shape):
                return False
    return True
