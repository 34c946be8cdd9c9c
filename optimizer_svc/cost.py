"""The roofline cost model: predicted run time of a KernelGraph on a measured target.

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
accumulator factor in the axis-outer order (search.order_factor), as extraction prices them; a
GEMM's tile of rows (B packed per BLAS call, a block of C read back from memory) and attention's
tile of query rows (two BLAS calls per tile, scores out of cache) likewise
(search.gemm_tile_extra, attention_tile_extra; a BLAS call costs a serial kernel's fixed cost).
A kernel compiled with a SIMD vector width has its in-cache loop work (an epilogue, attention's
softmax, a row kernel's, an elementwise kernel's, a reduction's whose input fits in cache) scaled
by the width's measured factor (search.vector_factors). Symbolic dims take their largest binding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.ir.graph import DEFAULT_ATTENTION_TILE, DEFAULT_GEMM_TILE
from kiln.ir.kernel import KernelGraph, gemm_axes, gemm_dims, kernel_gemm
from kiln.ir.ops import Op
from kiln.ir.shape import evaluate_dim, numel
from kiln.v1 import services_pb2
from optimizer_svc.search import (GEMM_BLOCK_ROWS, attention_tile_extra, gemm_tile_extra, order_factor,
                                  vector_factors, width_matters)


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
    elems = lambda i: evaluate_dim(numel(g.nodes[i].shape), env)  # noqa: E731
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
