"""Do the search's schedules matter? Small programs whose best schedule is not the size
thresholds' one: a sum of one long row (split across the pool), reductions over a middle axis
(axis-outer loop order), GEMMs with an epilogue (tile of rows per BLAS call), each compiled with the search on (8 timed candidates, this machine's
calibrated profile). Prints every candidate's schedule, predicted and measured time (the
searched ones take the search's schedules; "thresholds-only" ones the size thresholds alone),
the kernels' schedules, and the compiled program against torch eager, interleaved, medians.

    .venv/bin/python benchmarks/schedules.py [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


_GEN = torch.Generator().manual_seed(1)
_W1, _B1 = torch.randn(384, 1536, generator=_GEN) / 20, torch.randn(1536, generator=_GEN)
_W2 = torch.randn(256, 1024, generator=_GEN) / 16
_W3, _B3 = torch.randn(1536, 384, generator=_GEN) / 40, torch.randn(384, generator=_GEN)


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


CASES = [
    ("(x*x).sum(-1), x [1, 4194304]", lambda x: (x * x).sum(-1), (1, 1 << 22), torch.float32),
    ("x.sum(0), x [4096, 256]", lambda x: x.sum(0), (4096, 256), torch.float32),
    ("amax(x, 1), x [8, 2048, 64], one NaN", lambda x: torch.amax(x, 1), (8, 2048, 64), torch.float32),
    ("(2x).sum(1), x f16 [4, 512, 33]", lambda x: (x * 2).sum(1), (4, 512, 33), torch.float16),
    ("gelu(x @ w + b), x [2048, 384], w [384, 1536]", lambda x: torch.nn.functional.gelu(x @ _W1 + _B1),
     (2048, 384), torch.float32),
    ("relu(x @ w), x [4096, 256], w [256, 1024]", lambda x: torch.relu(x @ _W2), (4096, 256), torch.float32),
    ("x @ w + b, x [2048, 1536], w [1536, 384]", lambda x: x @ _W3 + _B3, (2048, 1536), torch.float32),
]


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    import kiln
    from kiln.cas.digest import Digest
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.v1 import ir_pb2

    pipeline = kiln.Pipeline()
    torch.manual_seed(0)
    for name, fn, shape, dtype in CASES:
        x = torch.randn(shape).to(dtype)
        if "NaN" in name:
            x[0, 5, 3] = float("nan")
        module = _Fn(fn).eval()
        compiled = kiln.compile(module, (x,), pipeline=pipeline)
        print(name)
        for c in compiled.result.report.candidates:
            kg = kernel_graph_from_pb(pipeline.store.get_message(Digest.from_pb(c.kernel_graph), ir_pb2.KernelGraph))
            kinds = ", ".join(f"{k.kind}{' parallel' if k.parallel else ''}{' ' + k.order if k.order else ''}"
                              f"{' collapse' if k.collapse else ''}{f' tile={k.tile}' if k.tile else ''}" for k in kg.kernels if k.kind != "elementwise")
            print(f"  candidate {c.schedule:<55} predicted {c.predicted_s * 1e6:9.1f} us  "
                  f"measured {c.measured_s * 1e6:9.1f} us  [{kinds}]")
        ref = module(x).float()
        got = compiled(x).float()
        for _ in range(2):  # past executor.HOST_RUNS; timed runs on the compiled entry
            compiled(x)
        pipeline.local_executor().wait_compiled()
        same_nan = bool(torch.equal(torch.isnan(ref), torch.isnan(got)))
        err = float((got - ref).nan_to_num().abs().max())
        kiln_ms, eager_ms = [], []
        for _ in range(3):  # interleaved
            kiln_ms.append(_median_ms(lambda: compiled(x), args.repeats))
            eager_ms.append(_median_ms(lambda: module(x), args.repeats))
        print(f"  kept: kiln {statistics.median(kiln_ms):.3f} ms, eager {statistics.median(eager_ms):.3f} ms, "
              f"max abs err {err:.3g} (of max |ref| {float(ref.nan_to_num().abs().max()):.3g}), NaNs match {same_nan}")


if __name__ == "__main__":
    main()
