"""`kiln bench`: kiln against torch eager and torch.compile (inductor) on the same inputs.

Each model is run by the three in one process, on the same thread count, interleaved call by
call after warm-up; latencies are medians. Peak memory is the rise of the process's resident
set over one call of each (the heap trimmed first, VmHWM reset through /proc/self/clear_refs),
the median of PEAK_SAMPLES such calls, interleaved like the timings. For models with
GEMMs the harness also times BLAS sgemm (torch.mm) on each GEMM shape of kiln's kernel graph,
all shapes in turn as a fourth runner interleaved with the three: the model's GEMM flops over
that time is the roofline kiln is held against.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

MODELS = ("mlp", "llama-seq1", "llama-seq128", "bert", "resnet")
# One call's rise is one sample of something noisy: torch's peak for tiny Llama at seq 128 read
# 1.055, 1.496 and 1.809 MB in three runs (where its allocator finds room differs call to call)
PEAK_SAMPLES = 5


@dataclass
class BenchResult:
    model: str
    kiln_ms: float
    eager_ms: float
    inductor_ms: Optional[float]
    max_abs_err: float
    kiln_peak_mb: float
    eager_peak_mb: float
    inductor_peak_mb: Optional[float]
    threads: int
    repeats: int
    kernels: int
    gemm_gflop: float = 0.0          # the model's GEMM work per call
    sgemm_ms: Optional[float] = None  # BLAS sgemm on the same shapes, same run
    roofline: Optional[float] = None  # sgemm time over kiln's time: the share of the GEMM roofline reached
    cold_start_s: Optional[float] = None  # a new process, empty kernel cache: Load to first result
    warm_start_s: Optional[float] = None  # the same with the cache the cold start filled
    warm_start_compiled: Optional[int] = None  # functions numba compiled in the warm process (0 expected)
    targets: dict = field(default_factory=dict)


def build(name: str):
    """(module, positional inputs) with random weights, built from small configs."""
    from kiln.apps.examples import mlp_example, resnet_example

    torch.manual_seed(0)
    if name == "mlp":
        m, args = mlp_example()
        return m, args
    if name == "resnet":
        return resnet_example()
    if name.startswith("llama-seq"):
        from transformers import LlamaConfig, LlamaForCausalLM

        from kiln.hf import ModelOutputTensor

        seq = int(name.removeprefix("llama-seq"))
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        return ModelOutputTensor(model.eval()), (torch.randint(0, 1000, (1, seq)),)
    if name == "bert":
        from transformers import BertConfig, BertModel

        from kiln.hf import ModelOutputTensor

        model = BertModel(BertConfig(vocab_size=1000, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536))
        ids = torch.randint(0, 1000, (8, 64))
        return ModelOutputTensor(model.eval()), (ids,)
    raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


def _peak_mb(fn: Callable[[], object]) -> float:
    """The resident set's rise over one call (Linux, glibc: the heap trimmed, VmHWM reset, the
    high-water mark read after the call): memory the call touched beyond what it started with."""
    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # free heap pages back to the system, so reuse is not hidden
        Path("/proc/self/clear_refs").write_text("5")
    except (OSError, AttributeError):
        return float("nan")
    before = _status_kb("VmRSS")
    fn()
    return max(0.0, (_status_kb("VmHWM") - before) / 1024)


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _gemm_shapes(compiled) -> list[tuple[int, int, int, int]]:
    """(batch, M, N, K) of every GEMM kiln's kernel graph computes (attention kernels hold two)."""
    from kiln.ir.kernel import gemm_dims, kernel_gemm
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.ir.shape import evaluate_dim
    from kiln.v1 import ir_pb2

    p = compiled.pipeline
    kg = kernel_graph_from_pb(p.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
    env = {name: hi for name, _, hi in kg.graph.symbols}
    out = []
    for k in kg.kernels:
        gis = [kernel_gemm(kg.graph, k)] if k.kind == "gemm" else [k.scores, k.output] if k.kind == "attention" else []
        for gi in gis:
            _, b, m, n, kk = gemm_dims(kg.graph, gi)
            out.append(tuple(evaluate_dim(d, env) for d in (b, m, n, kk)))
    return out


def _sgemm_runner(shapes) -> Callable[[], None]:
    """BLAS sgemm (torch.bmm / mm) on every shape in turn: the GEMM work's floor, timed
    interleaved with the systems it bounds (a machine slower for a while is slower for both)."""
    calls = []
    for b, m, n, k in shapes:
        a, w = torch.randn(b, m, k), torch.randn(b, k, n)
        calls.append((lambda a=a, w=w: torch.mm(a[0], w[0])) if b == 1 else (lambda a=a, w=w: torch.bmm(a, w)))

    def run() -> None:
        for f in calls:
            f()
    return run


def bench(name: str, repeats: int = 20, warmup: int = 5, inductor: bool = True, pipeline=None,
          start: bool = False) -> BenchResult:
    import kiln

    if repeats < 1 or warmup < 0:
        raise ValueError("repeats must be at least 1 and warmup at least 0")
    from executor_svc.executor import pool_threads

    model, args = build(name)
    threads = int(pool_threads())
    torch.set_num_threads(threads)  # torch and inductor on the threads kiln's kernels get
    compiled = kiln.compile(model, args, pipeline=pipeline)
    runners: dict[str, Callable[[], object]] = {"kiln": lambda: compiled(*args), "eager": lambda: model(*args)}
    if inductor:
        ind = torch.compile(model)
        runners["inductor"] = lambda: ind(*args)
    shapes = _gemm_shapes(compiled)
    if shapes:
        runners["sgemm"] = _sgemm_runner(shapes)
    times: dict[str, list[float]] = {k: [] for k in runners}
    with torch.no_grad():
        ref = model(*args)
        got = compiled(*args)
        err = float((got.float() - ref.float()).abs().max())
        for _ in range(warmup):
            for f in runners.values():
                f()
        if not compiled.pipeline.remote:  # every timed run on the compiled entry, none beside its build
            compiled.pipeline.local_executor().wait_compiled()
        for _ in range(repeats):  # interleaved: every system sees the same machine state
            for key, f in runners.items():
                t = time.perf_counter()
                f()
                times[key].append(time.perf_counter() - t)
        samples: dict[str, list[float]] = {key: [] for key in runners if key != "sgemm"}
        for _ in range(PEAK_SAMPLES):
            for key, peak_mb in samples.items():
                peak_mb.append(_peak_mb(runners[key]))
        peaks = {key: statistics.median(v) for key, v in samples.items()}
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    gflop = sum(2.0 * b * m * n * k for b, m, n, k in shapes) / 1e9
    sgemm = med.get("sgemm")
    r = BenchResult(name, med["kiln"], med["eager"], med.get("inductor"), err, peaks["kiln"], peaks["eager"],
                    peaks.get("inductor"), threads, repeats, compiled.result.kernels, gflop, sgemm,
                    sgemm / med["kiln"] if sgemm else None)
    if start:
        _start_times(r, compiled)
    r.targets = targets(r)
    return r


def _start_times(r: BenchResult, compiled) -> None:
    """Cold then warm start of the compiled bundle in new processes over a fresh kernel cache."""
    import tempfile

    from executor_svc.start import measure_start

    url = compiled.pipeline.store.url
    bundle, manifest = str(compiled.result.bundle), str(compiled.result.manifest)
    with tempfile.TemporaryDirectory(prefix="kiln-start-") as cache:
        cold = measure_start(url, bundle, manifest, cache)
        warm = measure_start(url, bundle, manifest, cache)
    r.cold_start_s, r.warm_start_s, r.warm_start_compiled = cold["start_s"], warm["start_s"], warm["compiled"]


def targets(r: BenchResult) -> dict:
    """The goals the harness checks (issue 5), each True or False; absent when not measured."""
    t = {}
    if not math.isnan(r.kiln_peak_mb) and not math.isnan(r.eager_peak_mb):
        t["peak memory <= eager"] = r.kiln_peak_mb <= r.eager_peak_mb
    if r.model == "bert":
        if r.inductor_ms is not None:
            t["latency <= 0.95 x inductor"] = r.kiln_ms <= 0.95 * r.inductor_ms
        if r.roofline is not None:
            t[">= 85% of the GEMM roofline"] = r.roofline >= 0.85
    if r.warm_start_s is not None:
        t["warm start < 1 s"] = r.warm_start_s < 1.0 and r.warm_start_compiled == 0
    if r.model == "llama-seq1":
        t[">= 5x faster than eager"] = r.eager_ms >= 5 * r.kiln_ms
        if r.inductor_ms is not None:
            t[">= 2x faster than inductor"] = r.inductor_ms >= 2 * r.kiln_ms
    return t


def report(r: BenchResult) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.3f} ms"

    lines = [f"{r.model}: {r.kernels} kernels, {r.threads} threads, median of {r.repeats}",
             f"  kiln      {ms(r.kiln_ms):>12}  peak {r.kiln_peak_mb:9.3f} MB",
             f"  eager     {ms(r.eager_ms):>12}  peak {r.eager_peak_mb:9.3f} MB  kiln is {r.eager_ms / r.kiln_ms:.2f}x "
             f"faster"]
    if r.inductor_ms is not None:
        lines.append(f"  inductor  {ms(r.inductor_ms):>12}  peak {r.inductor_peak_mb:9.3f} MB  "
                     f"kiln is {r.inductor_ms / r.kiln_ms:.2f}x faster")
    lines.append(f"  max abs err vs eager {r.max_abs_err:.2e}")
    if r.sgemm_ms is not None:
        lines.append(f"  GEMMs {r.gemm_gflop:.3f} GFLOP: sgemm alone {r.sgemm_ms:.3f} ms, kiln "
                     f"{r.gemm_gflop / r.kiln_ms * 1e3:.1f} GFLOP/s = {100 * r.roofline:.0f}% of the roofline")
    if r.cold_start_s is not None:
        lines.append(f"  start (new process, Load to first result): cold {r.cold_start_s:.3f} s, warm "
                     f"{r.warm_start_s:.3f} s ({r.warm_start_compiled} functions compiled warm)")
    for goal, ok in r.targets.items():
        lines.append(f"  target {goal}: {'met' if ok else 'MISSED'}")
    return "\n".join(lines)


def write_json(results: list[BenchResult], path: str) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


def plot(results: list[BenchResult], path: str) -> None:
    """A bar chart per model: kiln's and inductor's latency relative to eager's (eager = 1),
    with each bar's milliseconds written on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.5, 2.4 * len(results)), 4))
    width = 0.27
    for i, (label, key) in enumerate((("kiln", "kiln_ms"), ("eager", "eager_ms"), ("inductor", "inductor_ms"))):
        xs = [j + (i - 1) * width for j in range(len(results))]
        ms = [getattr(r, key) for r in results]
        bars = ax.bar(xs, [m / r.eager_ms if m else 0 for m, r in zip(ms, results)], width, label=label)
        for bar, m in zip(bars, ms):
            if m:
                ax.annotate(f"{m:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                            va="bottom", fontsize=7)
    ax.set_xticks(range(len(results)), [r.model for r in results])
    ax.set_ylabel("latency / eager's (lower is faster)")
    top = max(max(r.kiln_ms, r.inductor_ms or 0) / r.eager_ms for r in results)
    ax.set_ylim(0, 1.25 * max(top, 1.0))
    ax.legend(loc="upper left", fontsize=8, ncols=3)
    ax.set_title(f"kiln vs torch, {results[0].threads} threads (median ms on bars)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
