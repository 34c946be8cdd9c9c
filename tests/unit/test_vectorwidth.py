"""kiln.runtime.vectorwidth: a kernel compiled with a vector width gets LLVM code of that width, in its
parallel loops too, and computes the same values."""

import numpy as np
import pytest
from numba import njit, prange

from kiln.runtime.pipeline import kernel_pipeline
from kiln.runtime.vectorwidth import host_widths


def _softmax_rows(x, out):
    for i in prange(x.shape[0]):
        m = -np.inf
        for j in range(x.shape[1]):
            m = max(m, x[i, j])
        s = np.float32(0.0)
        for j in range(x.shape[1]):
            e = (x[i, j] - m) * np.float32(0.5)
            e = np.float32(1.0) + e * (np.float32(0.69) + e * (np.float32(0.24) + e * np.float32(0.055)))
            out[i, j] = e
            s += e
        for j in range(x.shape[1]):
            out[i, j] = out[i, j] / s


def _compiled(width: int):
    options = {"pipeline_class": kernel_pipeline(width)} if width else {}
    fn = njit(parallel=True, error_model="numpy", fastmath={"reassoc", "contract"}, **options)(_softmax_rows)
    x = np.random.default_rng(0).standard_normal((16, 1000)).astype(np.float32)
    out = np.empty_like(x)
    fn(x, out)
    (sig,) = fn.signatures
    return out, fn.overloads[sig].library.get_asm_str()


@pytest.mark.skipif(512 not in host_widths(), reason="this CPU has no 512-bit vectors (AVX-512F)")
def test_width_reaches_the_parallel_loops_llvm_vectorizes():
    """LLVM's own width depends on the CPU (256 bits on AVX-512 Intel parts, 512 on AMD Zen 4),
    so each asked width is checked by the registers its code uses, not against LLVM's."""
    default, _ = _compiled(0)
    wide, wide_asm = _compiled(512)
    mid, mid_asm = _compiled(256)
    narrow, narrow_asm = _compiled(128)
    # the loops live in the gufunc numba outlines from the prange: linked into the kernel's library
    # (a few zmm moves of stack copies stay in numba's own scaffolding, which is not the loops':
    # here 125 zmm at 512, 8 at 256, 2 at 128; ymm 54, 137, 30)
    counts = {w: (asm.count("zmm"), asm.count("ymm")) for w, asm in
              ((512, wide_asm), (256, mid_asm), (128, narrow_asm))}
    assert counts[512][0] > 4 * counts[256][0] and counts[512][0] > 4 * counts[128][0], counts
    assert counts[256][1] > 2 * counts[512][1] and counts[256][1] > 2 * counts[128][1], counts
    for got in (wide, mid, narrow):
        np.testing.assert_allclose(got, default, rtol=1e-6)


def test_unknown_widths_are_refused():
    assert 128 in host_widths()
    with pytest.raises(ValueError, match="vector width"):
        kernel_pipeline(384)
