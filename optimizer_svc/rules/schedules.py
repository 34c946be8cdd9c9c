"""Schedules: how each kernel runs, as e-nodes that compete in the same search.

Every e-class holding a kernel the partition always forms (a GEMM, fused attention, a softmax,
RMS norm or layer norm row kernel, a reduction) gets `Term.scheduled(x, "serial")` and
`Term.scheduled(x, "parallel")` members: one thread, or the kernel's outer loop (a GEMM's
blocks of rows) split across the target's pool. A plain reduction also gets each with
"/axis-outer", its loop order: the reduced axis looped outside the axes after it, reading the
input in memory order into a row of accumulators, where the default order reads it with the
stride of those axes. The parallel schedules of reductions and row kernels may "/collapse" their
outer loops into one loop the pool shares (parallel axes: all of them, not only the first of
more than one iteration, which may be shorter than the pool). Tile sizes ("/tile=N"): fused
attention works N query rows at a time (small tiles give the pool more tasks, large ones fewer
BLAS calls, until a tile's scores and probabilities no longer stay in cache); a GEMM computes
N rows of C per BLAS call and runs its epilogue on them right after (small tiles keep the block
of C in cache for the epilogue, and packed rows of A for BLAS; every call packs B again). The rules fire only when the search knows
the target's pool (`pool_threads`, entered from its TargetProfile).

A schedule member reads its own e-class: it names how the class's kernel is computed, never
what. Extraction (search._schedule_costs) prices each of a kernel's schedules from the profile:
work over the threads its outer loop can use, plus the measured fixed cost of a parallel or a
serial kernel; a read with a stride of a cache line or more costs STRIDED_READ per element, the
axis-outer order's accumulators ACCUMULATE; an attention tile's two BLAS calls cost a serial
kernel's fixed cost each, its scores STRIDED_READ when the tile outgrows TILE_CACHE_BYTES; a
GEMM tile's extra BLAS calls the same, plus B packed again per call (GEMM_PACK) and its block of
C read back from memory (STRIDED_READ) when it outgrows C_CACHE_BYTES. The
kernel gets its cheapest schedule, and the choice reaches the partition as `Node.schedule`: a
GEMM too small to repay waking the pool stays serial and a large one splits, by the same cost
that picks the kernels themselves. Reductions of few rows may be split along their reduced
axis (rules/reductions.py) to give the pool an outer loop to share. Vector widths are not a
choice here: numba's LLVM picks them for each loop (kernels are compiled with reassociation
allowed, so reductions vectorize), and widths written into the source lose to it (a row sum
of [512, 4096] f32: 91 us as one loop LLVM vectorizes; 650 to 2080 us with 8 to 64 partial
sums in a local array, 920 to 1600 us with 2 to 32 scalar partial sums).
"""

from __future__ import annotations

from egglog import String, eq, f64, i64, rule, ruleset, union, var

from kiln.ir.graph import ATTENTION_TILES, GEMM_TILES
from optimizer_svc.terms import Term, pool_threads

schedules = ruleset(name="schedules")

_e, _x, _y = var("e", Term), var("x", Term), var("y", Term)
_k, _t = var("k", i64), var("t", i64)
_s = var("s", String)
_n, _eps = var("n", f64), var("eps", f64)

ROWS = (Term.softmax(_x, _k), Term.rms_norm(_x, _k, _n, _eps), Term.layer_norm(_x, _k, _n, _eps))
REDUCTIONS = (Term.sum_reduce(_x, _k), Term.max_reduce(_x, _k))
KERNELS = (Term.gemm(_x, _y, _k),) + ROWS + REDUCTIONS


def _offer(*names):
    return [union(_e).with_(Term.scheduled(_e, String(n))) for n in names]


schedules.register(
    *(rule(eq(_e).to(kernel), eq(_t).to(pool_threads()), _t > i64(1)).then(*_offer("serial", "parallel"))
      for kernel in KERNELS),
    # loop order: a plain reduction may loop its axis outside the axes after it
    *(rule(eq(_e).to(kernel), eq(_t).to(pool_threads()), _t > i64(1)).then(
        *_offer("serial/axis-outer", "parallel/axis-outer", "parallel/axis-outer/collapse")) for kernel in REDUCTIONS),
    # parallel axes: the pool shares the first outer loop, or all outer loops collapsed into one
    *(rule(eq(_e).to(kernel), eq(_t).to(pool_threads()), _t > i64(1)).then(*_offer("parallel/collapse"))
      for kernel in ROWS + REDUCTIONS),
    # tile size: the rows of C a GEMM computes per BLAS call, its epilogue right after
    rule(eq(_e).to(Term.gemm(_x, _y, _k)), eq(_t).to(pool_threads()), _t > i64(1)).then(
        *_offer(*(f"{p}/tile={t}" for p in ("serial", "parallel") for t in GEMM_TILES))),
    # tile size: the query rows fused attention works at a time
    rule(eq(_e).to(Term.attention(_x, _s, _y, _k)), eq(_t).to(pool_threads()), _t > i64(1)).then(
        *_offer(*(f"{p}/tile={t}" for p in ("serial", "parallel") for t in ATTENTION_TILES))))
