"""Calibrate: measure the constants of the optimizer's roofline cost model on this target.

A TargetProfile holds GEMM GFLOP/s per shape class (BLAS through numba, as generated GEMM
kernels call it; on cuda, the generated kernels' shared-memory tile), streaming memory bandwidth,
elementwise throughput (streamed, and in cache at each SIMD vector width the CPU has) and the
fixed cost of one kernel (a parallel region, or a launch, with almost no work). It is measured
once per target fingerprint (target, CPU model, core count, numba and numpy versions) and kept
in the store under an action-cache key, so every replica on the same kind of node shares it.

A busy machine makes each figure noisier, not wrong: every rate is the fastest of many short
timed runs (another process's work only ever slows a run down). A profile measured while other
processes took over contended_share() of the CPUs is cached with that share (a Contention blob
beside it) and used; a later calibration on a quieter machine measures again and replaces it. A
new measurement that agrees with the recorded one (every constant within SAME_MACHINE) keeps the
recorded profile, so two calibrations of one machine give one profile digest and one optimize key.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from typing import Optional

import numpy as np

from kiln.cas import cache
from kiln.cas.digest import Digest
from kiln.core.errors import FailedPrecondition
from kiln.core.limits import CpuLoad, contended_share, quieter_now
from kiln.cas.store import BlobStore
from kiln.core.telemetry import span
from kiln.runtime.pipeline import kernel_pipeline
from kiln.runtime.vectorwidth import host_widths
from kiln.v1 import ir_pb2, services_pb2

log = logging.getLogger(__name__)

CALIBRATE_VERSION = "calibrate-5"  # 4: vector_rates; 5: fastest runs, contention recorded beside
SAME_MACHINE = 0.3  # constants within this share of the recorded profile's: the same machine
# (class, M, N, K): decode-step GEMV, small tiles, a BERT-base-sized projection, a square block
GEMM_CLASSES = (("gemv", 1, 1536, 384), ("small", 64, 64, 64), ("projection", 512, 1536, 384),
                ("square", 512, 512, 512))
STREAM_ELEMENTS = 1 << 24  # 64 MB per f32 array: far beyond any cache
CACHED_ELEMENTS = 1 << 15  # 384 KB for the three arrays: in cache, as a GEMM's block of C is for its epilogue
CACHED_PASSES = 64         # passes per timed call, so the pool's fixed cost is not what is measured
CACHED_TASKS = 64


def fingerprint(target: str) -> str:
    import numba

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    text = f"{target}|{cpu}|{os.cpu_count()}|numba {numba.__version__}|numpy {np.__version__}"
    if target == "cuda":
        text += "|" + _gpu_name()
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _fastest_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls after a warm-up: load only ever adds time."""
    fn()  # warm-up (and compile)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _gpu_name() -> str:
    from executor_svc.executor import cuda_device

    cuda = cuda_device()
    if _simulated():
        return "numba CUDA simulator"
    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
    return f"{name} cc{dev.compute_capability}"


def _simulated() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def measure_cuda(repeats: int = 7) -> services_pb2.TargetProfile:
    """The cuda target's constants, with kernels shaped as codegen_svc/targets/cuda/ writes them:
    a 16x16 shared-memory GEMM tile per block, one thread per element for the stream, an empty
    launch for the fixed cost. Under numba's simulator the shapes are tiny (the numbers then say
    nothing about a GPU; the profile's fingerprint names the simulator)."""
    import math

    from executor_svc.executor import cuda_device

    cuda = cuda_device()  # before the probes: no device is FAILED_PRECONDITION, not an import error
    from executor_svc.cuda_probes import TILE as T, gemm, tiny, triad

    small = _simulated()

    def timed(fn) -> float:
        def run():
            fn()
            cuda.synchronize()
        return _fastest_seconds(run, 1 if small else repeats)

    t0 = time.perf_counter()
    p = services_pb2.TargetProfile(target="cuda", fingerprint=fingerprint("cuda"))
    rng = np.random.default_rng(0)
    for name, m, n, k in GEMM_CLASSES:
        if small:
            m, n, k = min(m, 16), min(n, 16), min(k, 16)
        a = cuda.to_device(rng.standard_normal((m, k), dtype=np.float32))
        b = cuda.to_device(rng.standard_normal((k, n), dtype=np.float32))
        c = cuda.device_array((m, n), np.float32)
        grid = (math.ceil(n / T), math.ceil(m / T))
        s = timed(lambda: gemm[grid, (T, T)](a, b, c))
        p.gemm.add(shape_class=name, m=m, n=n, k=k, gflops=2.0 * m * n * k / s / 1e9)
    elements = 1 << 8 if small else STREAM_ELEMENTS
    x, y = cuda.to_device(np.ones(elements, np.float32)), cuda.to_device(np.ones(elements, np.float32))
    z = cuda.device_array(elements, np.float32)
    s = timed(lambda: triad[math.ceil(elements / 256), 256](x, y, z))
    p.bandwidth_gbs = 12.0 * elements / s / 1e9
    p.elementwise_gelems = p.cached_gelems = elements / s / 1e9
    one = cuda.device_array(1, np.float32)
    p.kernel_overhead_us = p.serial_overhead_us = timed(lambda: tiny[1, 1](one)) * 1e6
    p.threads = 1 if small else cuda.get_current_device().MULTIPROCESSOR_COUNT
    p.measured_s = time.perf_counter() - t0
    return p


def measure(target: str = "cpu", repeats: int = 7) -> services_pb2.TargetProfile:
    fn = MEASURE.get(target)
    if fn is None:
        raise FailedPrecondition(f"this executor calibrates the {' and '.join(MEASURE)} targets, not {target!r}")
    return fn(repeats)


def measure_cpu(repeats: int = 7) -> services_pb2.TargetProfile:
    from numba import get_num_threads, njit, prange

    from executor_svc.executor import start_pool

    start_pool()  # before the first parallel kernel: torch's pool keeps its size

    @njit(cache=False, nogil=True)
    def gemm(a, b, c):
        np.dot(a, b, c)

    @njit(parallel=True, cache=False, nogil=True, pipeline_class=kernel_pipeline())  # compiled as kernels are
    def triad(a, b, c):  # c = a + 2b: 12 bytes moved per element
        for i in prange(a.size):
            c[i] = a[i] + np.float32(2.0) * b[i]

    def passes_over_cache(a, b, c, passes):  # pass after pass over one chunk per task, in cache,
        chunk = a.size // CACHED_TASKS  # indexed as the codegen indexes a GEMM's epilogue
        for t in prange(CACHED_TASKS):
            for _ in range(passes):  # each pass reads the last one's c: no pass is redundant
                for i in range(chunk):
                    j = np.uint64(t * chunk + i)
                    c[j] = np.float32(0.5) * c[j] + a[j] * b[j]

    def in_cache(width: int = 0):  # that loop, compiled as a kernel scheduled with this vector width
        return njit(parallel=True, cache=False, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"},
                    pipeline_class=kernel_pipeline(width))(passes_over_cache)

    triad_passes = in_cache()

    @njit(parallel=True, cache=False, nogil=True, pipeline_class=kernel_pipeline())
    def tiny(a):
        for i in prange(a.size):
            a[i] += np.float32(1.0)

    @njit(cache=False, nogil=True)
    def tiny_serial(a):
        for i in range(a.size):
            a[i] += np.float32(1.0)

    t0 = time.perf_counter()
    p = services_pb2.TargetProfile(target="cpu", fingerprint=fingerprint("cpu"))
    rng = np.random.default_rng(0)
    for name, m, n, k in GEMM_CLASSES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        c = np.empty((m, n), np.float32)
        s = _fastest_seconds(lambda: gemm(a, b, c), repeats)
        p.gemm.add(shape_class=name, m=m, n=n, k=k, gflops=2.0 * m * n * k / s / 1e9)
    x = np.ones(STREAM_ELEMENTS, np.float32)
    y = np.ones(STREAM_ELEMENTS, np.float32)
    z = np.empty(STREAM_ELEMENTS, np.float32)
    s = _fastest_seconds(lambda: triad(x, y, z), repeats)
    p.bandwidth_gbs = 12.0 * STREAM_ELEMENTS / s / 1e9
    p.elementwise_gelems = STREAM_ELEMENTS / s / 1e9
    x, y, z = x[:CACHED_ELEMENTS].copy(), y[:CACHED_ELEMENTS].copy(), np.zeros(CACHED_ELEMENTS, np.float32)
    # the in-cache loop compiled at each vector width the CPU has (0: LLVM's own, which is the
    # in-cache rate), timed in turns so that a slower or busier moment of the machine falls on
    # every width alike (timed on its own first, right after the streaming triad, it once came
    # out 40x slower than the same loop timed here: 0.26 against 11 Gelem/s)
    widths = {bits: in_cache(bits) if bits else triad_passes for bits in (0,) + host_widths()}
    times: dict[int, list[float]] = {bits: [] for bits in widths}
    for kernel in widths.values():
        kernel(x, y, z, CACHED_PASSES)  # compile
    for _ in range(3 * repeats):
        for bits, kernel in widths.items():
            t = time.perf_counter()
            kernel(x, y, z, CACHED_PASSES)
            times[bits].append(time.perf_counter() - t)
    for bits, ts in times.items():
        p.vector_rates.add(bits=bits, gelems=CACHED_ELEMENTS * CACHED_PASSES / min(ts) / 1e9)
    p.cached_gelems = p.vector_rates[0].gelems
    small = np.zeros(16, np.float32)
    p.kernel_overhead_us = _fastest_seconds(lambda: tiny(small), 50 * repeats) * 1e6
    p.serial_overhead_us = _fastest_seconds(lambda: tiny_serial(small), 50 * repeats) * 1e6
    p.threads = get_num_threads()
    p.measured_s = time.perf_counter() - t0
    return p


MEASURE = {"cpu": measure_cpu, "cuda": measure_cuda}  # target -> how this executor measures it


def calibrate(store: BlobStore, target: str = "cpu", force: bool = False
              ) -> tuple[Digest, services_pb2.TargetProfile, bool]:
    """The target's profile digest, the profile, and whether it came from the store without a
    measurement. A recorded profile is used as it is unless `force`, or unless it was measured
    on a contended machine and the machine is quieter now (then it is measured again)."""
    fp = fingerprint(target)
    key = _key(target, fp)
    hit = cache.lookup(store, key)
    recorded = None
    if hit is not None:
        recorded = (hit["profile"], store.get_message(hit["profile"], services_pb2.TargetProfile),
                    _contention(store, hit))
        if not force and (recorded[2] <= contended_share() or not quieter_now(recorded[2])):
            return recorded[0], recorded[1], True
    elif not force and fp in _measured:  # this process measured this target already (for another store)
        p, others = _measured[fp]
        d = store.put_message(p)
        _record(store, key, d, others)
        return d, p, True
    with span("executor.calibrate", **{"kiln.target": target, "kiln.fingerprint": fp}) as s:
        load = CpuLoad()
        p = measure(target)
        others = load.others_busy()
        s.set_attribute("kiln.others_busy", others)
        d, p, kept = _keep_or_replace(store, key, recorded, p, others)
        s.set_attribute("kiln.profile", str(d))
        s.set_attribute("kiln.kept", kept)
    if others > contended_share():
        log.warning("other processes took %.0f%% of the CPUs while the %s target was calibrated; the profile "
                    "is cached with that, and a calibration on a quieter machine replaces it", 100 * others, target)
    if fp not in _measured or others <= _measured[fp][1]:
        _measured[fp] = (p, others)
    return d, p, False


def _keep_or_replace(store: BlobStore, key: str, recorded, p, others: float):
    """The profile to use after measuring p under `others` (digest, profile, whether the recorded
    one was kept), recording what changed."""
    if recorded is not None:
        rd, rp, r_others = recorded
        if same_machine(p, rp):  # the same constants: one digest, one optimize key
            if others < r_others:
                _record(store, key, rd, others)
            return rd, rp, True
        if others > r_others and r_others <= contended_share():  # a quiet measurement beats a busier one
            return rd, rp, True
    d = store.put_message(p)
    _record(store, key, d, others)
    return d, p, False


def same_machine(a: services_pb2.TargetProfile, b: services_pb2.TargetProfile) -> bool:
    """Whether two profiles agree on every constant within SAME_MACHINE (and on the shape classes
    and threads): measurements of one machine, not two."""
    def constants(p):
        return ([g.gflops for g in p.gemm] + [v.gelems for v in p.vector_rates]
                + [p.bandwidth_gbs, p.elementwise_gelems, p.cached_gelems, p.kernel_overhead_us, p.serial_overhead_us])

    if (a.target, a.fingerprint, a.threads) != (b.target, b.fingerprint, b.threads) or \
            [(g.shape_class, g.m, g.n, g.k) for g in a.gemm] != [(g.shape_class, g.m, g.n, g.k) for g in b.gemm] or \
            [v.bits for v in a.vector_rates] != [v.bits for v in b.vector_rates]:
        return False
    return all(abs(x - y) <= SAME_MACHINE * max(abs(x), abs(y)) for x, y in zip(constants(a), constants(b)))


def _record(store: BlobStore, key: str, profile: Digest, others: float) -> None:
    cache.record(store, key, {"profile": profile, "contention": store.put_message(ir_pb2.Contention(others_busy=others))})


def _contention(store: BlobStore, hit) -> float:
    d = hit.get("contention")
    return store.get_message(d, ir_pb2.Contention).others_busy if d is not None else 0.0


def known_profile(store: BlobStore, target: str = "cpu") -> Optional[tuple[Digest, services_pb2.TargetProfile]]:
    """The target's profile if this store holds one for this machine kind; never measures."""
    hit = cache.lookup(store, _key(target, fingerprint(target)))
    if hit is None:
        return None
    return hit["profile"], store.get_message(hit["profile"], services_pb2.TargetProfile)


def _key(target: str, fp: str) -> str:
    return cache.action_key("calibrate", CALIBRATE_VERSION, {}, {"target": target, "fingerprint": fp})


_measured: dict[str, tuple[services_pb2.TargetProfile, float]] = {}  # per fingerprint: the least contended
