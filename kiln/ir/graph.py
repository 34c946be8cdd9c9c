"""The primitive IR: an immutable DAG of nodes in topological order.

Binary ops and Where take inputs of identical shape; broadcasting is always an explicit View.
Reductions keep the reduced axis with size 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kiln.ir.dtypes import DType
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import Shape, format_shape
from kiln.ir.view import ViewSpec


@dataclass(frozen=True)
class Node:
    op: Op
    inputs: tuple[int, ...]
    shape: Shape
    dtype: DType
    name: str = ""              # Input / Weight
    value: float = 0.0          # Constant (a scalar; broadcast it with a View)
    view: Optional[ViewSpec] = None
    axis: int = 0               # reductions, Gather, Scatter
    source: str = ""            # where the node came from (ATen op and source line), for errors
    kernel: str = ""            # the kernel the search chose to compute this node in (KERNEL_CHOICES)
    schedule: str = ""          # the search's schedule for the kernel this node is the root of (parse_schedule)


# The kernel choices the search records on nodes (optimizer_svc/rules: matmul, norms, attention):
# a SumReduce computed by a GEMM ("gemm"), or as the second GEMM of a fused attention kernel
# ("attention"), and the elementwise root of a row kernel ("row": softmax, layer norm, RMS norm).
KERNEL_CHOICES = {"gemm": (Op.SUM_REDUCE,), "attention": (Op.SUM_REDUCE,), "row": tuple(GroupOp.Elementwise)}

# The schedule choices the search records on a kernel's root (optimizer_svc/rules/schedules.py):
# "" leaves it to the partition's thresholds; "serial" runs the kernel on one thread, "parallel"
# splits its outer loop (a GEMM: its rows) across the pool; then optionally "/axis-outer" (plain
# reductions) puts the reduction's loop outside the loops over the axes after it, so the input
# is read in its memory order, "/collapse" (parallel reductions and row kernels) shares all
# their outer loops' iterations across the pool as one loop rather than only the first loop's,
# and "/tile=N" works N rows at a time: an attention kernel's query rows (ATTENTION_TILES), a
# GEMM's rows of C per BLAS call, its epilogue run on them right after (GEMM_TILES), and
# "/vec=N" (any kernel) has its loops vectorized with SIMD vectors of at most N bits
# (VECTOR_WIDTHS; none: LLVM's preferred width for the target; kiln/runtime/vectorwidth.py). Only
# reductions (GEMMs, attention) and row kernels' roots carry one: they are kernel roots whatever
# else the partition decides.
ATTENTION_TILES = (16, 32, 64, 128)
DEFAULT_ATTENTION_TILE = 64  # query rows per tile where no tile was searched
GEMM_TILES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
DEFAULT_GEMM_TILE = 256  # rows of C per BLAS call of a GEMM split across the pool, where no tile was searched
VECTOR_WIDTHS = (128, 256, 512)  # bits


@dataclass(frozen=True)
class KernelSchedule:
    parallel: bool
    axis_outer: bool = False
    collapse: bool = False
    tile: int = 0  # 0: the codegen's default tile
    vector: int = 0  # widest SIMD vector in bits; 0: LLVM's preferred width


def parse_schedule(s: str) -> Optional[KernelSchedule]:
    """A node's schedule string as a KernelSchedule (None for ""); ValueError when malformed."""
    if not s:
        return None
    head, *rest = s.split("/")
    if head not in ("serial", "parallel"):
        raise ValueError(f"unknown schedule {s!r}")
    axis_outer, collapse, tile, vector = False, False, 0, 0
    for part in rest:
        if vector:  # the width comes last
            raise ValueError(f"unknown schedule {s!r}")
        if part == "axis-outer" and not (axis_outer or collapse or tile):
            axis_outer = True
        elif part == "collapse" and head == "parallel" and not (collapse or tile):
            collapse = True
        elif part.startswith("tile=") and not tile and part[5:] in {str(t) for t in ATTENTION_TILES + GEMM_TILES}:
            tile = int(part[5:])
        elif part.startswith("vec=") and part[4:] in {str(w) for w in VECTOR_WIDTHS}:
            vector = int(part[4:])
        else:
            raise ValueError(f"unknown schedule {s!r}")
    return KernelSchedule(head == "parallel", axis_outer, collapse, tile, vector)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: Shape
    dtype: DType


@dataclass(frozen=True)
class Graph:
    nodes: tuple[Node, ...]
    inputs: tuple[TensorSpec, ...]
    weights: tuple[TensorSpec, ...]
    outputs: tuple[int, ...]
    output_names: tuple[str, ...] = ()
    # pytree structure of the module's outputs, as torch's treespec string (opaque to kiln)
    output_tree: str = ""
    # symbolic dims: (name, min, max), sorted by name
    symbols: tuple[tuple[str, int, int], ...] = ()

    def fact(self, name: str, key, compute):
        """A fact about this graph (`name` of `key`: a node's, a kernel's), computed once and kept
        with it: its nodes never change, so what the optimizer asks for again for every candidate
        schedule (a GEMM's axes, a node's element count, the graph's serialization) is worked out
        once. Not part of the graph's value."""
        facts = self.__dict__.get("_facts")
        if facts is None:
            facts = {}
            object.__setattr__(self, "_facts", facts)
        known = facts.setdefault(name, {})
        if key not in known:
            known[key] = compute()
        return known[key]

    def consumers(self) -> list[list[int]]:
        users: list[list[int]] = [[] for _ in self.nodes]
        for i, n in enumerate(self.nodes):
            for j in n.inputs:
                users[j].append(i)
        return users

    def format(self) -> str:
        lines = [f"graph: {len(self.nodes)} nodes"]
        for t in self.inputs:
            lines.append(f"  input  {t.name}: {t.dtype.value}{format_shape(t.shape)}")
        for t in self.weights:
            lines.append(f"  weight {t.name}: {t.dtype.value}{format_shape(t.shape)}")
        for i, n in enumerate(self.nodes):
            lines.append(f"  %{i} = {format_node(n)}")
        lines.append("  return " + ", ".join(f"%{o}" for o in self.outputs))
        return "\n".join(lines)


def format_node(n: Node) -> str:
    args = ", ".join(f"%{j}" for j in n.inputs)
    extra = ""
    if n.op in (Op.INPUT, Op.WEIGHT):
        extra = repr(n.name)
    elif n.op is Op.CONSTANT:
        extra = repr(n.value)
    elif n.op is Op.VIEW:
        extra = n.view.key()
    elif n.op in GroupOp.Reduce or n.op in (Op.GATHER, Op.SCATTER):
        extra = f"axis={n.axis}"
    inner = ", ".join(x for x in (args, extra) if x)
    return f"{n.op.value}({inner}) : {n.dtype.value}{format_shape(n.shape)}"


def validate(g: Graph) -> None:
    """Raise ValueError for a malformed graph: dangling or forward references, bad arity,
    shape or dtype mismatches, non-positive static dims."""
    arity = {**{o: 1 for o in GroupOp.Unary}, **{o: 2 for o in GroupOp.Binary}, Op.WHERE: 3,
             Op.SUM_REDUCE: 1, Op.MAX_REDUCE: 1, Op.CAST: 1, Op.VIEW: 1, Op.GATHER: 2, Op.SCATTER: 3,
             Op.IOTA: 0, Op.INPUT: 0, Op.WEIGHT: 0, Op.CONSTANT: 0}
    input_names = {t.name for t in g.inputs}
    weight_names = {t.name for t in g.weights}
    for i, n in enumerate(g.nodes):
        if len(n.inputs) != arity[n.op]:
            raise ValueError(f"node %{i} {n.op.value} takes {arity[n.op]} inputs, got {len(n.inputs)}")
        for j in n.inputs:
            if not 0 <= j < i:
                raise ValueError(f"node %{i} refers to %{j}, which is not an earlier node (cycle or dangling reference)")
        for d in n.shape:
            if isinstance(d, int) and d < 0:
                raise ValueError(f"node %{i} has a negative dim in {format_shape(n.shape)}")
        ins = [g.nodes[j] for j in n.inputs]
        if n.op in GroupOp.Binary or n.op is Op.WHERE:
            shapes = {x.shape for x in ins}
            if len(shapes) != 1 or ins[0].shape != n.shape:
                raise ValueError(f"node %{i} {n.op.value}: operand shapes differ ({[format_shape(x.shape) for x in ins]})")
        if n.op is Op.INPUT and n.name not in input_names:
            raise ValueError(f"node %{i} reads undeclared input {n.name!r}")
        if n.op is Op.WEIGHT and n.name not in weight_names:
            raise ValueError(f"node %{i} reads undeclared weight {n.name!r}")
        if n.op is Op.VIEW and (n.view is None or tuple(n.view.shape) != tuple(n.shape)):
            raise ValueError(f"node %{i} View has no spec or a spec of the wrong shape")
        if n.kernel and n.op not in KERNEL_CHOICES.get(n.kernel, ()):
            raise ValueError(f"node %{i} {n.op.value} cannot be computed as a {n.kernel!r} kernel")
        try:
            sched = parse_schedule(n.schedule)
        except ValueError as e:
            raise ValueError(f"node %{i}: {e}") from None
        if sched is not None and n.op not in GroupOp.Reduce and n.kernel != "row":
            raise ValueError(f"node %{i} {n.op.value} is no kernel root and cannot carry a schedule")
        if sched is not None and sched.axis_outer and (n.op not in GroupOp.Reduce or n.kernel):
            raise ValueError(f"node %{i}: only a plain reduction's loops can be reordered")
        if sched is not None and sched.collapse and n.kernel not in ("", "row"):
            raise ValueError(f"node %{i}: only a reduction's or row kernel's loops collapse")
        if sched is not None and sched.tile and sched.tile not in {"attention": ATTENTION_TILES,
                                                                    "gemm": GEMM_TILES}.get(n.kernel, ()):
            raise ValueError(f"node %{i}: a tile of {sched.tile} rows for a {n.kernel or 'plain'} kernel")
    for o in g.outputs:
        if not 0 <= o < len(g.nodes):
            raise ValueError(f"graph output %{o} does not exist")


def prune(g: Graph) -> Graph:
    """Drop nodes no output depends on, renumbering the rest (order preserved)."""
    live = [False] * len(g.nodes)
    stack = list(g.outputs)
    while stack:
        i = stack.pop()
        if not live[i]:
            live[i] = True
            stack.extend(g.nodes[i].inputs)
    new_id, nodes = {}, []
    for i, n in enumerate(g.nodes):
        if live[i]:
            new_id[i] = len(nodes)
            nodes.append(Node(n.op, tuple(new_id[j] for j in n.inputs), n.shape, n.dtype, n.name, n.value,
                              n.view, n.axis, n.source, n.kernel, n.schedule))
    return Graph(tuple(nodes), g.inputs, g.weights, tuple(new_id[o] for o in g.outputs), g.output_names,
                 g.output_tree, g.symbols)
