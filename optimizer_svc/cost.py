"""What the search minimizes and what it predicts: the one cost model of the optimizer.

Extraction weights (first half): extraction picks, per e-class, the cheapest e-node by a
bottom-up fixpoint; a compute op costs the elements it computes, weighted by op (views 0.01,
leaves and constants 0), a GEMM its multiply-adds at the target's BLAS rate, a row kernel less
than its primitive ops, and each schedule (rules/schedules.py) what the target's calibrated
profile (Pool) says it costs. The same tile and loop-order terms price kernels in the roofline.

The roofline (second half): The roofline cost model: predicted run time of a KernelGraph on a measured target.

Each kernel costs the larger of its compute time and its memory time, plus the target's fixed
cost per kernel (a parallel kernel's, measured on a prange loop, or a serial one's). A GEMM
computes 2·B·M·N·K flops (an attention kernel: its two GEMMs', plus its softmax's elementwise
work) at the GFLOP/s that Calibrate measured for the nearest shape class (by log of M·N·K; a
single-row GEMM uses the GEMV class), one thread's rate, times the pool's threads when the GEMM
is parallel; every kernel moves its output and the buffers it reads once
at the measured bandwidth, and elementwise work runs at the measured elementwise rate (both
measured with the whole pool: a serial kernel gets one thread's share), one unit per element
for each elementwise or reduction op (views and constants are free; a GEMM's epilogue counts,
its Mul and SumReduce are its GEMM time). Work on data in cache (a GEMM's epilogue on its
block of C, attention's softmax on its tile of scores) runs at the measured in-cache rate, so a
fused epilogue is priced below a separate pass that streams C back from memory. A reduction over an axis with a cache line or more of
elements after it pays the search's strided-read factor in its default loop order, its
accumulator factor in the axis-outer order (order_factor), as extraction prices them; a
GEMM's tile of rows (B packed per BLAS call, a block of C read back from memory) and attention's
tile of query rows (two BLAS calls per tile, scores out of cache) likewise
(gemm_tile_extra, attention_tile_extra; a BLAS call costs a serial kernel's fixed cost).
A kernel compiled with a SIMD vector width has its in-cache loop work (an epilogue, attention's
softmax, a row kernel's, an elementwise kernel's, a reduction's whose input fits in cache) scaled
by the width's measured factor (vector_factors). Symbolic dims take their largest binding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from kiln.ir.graph import ATTENTION_TILES, DEFAULT_ATTENTION_TILE, DEFAULT_GEMM_TILE, GEMM_TILES, Graph
from kiln.ir.kernel import KernelGraph, gemm_axes, gemm_dims, kernel_gemm, largest_elements
from kiln.ir.ops import Op
from kiln.ir.shape import evaluate_dim, numel
from kiln.v1 import services_pb2
from optimizer_svc.encode import BY_NAME, TERM_NAME, literal


# ---- extraction weights: element units (one elementwise op on one element by one thread) ----

GEMM_WEIGHT = 0.25  # one multiply-add of a BLAS GEMM, against 1 for each op of a generated loop

VECTOR_NOISE = 0.05  # vector rates within this of LLVM's own width's count as equal to it


def vector_factors(profile) -> dict[int, float]:
    """Per SIMD vector width (bits) the target measured, its in-cache work's time against LLVM's
    preferred width (Calibrate's vector_rates): below 1 where the width runs faster; 1 where
    the two differ by no more than VECTOR_NOISE, so a width is asked for only when it matters."""
    rates = {v.bits: v.gelems for v in profile.vector_rates if v.gelems > 0}
    if 0 not in rates:
        return {}
    factors = {bits: rates[0] / rate for bits, rate in sorted(rates.items()) if bits}
    return {bits: 1.0 if abs(f - 1.0) <= VECTOR_NOISE else round(f, 3) for bits, f in factors.items()}


@dataclass(frozen=True)
class Pool:
    """What schedules cost on the target (rules/schedules.py), in extraction's units (one
    elementwise op on one element by one thread): its parallel pool's threads, the fixed cost
    of a parallel and of a serial kernel, one thread's BLAS multiply-add, an elementwise op on
    data in cache, and each SIMD vector width's factor on in-cache work (vector_factors)."""
    threads: int
    parallel_overhead: float
    serial_overhead: float
    gemm_mac: float = GEMM_WEIGHT
    cached: float = 1.0
    vector: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def from_profile(profile) -> Optional["Pool"]:
        """From a TargetProfile (Executor.Calibrate); None for one thread or no measurements."""
        if profile is None or profile.threads <= 1 or profile.elementwise_gelems <= 0:
            return None
        unit_us = profile.threads / (profile.elementwise_gelems * 1e3)  # µs per element-op, one thread
        serial = profile.serial_overhead_us or profile.kernel_overhead_us
        rates = sorted(g.gflops for g in profile.gemm if g.m > 1 and g.n > 1 and g.gflops > 0)
        mac = 2e-3 / rates[len(rates) // 2] / unit_us if rates else GEMM_WEIGHT  # µs per MAC / µs per unit
        cached = min(1.0, profile.elementwise_gelems / profile.cached_gelems) if profile.cached_gelems > 0 else 1.0
        return Pool(profile.threads, round(profile.kernel_overhead_us / unit_us, 1), round(serial / unit_us, 1),
                    round(mac, 4), round(cached, 4), tuple(vector_factors(profile).items()))

    @property
    def widest_vector(self) -> int:
        return max((bits for bits, _ in self.vector), default=0)

    def canonical(self) -> dict:
        return {"threads": self.threads, "parallel_overhead": self.parallel_overhead,
                "serial_overhead": self.serial_overhead, "gemm_mac": self.gemm_mac, "cached": self.cached,
                "vector": [list(v) for v in self.vector]}

# relative cost of one element of each op: transcendental ops are polynomial evaluations
_OP_WEIGHT = {"exp2": 4.0, "log2": 4.0, "sin": 4.0, "sqrt": 2.0, "recip": 2.0, "mod": 2.0}

VIEW_COST = 0.01  # views are free at run time; a small cost prefers fewer of them

# a row kernel's cost per element: below its primitive ops' (softmax 10, RMS norm 3, layer norm 5)
# because it reads its input once and writes only its result
_ROW_WEIGHT = {"softmax": 5.0, "rms_norm": 2.0, "layer_norm": 3.0}

ATTENTION_SAVING = 1.0  # per probability: a fused attention kernel never writes nor reads P


def _node_cost(name: str, elements: int) -> float:
    if name in ("input", "weight", "const"):
        return 0.0
    if name == "view":
        return VIEW_COST
    if name == "gemm":  # elements: the multiply-adds
        return GEMM_WEIGHT * elements
    if name in _ROW_WEIGHT:
        return _ROW_WEIGHT[name] * elements
    return _OP_WEIGHT.get(name, 1.0) * elements


def graph_cost(g: Graph) -> float:
    """The cost extraction minimizes, for a whole Graph: elements computed, weighted by op."""
    largest = {name: hi for name, _, hi in g.symbols}
    in_gemm = {n.inputs[0] for n in g.nodes if n.kernel in ("gemm", "attention")}  # a GEMM's Mul
    total = 0.0
    for i, n in enumerate(g.nodes):
        if i in in_gemm:
            continue
        if n.kernel in ("gemm", "attention"):
            total += _node_cost("gemm", evaluate_dim(numel(g.nodes[n.inputs[0]].shape), largest))
        else:
            total += _node_cost(TERM_NAME[n.op], evaluate_dim(numel(n.shape), largest))
    return total


def enode_cost(n: dict, cls: str, nodes: dict, elements: dict[str, int]) -> float:
    """An e-node's own cost. A reduction costs the elements it reads; a GEMM its multiply-adds
    (the elements of its broadcast operand views); attention, those of P · V less what not
    writing P saves."""
    name = BY_NAME[n["op"]]
    kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["op"] in BY_NAME]
    if name in ("merged_weight", "scheduled"):  # a schedule prices its class's kernel (schedule_costs)
        return float("inf")
    if name in ("gemm", "sum_reduce", "max_reduce"):
        return _node_cost(name, elements.get(kids[0], 1))
    if name == "attention":
        return max(0.0, _node_cost("gemm", elements.get(kids[1], 1)) - ATTENTION_SAVING * elements.get(kids[0], 1))
    return _node_cost(name, elements.get(cls, 1))

SCHEDULED = ("gemm", "attention", "softmax", "rms_norm", "layer_norm", "sum_reduce", "max_reduce")

GEMM_BLOCK_ROWS = 64  # codegen's fewest rows per block of a GEMM split across the pool

# loop order of a reduction whose axis is not its input's innermost: by default each output
# element's loop steps along the axis with the stride of the axes after it, a cache line per
# element once that stride reaches 16 floats; axis-outer reads in memory order but updates a
# row of accumulators per element (in cache: a load and a store)
STRIDED_READ = 3.0

ACCUMULATE = 0.5

LINE_ELEMENTS = 16


def order_factor(inner: int, axis_outer: bool) -> float:
    """A reduction's work factor for its loop order, `inner` the elements after its axis (also
    the roofline's, cost.predict)."""
    if inner <= 1:
        return 1.0
    if axis_outer:
        return 1.0 + ACCUMULATE
    return 1.0 + STRIDED_READ if inner >= LINE_ELEMENTS else 1.0

TILE_CACHE_BYTES = 1 << 18  # an attention tile's scores, probabilities and output rows stay in cache up to this

C_CACHE_BYTES = 1 << 21  # a GEMM's block of C stays in cache from BLAS writing it to its epilogue reading it up to this

VECTOR_TIE = 1e-3  # what asking LLVM for a vector width costs over not asking: equal work keeps its own choice

GEMM_PACK = 1.0  # per element of B: BLAS packs B again for every call (a tile of rows) after the first


def width_matters(reduce_read_bytes: int) -> bool:
    """Whether a reduction reading this many bytes runs from cache, where its vector width can
    matter (streamed from memory, it cannot); extraction and the roofline (cost.predict) both ask."""
    return reduce_read_bytes <= C_CACHE_BYTES


def gemm_tile_extra(rows: int, n: int, k: int, tile: int, epilogue: bool = True) -> tuple[int, float]:
    """What computing one thread's `rows` rows of a GEMM's C (N columns, K deep) `tile` rows per
    BLAS call (0: all in one), each block's epilogue right after, costs beyond the GEMM itself:
    (BLAS calls beyond the first, element units). Every call after the first packs B again; a
    block of C larger than C_CACHE_BYTES has left the cache before its epilogue reads it back.
    Extraction (schedule_costs, which cannot know the fusion yet: it assumes an epilogue) and
    the roofline (cost.predict) both price a tile by it."""
    blocks = -(-rows // tile) if tile else 1
    block = min(tile, rows) if tile else rows
    cold = STRIDED_READ * rows * n if epilogue and block * n * 4 > C_CACHE_BYTES else 0.0
    return blocks - 1, (blocks - 1) * k * n * GEMM_PACK + cold


def attention_tile_extra(batch: int, m: int, keys: int, d: int, tile: int) -> tuple[int, float]:
    """What fused attention over `batch` matrices of M query rows, `keys` keys and D output
    columns, `tile` query rows at a time, costs beyond its two GEMMs: (BLAS calls, element
    units). Two BLAS calls per tile; a tile whose scores, probabilities and output rows outgrow
    TILE_CACHE_BYTES reads its scores and probabilities back from memory."""
    tasks = batch * -(-m // tile)
    cold = STRIDED_READ * 2 * batch * m * keys if (2 * keys + d) * tile * 4 > TILE_CACHE_BYTES else 0.0
    return 2 * tasks, cold


def schedule_costs(n: dict, cls: str, nodes: dict, shapes: dict[str, tuple], largest: dict, work: float,
                    pool: Pool) -> dict[str, float]:
    """The cost of e-node n's kernel under each schedule: serial, its work plus a serial kernel's
    fixed cost; parallel, its work over the threads its outer loop can keep busy plus a parallel
    kernel's fixed cost. A GEMM (or attention) shares blocks of at least GEMM_BLOCK_ROWS rows of
    its result; a reduction or row kernel, its first loop of more than one iteration (in the
    axis-outer order, of the axes before the reduced one), or collapsed, all its outer loops'
    iterations. A GEMM's tile of rows per BLAS call and attention's tile of query rows add what
    gemm_tile_extra and attention_tile_extra say. Each schedule "/vec=N" for the widths the
    target measured scales the kernel's in-cache loop work (vector_work) by that width's factor,
    over the same threads."""
    name = BY_NAME[n["op"]]
    out = [evaluate_dim(d, largest) for d in shapes.get(cls, ())]

    def first_loop(dims) -> int:
        return next((d for d in dims if d > 1), 1)

    product = math.prod
    costs: dict[str, tuple[float, int]] = {}  # schedule -> (cost, threads sharing the work)
    if name == "gemm":
        work *= pool.gemm_mac / GEMM_WEIGHT  # the target's BLAS rate, not extraction's flat weight
        axis = literal(nodes[n["children"][2]])
        dims = [d for j, d in enumerate(out) if j != axis]  # batch.., M, N (N last)
        m, cols = product(dims[:-1]), dims[-1] if dims else 1
        depth = evaluate_dim(shapes.get(nodes[n["children"][0]]["eclass"], out)[axis], largest)
        # the pool shares blocks of at least GEMM_BLOCK_ROWS rows; then each thread's rows go
        # through BLAS a tile at a time (no tile: the codegen's, DEFAULT_GEMM_TILE rows on the pool)
        for head, threads, fixed in (("serial", 1, pool.serial_overhead),
                                     ("parallel", max(1, min(pool.threads, m // GEMM_BLOCK_ROWS)),
                                      pool.parallel_overhead)):
            for tile in (0,) + GEMM_TILES:
                calls, units = gemm_tile_extra(-(-m // threads), cols, depth,
                                               tile or (DEFAULT_GEMM_TILE if head == "parallel" else 0))
                costs[head + (f"/tile={tile}" if tile else "")] = (work / threads + calls * pool.serial_overhead
                                                                   + units + fixed, threads)
        vector_work = product(out) * pool.cached  # an epilogue (assumed: fusion comes later) on C in cache
    else:
        if name == "attention":
            axis = literal(nodes[n["children"][3]])
            dims = [d for j, d in enumerate(out) if j != axis]  # batch.., M, D
            batch, m, d = product(dims[:-2]), dims[-2] if len(dims) > 1 else 1, dims[-1] if dims else 1
            p_class, v_class = nodes[n["children"][0]]["eclass"], nodes[n["children"][2]]["eclass"]
            p_elements = product(evaluate_dim(x, largest) for x in shapes.get(p_class, ()))
            keys = max(1, p_elements // max(1, batch * m))
            # P · V at the target's BLAS rate, less what never writing nor reading P saves
            macs = product(evaluate_dim(x, largest) for x in shapes.get(v_class, ()))
            work = max(0.0, macs * pool.gemm_mac - ATTENTION_SAVING * p_elements)
            orders = {}
            for t in ATTENTION_TILES:
                calls, cold = attention_tile_extra(batch, m, keys, d, t)
                # the pool shares the tiles, their BLAS calls and cache misses
                orders[f"/tile={t}"] = (work + calls * pool.serial_overhead + cold, batch * -(-m // t), None)
            vector_work = p_elements * pool.cached  # the softmax on each tile's scores
        elif name in ("sum_reduce", "max_reduce"):
            axis = literal(nodes[n["children"][1]])
            inner = product(out[axis + 1:])
            orders = {"": (work * order_factor(inner, False), first_loop(out), product(out))}
            if inner > 1:  # the axes after the reduced one: the default order's stride
                orders["/axis-outer"] = (work * order_factor(inner, True), first_loop(out[:axis]), product(out[:axis]))
            vector_work = work if width_matters(int(work) * 4) else 0.0
        else:  # row kernels: the row axis is not looped over outside
            axis = literal(nodes[n["children"][1]])
            rows = [d for j, d in enumerate(out) if j != axis]
            orders = {"": (work, first_loop(rows), product(rows))}
            vector_work = work  # each row's later passes read it from cache
        for order, (w, usable, collapsed) in orders.items():
            costs["serial" + order] = (w + pool.serial_overhead, 1)
            threads = max(1, min(pool.threads, usable))
            costs["parallel" + order] = (w / threads + pool.parallel_overhead, threads)
            if collapsed is not None:
                threads = max(1, min(pool.threads, collapsed))
                costs["parallel" + order + "/collapse"] = (w / threads + pool.parallel_overhead, threads)
    priced = {schedule: cost for schedule, (cost, _) in costs.items()}
    for bits, factor in pool.vector:
        for schedule, (cost, threads) in costs.items():
            # ties go to LLVM's own width: it asks for nothing
            priced[f"{schedule}/vec={bits}"] = cost + vector_work * (factor - 1.0) / threads + VECTOR_TIE
    return priced

KERNEL_CALL_COST = 2000.0  # a GEMM call's fixed cost, in element units: what sharing one GEMM saves

NODE_COST = 0.01  # per op of the program: between programs of equal work, the one with fewer ops


# ---- the roofline: seconds on the measured target ----

FREE = (Op.VIEW, Op.CONSTANT, Op.INPUT, Op.WEIGHT)


@dataclass(frozen=True)
class KernelCost:
    kernel: str
    kind: str
    seconds: float
    bound: str  # compute | memory | overhead


def gemm_rate(profile: services_pb2.TargetProfile, m: int, n: int, k: int) -> float:
    """GFLOP/s for an M×N×K GEMM: the measured class nearest in log(M·N·K), GEMV for M or N = 1."""
    if not profile.gemm:
        raise ValueError("target profile has no GEMM rates")
    if min(m, n) == 1:
        gemv = [g for g in profile.gemm if g.m == 1 or g.n == 1]
        if gemv:
            return gemv[0].gflops
    size = math.log(max(m * n * k, 1))
    return min(profile.gemm, key=lambda g: abs(math.log(g.m * g.n * g.k) - size)).gflops


def _gemm_seconds(g, gi: int, env, profile: services_pb2.TargetProfile, pool: int) -> float:
    batch, m, n, kk = (evaluate_dim(d, env) for d in gemm_dims(g, gi)[1:])
    return 2.0 * batch * m * n * kk / (gemm_rate(profile, m, n, kk) * 1e9 * pool)


def _ops(g, k) -> int:
    """The kernel's elementwise and reduction ops, each a unit of work per element: views and
    constants cost nothing, and a GEMM's Mul and SumReduce are in its GEMM time."""
    gemms = [kernel_gemm(g, k)] if k.kind == "gemm" else [k.scores, k.output] if k.kind == "attention" else []
    inside_gemm = {j for gi in gemms for j in (gi, g.nodes[gi].inputs[0])}
    return sum(1 for j in k.nodes if j not in inside_gemm and g.nodes[j].op not in FREE)


def predict(kg: KernelGraph, profile: services_pb2.TargetProfile) -> list[KernelCost]:
    g = kg.graph
    env = {name: hi for name, _, hi in g.symbols}
    elems = lambda i: largest_elements(g, i)  # noqa: E731 (env: every symbol at its largest)
    threads = max(profile.threads, 1)
    bw = max(profile.bandwidth_gbs, 1e-3) * 1e9
    rate = max(profile.elementwise_gelems, 1e-3) * 1e9
    cached = max(profile.cached_gelems * 1e9, rate)  # a profile from before it was measured: the streaming rate
    serial_overhead = (profile.serial_overhead_us or profile.kernel_overhead_us) * 1e-6  # also one BLAS call's
    factors = vector_factors(profile)
    out = []
    for k in kg.kernels:
        vector = factors.get(k.vector, 1.0) if k.vector else 1.0
        share = 1.0 if k.parallel else 1.0 / threads
        overhead = (profile.kernel_overhead_us if k.parallel or not profile.serial_overhead_us
                    else profile.serial_overhead_us) * 1e-6
        moved = (elems(k.output) * g.nodes[k.output].dtype.itemsize
                 + sum(elems(j) * g.nodes[j].dtype.itemsize for j in k.reads))
        pool = threads if k.parallel else 1
        ops = _ops(g, k)
        if k.kind == "gemm":
            gi = kernel_gemm(g, k)
            compute = _gemm_seconds(g, gi, env, profile, pool) + elems(k.output) * ops * vector / (cached * share)
            batch, m, n, depth = (evaluate_dim(d, env) for d in gemm_dims(g, gi)[1:])
            if batch == 1:  # one thread's rows of C in tiles: B packed per BLAS call, C out of cache
                used = max(1, min(pool, m // GEMM_BLOCK_ROWS))
                # no searched tile: the codegen's blocks, for an epilogue on the pool's blocks of rows
                default = DEFAULT_GEMM_TILE if k.parallel and ops > 0 else 0
                calls, units = gemm_tile_extra(-(-m // used), n, depth, k.tile or default, ops > 0)
                compute += calls * serial_overhead + units * threads / rate
        elif k.kind == "attention":  # two GEMMs and, per score, the softmax's elementwise work
            p = gemm_axes(g, k.output).a_root
            compute = (_gemm_seconds(g, k.scores, env, profile, pool) + _gemm_seconds(g, k.output, env, profile, pool)
                       + elems(p) * max(1, ops) * vector / (cached * share))
            batch, m, keys = (evaluate_dim(d, env) for d in gemm_dims(g, k.scores)[1:4])
            # its tile's BLAS calls and cache misses, shared by the pool
            calls, units = attention_tile_extra(batch, m, keys, evaluate_dim(gemm_dims(g, k.output)[3], env),
                                                k.tile or DEFAULT_ATTENTION_TILE)
            compute += calls * serial_overhead / pool + units / (rate * share)
        else:
            work = elems(g.nodes[k.output].inputs[0]) if k.kind == "reduce" else elems(k.output)
            compute = work * max(1, ops) / (rate * share)
            if k.kind == "reduce":  # its loop order, priced as extraction prices it
                n = g.nodes[k.output]
                compute *= order_factor(evaluate_dim(numel(n.shape[n.axis + 1:]), env), k.order == "axis-outer")
            if k.kind != "reduce" or width_matters(work * g.nodes[g.nodes[k.output].inputs[0]].dtype.itemsize):
                compute *= vector
        memory = moved / (bw * share)
        body = max(compute, memory)
        bound = "overhead" if overhead > body else ("compute" if compute >= memory else "memory")
        out.append(KernelCost(k.name, k.kind, body + overhead, bound))
    return out
