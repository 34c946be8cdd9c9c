"""Partition an extracted Graph into kernels: the KernelGraph.

A node is materialized (gets a buffer) when it is a leaf, an output, a reduction, a data op,
read by several nodes, read through a broadcasting view, or read by a GEMM or data op;
everything else is inlined into its single consumer's loop nest. A SumReduce of a broadcast
Mul whose operands are views of buffers along disjoint broadcast axes is a GEMM kernel.

A Schedule holds the choices beyond that: which GEMMs call BLAS and which stay generated
loops (a fused reduction), and which loops run on the parallel pool. The optimizer ranks the
distinct partitions the schedule grid gives by the cost model; the fastest is found by timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir.graph import Graph
from kiln.ir.kernel import Kernel, KernelGraph, broadcasts, gemm_axes, view_root
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import evaluate_dim, numel

NEVER = 1 << 62


@dataclass(frozen=True)
class Schedule:
    """The kernel choices a partition makes, beyond which nodes get a buffer."""
    parallel_min_elements: int = 1 << 15  # elementwise/reduce loops this large run on the pool
    parallel_min_macs: int = 1 << 18      # GEMMs with this many multiply-adds split across the pool
    blas_min_macs: int = 0                # smaller GEMMs are generated loops (a fused reduction), not BLAS

    def describe(self) -> str:
        show = lambda v: "never" if v >= NEVER else str(v)  # noqa: E731
        return (f"blas>={self.blas_min_macs} par>={show(self.parallel_min_elements)} "
                f"gemm-par>={show(self.parallel_min_macs)}")


DEFAULT_SCHEDULE = Schedule()
# the grid candidate schedules are drawn from (optimizer.candidates ranks them by the cost model)
SCHEDULE_GRID = tuple(Schedule(pe, pm, bm) for bm in (0, 1 << 12, 1 << 16)
                      for pe in (1 << 15, 1 << 13, 1 << 17, NEVER)
                      for pm in (1 << 18, 1 << 16, 1 << 20, NEVER))


def partition(g: Graph, fuse: bool = True, schedule: Schedule = DEFAULT_SCHEDULE) -> KernelGraph:
    users = g.consumers()
    largest = {name: hi for name, _, hi in g.symbols}  # size the schedule for the largest binding
    outputs = set(g.outputs)
    n = len(g.nodes)
    materialize = [False] * n
    gemms: dict[int, tuple] = {}
    for i, node in enumerate(g.nodes):
        op = node.op
        if op in GroupOp.Leaf and op is not Op.CONSTANT:
            materialize[i] = True
        if op in GroupOp.Reduce or op in (Op.GATHER, Op.SCATTER) or i in outputs:
            materialize[i] = True
        if op in (Op.GATHER, Op.SCATTER):
            for j in node.inputs:
                materialize[view_root(g, j)[0]] = True
        if op is Op.SUM_REDUCE and fuse:
            ga = gemm_axes(g, i)
            macs = evaluate_dim(numel(g.nodes[node.inputs[0]].shape), largest)
            if ga is not None and len(users[node.inputs[0]]) == 1 and macs >= schedule.blas_min_macs:
                gemms[i] = ga
                materialize[ga.a_root] = materialize[ga.b_root] = True
    for i, node in enumerate(g.nodes):
        if node.op in (Op.CONSTANT, Op.VIEW) or materialize[i]:
            continue
        if not fuse and (node.op in GroupOp.Elementwise or node.op is Op.IOTA):
            materialize[i] = True
            continue
        # count real consumers, looking through views
        readers = _readers(g, users, i)
        if len(readers) != 1 or any(bcast for _, bcast in readers):
            materialize[i] = True
    for i in gemms:  # the Mul under a GEMM is computed by the GEMM, never materialized
        materialize[g.nodes[i].inputs[0]] = False
    kernels = []
    for i, node in enumerate(g.nodes):
        if not materialize[i] or node.op in (Op.INPUT, Op.WEIGHT):
            continue
        inside, reads = _collect(g, i, materialize)
        kind = ("gemm" if i in gemms else "reduce" if node.op in GroupOp.Reduce else
                "gather" if node.op is Op.GATHER else "scatter" if node.op is Op.SCATTER else "elementwise")
        total = evaluate_dim(numel(g.nodes[node.inputs[0]].shape if node.op in GroupOp.Reduce else node.shape),
                             largest)
        parallel = (total >= schedule.parallel_min_elements and kind in ("elementwise", "reduce")
                    or kind == "gemm" and total >= schedule.parallel_min_macs)
        kernels.append(Kernel(f"k{len(kernels)}_{kind}", kind, tuple(inside), i, tuple(reads), parallel))
    return KernelGraph(g, tuple(kernels))


def _readers(g: Graph, users, i: int) -> list[tuple[int, bool]]:
    """Non-view consumers of node i, with whether they read it through a broadcasting view."""
    out = []
    stack = [(u, False) for u in users[i]]
    while stack:
        u, bcast = stack.pop()
        if g.nodes[u].op is Op.VIEW:
            b2 = bcast or broadcasts(g.nodes[u].view)
            if not users[u]:  # a view that is itself an output reads i as a buffer
                out.append((u, True))
            stack.extend((w, b2) for w in users[u])
        else:
            out.append((u, bcast))
    return out


def _collect(g: Graph, root: int, materialize):
    inside, reads, seen = [], [], set()

    def visit(j: int, top: bool):
        if j in seen:
            return
        seen.add(j)
        if materialize[j] and not top:
            reads.append(j)
            return
        for k in g.nodes[j].inputs:
            visit(k, False)
        inside.append(j)

    visit(root, True)
    return inside, sorted(set(reads))
