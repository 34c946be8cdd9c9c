"""Partition an extracted Graph into kernels: the KernelGraph.

A node is materialized (gets a buffer) when it is a leaf, an output, a reduction, a data op,
read by several nodes, read through a broadcasting view, or read by a GEMM or data op;
everything else is inlined into its single consumer's loop nest. A SumReduce the search chose
to compute by a GEMM (`Node.kernel`, rules/matmul.py) is a GEMM kernel when its Mul's operands
are views of buffers along disjoint broadcast axes (gemm_axes).

A Schedule holds the choices beyond that: which GEMMs call BLAS and which stay generated
loops (a fused reduction), and which loops run on the parallel pool. Where the search chose a
kernel's schedule (`Node.schedule` on its root, rules/schedules.py) the kernel takes it; other
loops (elementwise kernels, and every kernel of a search that did not know its target) go by
the Schedule's size thresholds. The optimizer ranks the distinct partitions the schedule grid
gives (with the search's schedules, and with thresholds alone) by the cost model; the fastest
is found by timing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, parse_schedule
from kiln.ir.kernel import (Kernel, KernelGraph, broadcasts, flat_reads, gemm_axes, gemm_dims,
                             gemm_writes_rows, kernel_gemm, largest_elements, row_broadcast_axis, view_root)
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import contiguous_strides, evaluate_dim, numel

NEVER = 1 << 62


@dataclass(frozen=True)
class Schedule:
    """The kernel choices a partition makes, beyond which nodes get a buffer."""
    parallel_min_elements: int = 1 << 15  # elementwise/reduce loops this large run on the pool
    parallel_min_macs: int = 1 << 18      # GEMMs with this many multiply-adds split across the pool
    blas_min_macs: int = 0                # smaller GEMMs are generated loops (a fused reduction), not BLAS
    epilogues: bool = True                # elementwise work on a GEMM's result runs in the GEMM's kernel
    rows: bool = True                     # reductions read back along their row (softmax, norms) fuse into one kernel
    attention: bool = True                # GEMM, row kernel, GEMM (Q·Kᵀ, softmax, ·V) fuse into one tiled kernel
    searched: bool = True                 # a kernel whose root carries the search's schedule (Node.schedule) takes it

    def describe(self) -> str:
        show = lambda v: "never" if v >= NEVER else str(v)  # noqa: E731
        return (f"blas>={self.blas_min_macs} par>={show(self.parallel_min_elements)} "
                f"gemm-par>={show(self.parallel_min_macs)}{'' if self.epilogues else ' no-epilogue'}"
                f"{'' if self.rows else ' no-rows'}{'' if self.attention or not self.rows else ' no-attention'}"
                f"{'' if self.searched else ' thresholds-only'}")


DEFAULT_SCHEDULE = Schedule()
# the grid candidate schedules are drawn from (optimizer.candidates ranks them by the cost model)
# (attention fusion needs row kernels: without them there is no softmax kernel to fuse)
SCHEDULE_GRID = tuple(Schedule(pe, pm, bm, ep, rows, attn, searched)
                      for searched in (True, False) for rows, attn in ((True, True), (True, False), (False, False))
                      for ep in (True, False) for bm in (0, 1 << 16) for pe in (1 << 15, 1 << 13, NEVER)
                      for pm in (1 << 20, 1 << 18, NEVER))
# no GEMM under 2^18 multiply-adds (~15 us of one thread's BLAS) is split: waking the pool
# costs more when it slept or another runtime's threads hold the cores (a tiny Llama at
# seq 1, entry right after a torch call: 190 us with its one parallel GEMV, 41 us alone)


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
        if op is Op.SUM_REDUCE and fuse and node.kernel in ("gemm", "attention"):  # the search's choice
            ga = gemm_axes(g, i)
            macs = evaluate_dim(numel(g.nodes[node.inputs[0]].shape), largest)
            if ga is not None and len(users[node.inputs[0]]) == 1 and macs >= schedule.blas_min_macs:
                gemms[i] = ga
                materialize[ga.a_root] = materialize[ga.b_root] = True
    # consumers before producers: a node is inlined when every real consumer (looking through
    # views) is computed in one kernel and none reads it through a broadcast; a node read
    # several times in its kernel is computed once per statement there (codegen names it)
    root_of: dict[int, int] = {}
    for i in reversed(range(n)):
        node = g.nodes[i]
        if node.op in (Op.CONSTANT, Op.VIEW):
            continue
        if not materialize[i]:
            if not fuse and (node.op in GroupOp.Elementwise or node.op is Op.IOTA):
                materialize[i] = True
            else:
                readers = _readers(g, users, i)
                # an output view (read as a buffer, like a broadcast) has no kernel of its own
                roots = set() if any(bcast for _, bcast in readers) else {root_of[u] for u, _ in readers}
                if len(roots) != 1:
                    materialize[i] = True
                else:
                    root_of[i] = roots.pop()
        if materialize[i]:
            root_of[i] = i
    for i in gemms:  # the Mul under a GEMM is computed by the GEMM, never materialized
        materialize[g.nodes[i].inputs[0]] = False
    if fuse and schedule.epilogues:
        _fuse_epilogues(g, users, outputs, gemms, materialize, root_of)
    row_axis = _fuse_rows(g, users, outputs, gemms, materialize) if fuse and schedule.rows else {}
    kernels = []
    for i, node in enumerate(g.nodes):
        if not materialize[i] or node.op in (Op.INPUT, Op.WEIGHT):
            continue
        inside, reads = _collect(g, i, materialize)
        gemm = next((j for j in inside if j in gemms), None)
        kind = ("gemm" if gemm is not None else "row" if i in row_axis else
                "reduce" if node.op in GroupOp.Reduce else
                "gather" if node.op is Op.GATHER else "scatter" if node.op is Op.SCATTER else "elementwise")
        kernels.append(Kernel(f"k{len(kernels)}_{kind}", kind, tuple(inside), i, tuple(reads), False,
                              row_axis.get(i, -1)))
    if fuse and schedule.rows and schedule.attention:
        kernels = _fuse_attention(g, users, outputs, kernels)
    return with_parallel(KernelGraph(g, tuple(kernels)), schedule)


def with_parallel(kg: KernelGraph, schedule: Schedule) -> KernelGraph:
    """The kernels with the schedule's parallel choices: which loops run on the pool depends only
    on each kernel's size, so one partition serves every schedule that shares its structure."""
    return with_choices(kg, schedule_choices(kg, schedule))


def with_choices(kg: KernelGraph, choices: tuple) -> KernelGraph:
    """The kernels with schedule_choices' (parallel, order, tile, collapse, vector) each."""
    return KernelGraph(kg.graph, tuple(
        Kernel(k.name, k.kind, k.nodes, k.output, k.reads, parallel, k.axis, k.scores, order, tile, collapse, vector)
        for k, (parallel, order, tile, collapse, vector) in zip(kg.kernels, choices)))


def schedule_choices(kg: KernelGraph, schedule: Schedule) -> tuple:
    """Per kernel, what the schedule makes of it: (parallel, order, tile, collapse, vector). The
    search's grid has some 200 schedules and a 30-layer model's program 400-800 kernels, so these
    are worked out before any kernel is built, and a schedule that changes nothing builds none."""
    g = kg.graph

    def work(i: int) -> int:  # a reduction's (or GEMM's) input elements, else the node's own
        n = g.nodes[i]
        return largest_elements(g, n.inputs[0] if n.op in GroupOp.Reduce else i)

    def chosen(k: Kernel):  # the search's schedule for the kernel, where its root has one
        if not schedule.searched or k.kind not in ("gemm", "attention", "row", "reduce"):
            return None
        return g.fact("searched_schedule", (k.kind, k.output, k.nodes), lambda: _searched_schedule(g, k))

    def parallel(k: Kernel) -> bool:  # by the size thresholds
        if k.kind in ("elementwise", "reduce", "row"):
            return work(k.output) >= schedule.parallel_min_elements
        if k.kind == "gemm":
            return work(kernel_gemm(g, k)) >= schedule.parallel_min_macs
        if k.kind == "attention":  # either GEMM, or the softmax between them, is large enough
            return (work(k.scores) >= schedule.parallel_min_macs or work(k.output) >= schedule.parallel_min_macs
                    or work(gemm_axes(g, k.output).a_root) >= schedule.parallel_min_elements)
        return False

    def single(k: Kernel) -> bool:  # one matrix, not a batch: its rows of C come in tiles
        return gemm_dims(g, kernel_gemm(g, k))[1] == 1

    def scheduled(k: Kernel) -> tuple:
        s = chosen(k)
        if s is None:
            return parallel(k), "", 0, False, 0
        # a bool reduction keeps the default order (a scalar accumulator)
        axis_outer = k.kind == "reduce" and s.axis_outer and g.nodes[k.output].dtype is not DType.BOOL
        return (s.parallel, "axis-outer" if axis_outer else "",
                s.tile if k.kind == "attention" or (k.kind == "gemm" and single(k)) else 0,
                s.collapse and k.kind in ("reduce", "row"), s.vector)

    return tuple(scheduled(k) for k in kg.kernels)


def _searched_schedule(g: Graph, k: Kernel):
    """The schedule the search marked on the kernel's root (parse_schedule), or None."""
    root = g.nodes[kernel_gemm(g, k) if k.kind == "gemm" else k.output]
    if k.kind == "row":  # the row term's root, which elementwise work after it (a norm's weight) may follow
        root = next((g.nodes[j] for j in k.nodes if g.nodes[j].kernel == "row" and g.nodes[j].schedule), root)
    if k.kind == "gemm" and root.kernel != "gemm":  # attention's P·V on its own: its tile is no GEMM's
        return None
    return parse_schedule(root.schedule)


def _fuse_attention(g: Graph, users, outputs, kernels: list[Kernel]) -> list[Kernel]:
    """Attention as one kernel: a GEMM whose result only a row kernel reads (scores = Q·Kᵀ,
    with its epilogue: scale, mask), the row kernel (softmax along the keys) whose result only
    a second GEMM reads as its left operand, contracting the row axis (P·V). The fused kernel
    works a tile of query rows at a time: scores for the tile, each row's softmax, then the
    tile of P times V, so neither scores nor probabilities are ever written to memory. Rows
    must line up: the row axis is the innermost, the scores are read at their own flat
    positions and are C[batch, M, N] of the first GEMM, and P is the second GEMM's [batch, M, K]
    operand with the same batch and M."""
    by_output = {k.output: k for k in kernels}
    fused: dict[int, Kernel] = {}
    gone: set[int] = set()
    for r in kernels:
        if r.kind != "row" or r.output in outputs:
            continue
        p, a = r.output, r.axis
        S = tuple(g.nodes[p].shape)
        if any(d != 1 for d in S[a + 1:]) or not g.nodes[p].dtype.is_float:
            continue
        readers = _readers(g, users, p)
        if len(readers) != 1:  # the GEMM's Mul, through the view that broadcasts P along N
            continue
        mul = readers[0][0]
        pv = next((k for k in kernels if k.kind == "gemm" and g.nodes[k.output].kernel == "attention"
                   and g.nodes[k.output].inputs[0] == mul and k.output not in gone), None)
        if pv is None or not gemm_writes_rows(g, pv.output):
            continue
        pa = gemm_axes(g, pv.output)
        F2, B2, M2, N2, K2 = gemm_dims(g, pv.output)
        if pa.a_root != p or pa.a_spec is None or pa.a_spec.offset != 0 or numel(S) != numel((B2, M2, K2)) or \
                tuple(pa.a_spec.strides[j] for j in pa.batch_axes + pa.m_axes + (g.nodes[pv.output].axis,)) != \
                contiguous_strides(tuple(F2[j] for j in pa.batch_axes + pa.m_axes) + (K2,)):
            continue
        members = set(r.nodes)
        for e in r.reads:
            qk = by_output.get(e)
            if qk is None or qk.kind != "gemm" or e in outputs or e in gone:
                continue
            gi = kernel_gemm(g, qk)
            F1, B1, M1, N1, _ = gemm_dims(g, gi)
            if (B1, M1, N1) != (B2, M2, S[a]) or K2 != S[a] or numel(S) != numel(g.nodes[e].shape):
                continue
            if not gemm_writes_rows(g, gi) or any(u not in members for u, _ in _readers(g, users, e)):
                continue
            if not flat_reads(g, {e}, members) or not flat_reads(g, set(qk.nodes), set(qk.nodes)):
                continue
            aligned = _aligned(g, p, members)
            if any(view_root(g, x)[0] == e and m not in aligned for m in members
                   if g.nodes[m].op is not Op.VIEW for x in g.nodes[m].inputs):
                continue
            nodes = set(qk.nodes) | members | set(pv.nodes)
            reads = (set(qk.reads) | set(r.reads) | set(pv.reads)) - {e, p}
            # an operand computed by an elementwise kernel only this attention reads (Q scaled by
            # 1/sqrt(d), a rotary embedding) is computed as the kernel packs the operand
            sa = gemm_axes(g, gi)
            for root in {sa.a_root, sa.b_root, pa.b_root}:
                ek = by_output.get(root)
                if (ek is not None and ek.kind == "elementwise" and root not in outputs and root not in gone
                        and not g.nodes[root].dtype.is_half
                        and all(u in nodes for u, _ in _readers(g, users, root))
                        and not any(root in k.reads for k in kernels if k.output not in (qk.output, r.output,
                                                                                          pv.output))):
                    nodes |= set(ek.nodes)
                    reads = (reads | set(ek.reads)) - {root}
                    gone.add(root)
            nodes = tuple(sorted(nodes))
            fused[pv.output] = Kernel("", "attention", nodes, pv.output, in_use_order(g, nodes, reads),
                                      False, a, gi)
            gone |= {qk.output, r.output}
            break
    out = []
    for k in kernels:
        if k.output in gone:
            continue
        k = fused.get(k.output, k)
        out.append(Kernel(f"k{len(out)}_{k.kind}", k.kind, k.nodes, k.output, k.reads, k.parallel, k.axis,
                          k.scores))
    return out


def _fuse_epilogues(g: Graph, users, outputs, gemms, materialize, root_of) -> None:
    """Leave a GEMM's result unmaterialized when its readers are elementwise work that all ends
    in one elementwise kernel holding no other GEMM: that kernel multiplies, then applies the
    epilogue (bias, activation, residual) to each element as it stores it."""
    claimed = set()
    inner = set(gemms) | {g.nodes[i].inputs[0] for i in gemms}  # GEMMs and the Muls they consume
    for i in sorted(gemms):
        readers = _readers(g, users, i)
        if i in outputs or not readers or any(b or u in inner or g.nodes[u].op not in GroupOp.Elementwise
                                              for u, b in readers):
            continue
        roots = {root_of[u] for u, _ in readers}
        if len(roots) != 1:
            continue
        root = roots.pop()
        if root in claimed or root in inner or g.nodes[root].op not in GroupOp.Elementwise:
            continue
        claimed.add(root)
        materialize[i] = False


def _fuse_rows(g: Graph, users, outputs, gemms, materialize) -> dict[int, int]:
    """Row kernels: softmax, layer norm and RMS norm as one kernel each. An elementwise kernel
    over shape S that reads, back along one axis a, a reduction over a (directly or through
    elementwise work on the reduced shape) takes that reduction in: per row it runs each
    reduction's loop, then writes the row. A buffer is absorbed when all its readers are in
    the kernel and every read stays within the row: per-element values (shape S) read
    directly, row values (S with a = 1) read directly by row values or through the one view
    that broadcasts them along a. Returns each row kernel's root and axis."""
    out: dict[int, int] = {}
    absorbed: set[int] = set()
    for root in reversed(range(len(g.nodes))):
        node = g.nodes[root]
        if not materialize[root] or node.op not in GroupOp.Elementwise or root in absorbed:
            continue
        S = tuple(node.shape)
        members = set(_collect(g, root, materialize)[0])
        if any(j in gemms for j in members) or not any(g.nodes[j].kernel == "row" for j in members):
            continue  # only rows the search chose (rules/norms.py)
        axis = None
        grew = True
        while grew:
            grew = False
            for q in sorted(_member_reads(g, members, materialize), reverse=True):
                a = _absorbable(g, users, outputs, gemms, materialize, root, members, q, S, axis)
                if a is None:
                    continue
                axis = a
                materialize[q] = False
                absorbed.add(q)
                members |= set(_collect(g, q, materialize)[0])
                grew = True
                break
        if axis is not None:
            out[root] = axis
    return out


def _member_reads(g: Graph, members: set[int], materialize) -> set[int]:
    reads = set()
    for m in members:
        if g.nodes[m].op is Op.VIEW:
            continue
        for x in g.nodes[m].inputs:
            r = view_root(g, x)[0]
            if materialize[r] and r not in members:
                reads.add(r)
    return reads


def _aligned(g: Graph, root: int, members: set[int]) -> set[int]:
    """Members evaluated only at the kernel's own index: the root, and what aligned members read
    directly (a reduction reads its input along the row), less every member that some member
    also reads through a view other than a row value's broadcast, and all it depends on. Such a
    member is evaluated at other rows too (a softmax's result added to its own transpose), so
    no row value may be read from it: the kernel holds only its own row's."""
    shifted, stack = set(), []
    for m in members:
        n = g.nodes[m]
        if n.op is Op.VIEW and n.inputs[0] in members and \
                row_broadcast_axis(n.view, g.nodes[n.inputs[0]].shape) is None:
            stack.append(n.inputs[0])
    while stack:
        m = stack.pop()
        if m not in shifted:
            shifted.add(m)
            stack += [x for x in g.nodes[m].inputs if x in members]
    aligned, stack = {root}, [root]
    while stack:
        m = stack.pop()
        for x in g.nodes[m].inputs:
            if x in members and x not in aligned and g.nodes[x].op is not Op.VIEW:
                aligned.add(x)
                stack.append(x)
            elif g.nodes[x].op is Op.VIEW and g.nodes[x].inputs[0] in members:
                r = g.nodes[x].inputs[0]  # a row value read back along the row
                if r not in aligned and g.nodes[r].op is not Op.VIEW and \
                        row_broadcast_axis(g.nodes[x].view, g.nodes[r].shape) is not None:
                    aligned.add(r)
                    stack.append(r)
    return aligned - shifted


def _absorbable(g: Graph, users, outputs, gemms, materialize, root: int, members, q: int, S,
                axis) -> Optional[int]:
    """The row axis under which buffer q can join the row kernel over S, or None."""
    n = g.nodes[q]
    if q in outputs or q in gemms or n.op in GroupOp.Leaf or n.op in (Op.GATHER, Op.SCATTER):
        return None
    if n.op not in GroupOp.Elementwise and n.op not in GroupOp.Reduce:
        return None
    if any(u not in members for u, _ in _readers(g, users, q)):
        return None
    if any(j in gemms for j in _collect(g, q, materialize)[0]):  # an epilogue stays in its GEMM
        return None
    shape = tuple(n.shape)
    if n.op in GroupOp.Reduce:
        a = n.axis
        if tuple(g.nodes[n.inputs[0]].shape) != S or S[a] == 1 or axis not in (None, a):
            return None
    elif shape == S:
        a = axis
    else:
        a = axis
        if a is None:  # a row value's axis: where its shape is 1 and S is not
            diff = [k for k, (d, sd) in enumerate(zip(shape, S)) if d != sd] if len(shape) == len(S) else []
            if len(diff) != 1:
                return None
            a = diff[0]
    row = tuple(1 if k == a else d for k, d in enumerate(S)) if a is not None else None
    is_row = shape == row and shape != S
    if not is_row and shape != S:
        return None
    aligned = _aligned(g, root, members)
    for m in members:  # every read of q from the kernel stays in the row
        mn = g.nodes[m]
        if mn.op is Op.VIEW:
            continue
        m_row = mn.op in GroupOp.Reduce or tuple(mn.shape) == row
        if m not in aligned and any(view_root(g, x)[0] == q for x in mn.inputs):
            return None  # its index is not the kernel's (a view permutes or reshapes it)
        for x in mn.inputs:
            if view_root(g, x)[0] != q:
                continue
            if x == q:
                if mn.op in GroupOp.Reduce:
                    if is_row:  # a reduction's input is per element
                        return None
                elif m_row != is_row:
                    return None
            else:
                v = g.nodes[x]
                if not is_row or m_row or g.nodes[v.inputs[0]].op is Op.VIEW or v.inputs[0] != q:
                    return None
                if row_broadcast_axis(v.view, shape) != a:
                    return None
    return a


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
        # an output view's own copy is never read: a kernel reads through the view to its source
        if materialize[j] and not top and g.nodes[j].op is not Op.VIEW:
            reads.append(j)
            return
        for k in g.nodes[j].inputs:
            visit(k, False)
        inside.append(j)

    visit(root, True)
    return inside, reads  # in the order the kernel's computation first reads them (see in_use_order)


def in_use_order(g: Graph, nodes, reads) -> tuple[int, ...]:
    """A kernel's reads in the order its nodes (in topological order) first use them, never by
    node id: the same layer repeated reads its weights and activations in the same order, so its
    kernels get the same argument lists and codegen writes (and numba compiles) each one once."""
    reads, order = set(reads), {}
    for j in nodes:
        for x in g.nodes[j].inputs:
            if x in reads:
                order.setdefault(x, len(order))
    return tuple(sorted(reads, key=lambda x: (order.get(x, len(order)), x)))
