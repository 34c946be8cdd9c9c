"""Load on a running executor: many clients, each on its own channel, calling Run in a loop for a
fixed time; latency percentiles, errors by code, and the server's resident memory over the run.
Used by benchmarks/load.py and tests/test_load.py."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


@dataclass
class LoadResult:
    clients: int
    seconds: float
    calls: int
    errors: dict[str, int]
    p50_ms: float
    p99_ms: float
    max_ms: float
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, server MiB)
    wrong_outputs: int = 0

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.seconds

    @property
    def rss_growth(self) -> float:
        """Server memory growth from the first sample after warm-up to the last, as a fraction."""
        return self.rss_mb[-1][1] / self.rss_mb[0][1] - 1 if len(self.rss_mb) >= 2 else 0.0

    def summary(self) -> str:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return (f"{self.clients} clients x {self.seconds:.0f} s: {self.calls} Runs ({self.calls_per_s:.0f}/s), "
                f"errors: {errors}, wrong outputs: {self.wrong_outputs}, p50 {self.p50_ms:.2f} ms, "
                f"p99 {self.p99_ms:.2f} ms, max {self.max_ms:.2f} ms, server RSS {self.rss_mb[0][1]:.0f} -> "
                f"{self.rss_mb[-1][1]:.0f} MiB ({self.rss_growth * 100:+.1f}%)")


def run_load(address: str, session: str, inputs: Sequence[tuple[str, np.ndarray]], expected: Sequence[np.ndarray],
             clients: int = 32, seconds: float = 60.0, server_pid: Optional[int] = None, warmup_s: float = 3.0,
             tolerance: float = 1e-5) -> LoadResult:
    """`clients` threads, each with its own channel, Run `session` on `inputs` back to back for
    `seconds`, measured from `warmup_s` after every client's first answer (the first Run may
    compile the session's kernels); every output is checked against `expected`."""
    import grpc

    from kiln.rpc.client import channel
    from kiln.rpc.tensors import array_from_pb, array_to_pb
    from kiln.v1 import services_pb2, services_pb2_grpc

    request = services_pb2.RunRequest(session=session, inputs=[array_to_pb(n, a) for n, a in inputs])
    lock = threading.Lock()
    latencies: list[float] = []
    errors: dict[str, int] = {}
    wrong = [0]
    start_measuring = threading.Event()
    stop = threading.Event()
    ready = threading.Barrier(clients + 1)
    answered = threading.Semaphore(0)

    def client() -> None:
        mine: list[float] = []
        first_done = False
        with channel(address) as ch:
            stub = services_pb2_grpc.ExecutorStub(ch)
            ready.wait()
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    r = stub.Run(request, timeout=30)
                    ok = all(np.allclose(array_from_pb(o), e, rtol=tolerance, atol=tolerance, equal_nan=True)
                             for o, e in zip(r.outputs, expected)) and len(r.outputs) == len(expected)
                    if not ok:
                        with lock:
                            wrong[0] += 1
                except grpc.RpcError as e:
                    with lock:
                        errors[e.code().name] = errors.get(e.code().name, 0) + 1
                    if not first_done:  # an error is an answer too
                        first_done = True
                        answered.release()
                    continue
                if start_measuring.is_set():
                    mine.append(time.perf_counter() - t0)
                elif not first_done:
                    first_done = True
                    answered.release()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    ready.wait()
    for _ in range(clients):
        if not answered.acquire(timeout=600):
            break  # a client that never gets an answer shows up in the errors
    time.sleep(warmup_s)
    start_measuring.set()
    t0 = time.monotonic()
    rss: list[tuple[float, float]] = []
    while (now := time.monotonic() - t0) < seconds:
        if server_pid is not None:
            rss.append((now, resident_mb(server_pid)))
        time.sleep(min(1.0, max(0.0, seconds - now)))
    if server_pid is not None:
        rss.append((time.monotonic() - t0, resident_mb(server_pid)))
    stop.set()
    for t in threads:
        t.join(timeout=60)
    ms = sorted(x * 1e3 for x in latencies)
    q = statistics.quantiles(ms, n=100) if len(ms) >= 2 else [ms[0] if ms else 0.0] * 99
    return LoadResult(clients, seconds, len(ms), errors, q[49], q[98], ms[-1] if ms else 0.0, rss, wrong[0])


def distinct_mlps(n: int, first_width: int = 40) -> list[tuple[object, tuple]]:
    """n MLPs of different hidden widths (so no two share a cached compile) with example inputs."""
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.a = torch.nn.Linear(32, width)
            self.b = torch.nn.Linear(width, 10)

        def forward(self, x):
            return torch.log_softmax(self.b(torch.nn.functional.gelu(self.a(x))), dim=-1)

    return [(Mlp(first_width + 8 * i).eval(), (torch.randn(4, 32),)) for i in range(n)]


def concurrent_compiles(addresses: dict, store, models: Sequence[tuple[object, tuple]],
                        tolerance: float = 1e-4) -> list[tuple[float, float]]:
    """Compile every (module, example args) at once through the remote stages, one thread each;
    returns each compile's (seconds, max abs error against torch eager). Raises the first failure.
    The programs are exported first, one by one (torch.export is not thread-safe in one process);
    the stages' work (import, optimize, emit, load) then runs concurrently on the servers."""
    import torch

    import kiln
    from kiln.pipeline import CompiledModule

    pipeline = kiln.Pipeline(store, addresses)
    exported = [torch.export.export(m, a) for m, a in models]
    programs = [pipeline.upload_program(ep) for ep in exported]
    results: list = [None] * len(models)
    failures: list[BaseException] = []
    go = threading.Barrier(len(models))

    def one(i: int) -> None:
        module, args = models[i]
        try:
            p = kiln.Pipeline(store, addresses)
            go.wait()
            t0 = time.perf_counter()
            r = p.compile_program(programs[i])
            compiled = CompiledModule(p, r, p.load(r.bundle, r.manifest), exported[i].call_spec.in_spec)
            seconds = time.perf_counter() - t0
            with torch.no_grad():
                expected = module(*args)
            err = float((compiled(*args) - expected).abs().max())
            if not err <= tolerance:
                raise AssertionError(f"model {i}: max abs error {err} over {tolerance}")
            results[i] = (seconds, err)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            failures.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(models))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return results
