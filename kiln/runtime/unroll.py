"""Kernels unrolled within O2's budget, not O3's.

At O3, LLVM fully unrolls a loop whose unrolled body costs up to 300 units (its
-unroll-threshold-aggressive; 150 at O2), and up to four times that where unrolling lets
constants fold. A kiln kernel's loops have constant trip counts, nested three or four deep, so
after the innermost loop is vectorized and unrolled the next one fits the budget too: the
gufunc of a max over 8x12x64 rows of 64 grew from 1,059 lines of IR to 25,187 and took 3.1 s to
compile, against 0.5 s at O2's budget, and ran no faster (79 vs 81 us per call, outputs
bit-identical; MiniLM's fused attention kernel: 7.0 s vs 5.2 s to compile, 2.07 vs 1.98 ms).

While a kiln kernel is lowered (`capped()`, entered by kiln.runtime.pipeline, under numba's
compiler lock, which every numba compile holds), LLVM's O3 budget is set to THRESHOLD, and set
back to LLVM's own default when the outermost kernel's lowering ends: code numba compiles
outside kiln's kernels is optimized as LLVM does by default.
"""

from __future__ import annotations

import contextlib
import threading

THRESHOLD = 150  # LLVM's O2 budget
LLVM_DEFAULT = 300  # LLVM's own -unroll-threshold-aggressive, what O3 uses when nothing sets it
OPTION = "-unroll-threshold-aggressive"

_state = threading.local()


def _set(threshold: int) -> None:
    import llvmlite.binding as llvm

    llvm.set_option("kiln", f"{OPTION}={threshold}")


@contextlib.contextmanager
def capped(threshold: int = THRESHOLD):
    """While it is open, LLVM unrolls at O3 within `threshold` (a process-wide LLVM option, so
    open it only under numba's compiler lock, as a kernel's lowering is)."""
    depth = getattr(_state, "depth", 0)
    if not depth:
        _set(threshold)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth
        if not depth:
            _set(LLVM_DEFAULT)
