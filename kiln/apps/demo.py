"""`make run`: compile the example encoder, check it against torch eager, time both."""

from __future__ import annotations

import statistics
import time

import torch


def main(args) -> int:
    import kiln
    from kiln.apps.examples import encoder_example

    model, inputs = encoder_example()
    t0 = time.perf_counter()
    compiled = kiln.compile(model, inputs)
    first = compiled(*inputs)
    t1 = time.perf_counter()
    with torch.no_grad():
        ref = model(*inputs)
    err = (first - ref).abs().max().item()
    kiln_ms, eager_ms = [], []
    with torch.no_grad():
        for _ in range(5):
            compiled(*inputs)
            model(*inputs)
        for _ in range(args.repeats):  # interleaved, so both see the same machine state
            s = time.perf_counter()
            compiled(*inputs)
            kiln_ms.append((time.perf_counter() - s) * 1e3)
            s = time.perf_counter()
            model(*inputs)
            eager_ms.append((time.perf_counter() - s) * 1e3)
    r = compiled.result
    print(f"encoder (2 layers, d=64, batch {inputs[0].shape[0]}, seq {inputs[0].shape[1]})")
    print(f"  bundle {r.bundle}: {r.kernels} kernels, search {r.report.stop_reason}, "
          f"{r.report.nodes_before} -> {r.report.nodes_after} nodes")
    print(f"  compile + first run: {t1 - t0:.2f} s")
    print(f"  max abs error vs torch eager: {err:.3e}")
    print(f"  latency (median of {args.repeats}): kiln {statistics.median(kiln_ms):.3f} ms, "
          f"torch eager {statistics.median(eager_ms):.3f} ms")
    ok = torch.allclose(first, ref, rtol=1e-4, atol=1e-5)
    print("  matches torch eager (rtol=1e-4, atol=1e-5):", "yes" if ok else "NO")
    return 0 if ok else 1
