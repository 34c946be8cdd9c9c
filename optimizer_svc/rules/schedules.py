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
what. Extraction (cost.schedule_costs) prices each of a kernel's schedules from the profile:
work over the threads its outer loop can use, plus the measured fixed cost of a parallel or a
serial kernel; a read with a stride of a cache line or more costs STRIDED_READ per element, the
axis-outer order's accumulators ACCUMULATE; an attention tile's two BLAS calls cost a serial
kernel's fixed cost each, its scores STRIDED_READ when the tile outgrows TILE_CACHE_BYTES; a
GEMM tile's extra BLAS calls the same, plus B packed again per call (GEMM_PACK) and its block of
C read back from memory (STRIDED_READ) when it outgrows C_CACHE_BYTES. The
kernel gets its cheapest schedule, and the choice reaches the partition as `Node.schedule`: a
GEMM too small to repay waking the pool stays serial and a large one splits, by the same cost
that picks the kernels themselves. Reductions of few rows may be split along their reduced
axis (rules/reductions.py) to give the pool an outer loop to share.

Vector widths ("/vec=N" after any of the above): numba's LLVM picks one SIMD width for every
loop (on AVX-512 CPUs it prefers 256 bits); a kernel scheduled with a width is compiled asking
for vectors of at most N bits (kiln/runtime/vectorwidth.py). Every kernel gets each of its schedules
with each width up to the widest the target measured (`pool_vector_bits`). Extraction scales the
kernel's in-cache loop work (a GEMM's epilogue on C, attention's softmax, a row kernel, a
reduction whose input fits in cache) by the width's measured factor (Calibrate's vector_rates:
the same in-cache loop at each width), so a width is chosen only where the target ran it faster,
and the timed candidates confirm it. Widths written into the source (partial sums in a local
array) lose to LLVM's own vectorization (a row sum of [512, 4096] f32: 91 us as one loop;
650 to 2080 us with 8 to 64 partial sums), which is why the width is asked of LLVM instead.
"""

from __future__ import annotations

from egglog import String, eq, f64, i64, rule, ruleset, union, var

from kiln.ir.graph import ATTENTION_TILES, GEMM_TILES, VECTOR_WIDTHS
from optimizer_svc.terms import Term, pool_threads, pool_vector_bits

schedules = ruleset(name="schedules")

_e, _x, _y = var("e", Term), var("x", Term), var("y", Term)
_k, _t, _v = var("k", i64), var("t", i64), var("v", i64)
_s = var("s", String)
_n, _eps = var("n", f64), var("eps", f64)

ROWS = (Term.softmax(_x, _k), Term.rms_norm(_x, _k, _n, _eps), Term.layer_norm(_x, _k, _n, _eps))
REDUCTIONS = (Term.sum_reduce(_x, _k), Term.max_reduce(_x, _k))
TILED = tuple(f"{p}/tile={t}" for p in ("serial", "parallel") for t in GEMM_TILES)
# each kernel's schedules: one thread or the pool; loop order: a plain reduction may loop its
# axis outside the axes after it; parallel axes: the pool shares the first outer loop, or all
# outer loops collapsed into one; tile size: the rows of C a GEMM computes per BLAS call (its
# epilogue right after), the query rows fused attention works at a time
OFFERS = ((Term.gemm(_x, _y, _k), ("serial", "parallel") + TILED),
          *((row, ("serial", "parallel", "parallel/collapse")) for row in ROWS),
          *((r, ("serial", "parallel", "serial/axis-outer", "parallel/axis-outer", "parallel/axis-outer/collapse",
                 "parallel/collapse")) for r in REDUCTIONS),
          (Term.attention(_x, _s, _y, _k), tuple(f"{p}/tile={t}" for p in ("serial", "parallel")
                                                 for t in ATTENTION_TILES)))


def _offer(*names):
    return [union(_e).with_(Term.scheduled(_e, String(n))) for n in names]


schedules.register(
    *(rule(eq(_e).to(kernel), eq(_t).to(pool_threads()), _t > i64(1)).then(*_offer(*names))
      for kernel, names in OFFERS),
    # vector widths, each with every schedule, up to the widest the target has
    *(rule(eq(_e).to(kernel), eq(_t).to(pool_threads()), _t > i64(1), eq(_v).to(pool_vector_bits()),
           _v >= i64(bits)).then(*_offer(*(f"{name}/vec={bits}" for name in names)))
      for kernel, names in OFFERS for bits in VECTOR_WIDTHS))
