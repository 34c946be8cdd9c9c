"""kiln.runtime.unroll: a kernel lowered through kiln's pipeline is unrolled within O2's budget
(its machine code a fraction of what LLVM's O3 budget makes of a kernel's constant-trip loops),
computes what numba's own pipeline computes, and leaves LLVM's budget as it was for code compiled
outside kiln's kernels."""

import numpy as np
from numba import njit, prange

from kiln.runtime import unroll
from kiln.runtime.pipeline import kernel_pipeline

OPTIONS = dict(parallel=True, error_model="numpy", fastmath={"reassoc", "contract"})


def _row_max(out, x):  # as the codegen writes a max over 8x12x64 rows of 64: constant trip counts
    for i0 in prange(8):
        for i1 in range(12):
            for i2 in range(64):
                acc = np.float32(-np.inf)
                nan = False
                for r in range(64):
                    v = x[i0 * 49152 + i1 * 4096 + i2 * 64 + r]
                    acc = v if v > acc else acc
                    nan = nan | (v != v)
                out[i0 * 768 + i1 * 64 + i2] = np.float32(np.nan) if nan else acc


def _ir_lines(f) -> int:
    (ir,) = f.inspect_llvm().values()
    return ir.count("\n")


def test_kernels_unroll_within_o2s_budget_and_compute_numbas_values():
    x = np.random.default_rng(0).standard_normal(8 * 12 * 64 * 64).astype(np.float32)
    x[77] = np.nan
    numbas, before = njit(**OPTIONS)(_row_max), np.empty(8 * 12 * 64, np.float32)
    numbas(before, x)
    kilns, got = njit(pipeline_class=kernel_pipeline(), **OPTIONS)(_row_max), np.empty_like(before)
    kilns(got, x)
    np.testing.assert_array_equal(got, before)
    assert np.isnan(got[1]) and got[0] == x[:64].max()
    # at O3's budget the second loop is unrolled around the vectorized innermost. How far depends
    # on the CPU: 25,187 lines against kiln's 1,059 on one machine, 2,432 against 648 on another
    # (an AVX-512 EPYC), so the bound is a factor of two
    assert _ir_lines(kilns) * 2 < _ir_lines(numbas), (_ir_lines(kilns), _ir_lines(numbas))
    # and code compiled after a kernel is unrolled as LLVM does by default again
    after = njit(**OPTIONS)(_row_max)  # a new dispatcher: compiled anew
    out = np.empty_like(before)
    after(out, x)
    assert _ir_lines(after) == _ir_lines(numbas)


def test_the_budget_is_set_once_for_nested_lowering_and_restored_at_the_outermost(monkeypatch):
    calls = []
    monkeypatch.setattr(unroll, "_set", calls.append)
    with unroll.capped():
        with unroll.capped():  # a gufunc lowered inside its kernel's lowering
            pass
        assert calls == [unroll.THRESHOLD]
    assert calls == [unroll.THRESHOLD, unroll.LLVM_DEFAULT]
    try:
        with unroll.capped():
            raise RuntimeError("a failed lowering")
    except RuntimeError:
        pass
    assert calls[-1] == unroll.LLVM_DEFAULT
