"""The kernels Calibrate times on a CUDA device, shaped as codegen_svc/targets/cuda/ writes them.
(Module-level, so numba's simulator can stand in for the device: it swaps this module's `cuda`.)"""

import numba
from numba import cuda

TILE = 16


@cuda.jit
def gemm(a, b, c):
    """c = a @ b in TILE x TILE blocks through shared memory."""
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    n, m = cuda.blockIdx.x * TILE + tx, cuda.blockIdx.y * TILE + ty
    As = cuda.shared.array((TILE, TILE), dtype=numba.float32)
    Bs = cuda.shared.array((TILE, TILE), dtype=numba.float32)
    acc = numba.float32(0.0)
    for k0 in range(0, a.shape[1], TILE):
        As[ty, tx] = a[m, k0 + tx] if m < a.shape[0] and k0 + tx < a.shape[1] else numba.float32(0.0)
        Bs[ty, tx] = b[k0 + ty, n] if n < b.shape[1] and k0 + ty < a.shape[1] else numba.float32(0.0)
        cuda.syncthreads()
        for kk in range(TILE):
            acc += As[ty, kk] * Bs[kk, tx]
        cuda.syncthreads()
    if m < c.shape[0] and n < c.shape[1]:
        c[m, n] = acc


@cuda.jit
def triad(a, b, c):
    """c = a + 2b, one thread per element: 12 bytes moved each."""
    i = cuda.grid(1)
    if i < a.size:
        c[i] = a[i] + numba.float32(2.0) * b[i]


@cuda.jit
def tiny(a):
    """Almost no work: a launch's fixed cost."""
    i = cuda.grid(1)
    if i < a.size:
        a[i] += numba.float32(1.0)
