"""Optimize-stage time for tiny Llama at 2 and 8 layers (structural dedup keeps it flat), with
the default search budget, each on a fresh store (no action-cache hits), median of repeats.
As a compile does, the search knows this machine's calibrated TargetProfile (measured once
here, before the timings), so schedules are searched too; --no-profile leaves them out.

    .venv/bin/python benchmarks/optimize_time.py [--repeats 3] [--layers 2 8] [--no-profile]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def llama_graph(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from importer_svc.importer import lower_program
    from kiln.hf import ModelOutputTensor

    torch.manual_seed(0)
    m = ModelOutputTensor(LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2)).eval())
    graph, _ = lower_program(torch.export.export(m, (), {"input_ids": torch.randint(0, 1000, (1, 32))}, strict=False))
    return graph


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--no-profile", action="store_true", help="search without the target's profile (no schedules)")
    args = ap.parse_args()
    from executor_svc.calibrate import measure
    from kiln.ir.serialize import graph_to_pb
    from kiln.cas.store import FileStore
    from optimizer_svc.optimizer import OptimizeOptions, optimize

    profile = None if args.no_profile else measure("cpu")

    print(f"{'tiny Llama':<12} {'nodes':>6} {'kernels':>8} {'regions':>8} {'distinct':>9} {'optimize s':>11} {'stop':<12}")
    base = None
    for layers in args.layers:
        g = llama_graph(layers)
        times = []
        for _ in range(args.repeats):
            store = FileStore(tempfile.mkdtemp(prefix="kiln-bench-opt-"))
            d = store.put_message(graph_to_pb(g))
            options = OptimizeOptions(target_profile=store.put_message(profile) if profile is not None else None)
            t0 = time.perf_counter()
            _, report = optimize(store, d, options)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        base = base or t
        print(f"{layers:>2} layers    {len(g.nodes):>6} {report.kernels:>8} {report.regions:>8} "
              f"{report.distinct_regions:>9} {t:>11.2f} {report.stop_reason:<12} ({t / base:.2f}x the first)")


if __name__ == "__main__":
    main()
