"""Optimize time of an 8-layer tiny Llama on a local farm (kiln farm up) with 1 and with 3
optimizer replicas: the graph's distinct regions fan out to the peer optimizers. Each farm has
a fresh store (no action-cache hits), the graph is imported into it, then one Optimize is
timed from the client (median over --repeats fresh farms).

    .venv/bin/python benchmarks/farm_optimize.py [--layers 8] [--replicas 1 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch


def llama_export(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.hf import ModelOutputTensor

    torch.manual_seed(0)
    m = ModelOutputTensor(LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2)).eval())
    return torch.export.export(m, (), {"input_ids": torch.randint(0, 1000, (1, 32))}, strict=False)


def one_run(ep, replicas: int) -> tuple[float, object]:
    import kiln
    from kiln.apps import farm
    from kiln.cas.store import S3Store

    d = tempfile.mkdtemp(prefix="kiln-bench-farm-")
    env = dict(os.environ)
    env.pop("KILN_STORE", None)
    f = farm.up({"importer": 1, "optimizer": replicas, "codegen": 0, "executor": 0}, d, env)
    try:
        e = f.client_env()
        store = S3Store(e["KILN_STORE"][len("s3://"):], e["KILN_S3_ENDPOINT"].removeprefix("http://"),
                        e["KILN_S3_ACCESS_KEY"], e["KILN_S3_SECRET_KEY"])
        p = kiln.Pipeline(store, {"importer": e["KILN_IMPORTER_ADDR"], "optimizer": e["KILN_OPTIMIZER_ADDR"]})
        graph, _ = p.import_program(p.upload_program(ep))
        t0 = time.perf_counter()
        _, report = p.optimize(graph, candidates=1)
        return time.perf_counter() - t0, report
    finally:
        farm.down(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--repeats", type=int, default=1, help="fresh farms per replica count (median)")
    args = ap.parse_args()
    ep = llama_export(args.layers)
    print(f"tiny Llama, {args.layers} layers, {os.cpu_count()} cores")
    print(f"{'optimizers':>10} {'optimize s':>11} {'regions':>8} {'distinct':>9} {'stop':<12}")
    base = None
    for n in args.replicas:
        runs = [one_run(ep, n) for _ in range(args.repeats)]
        t = statistics.median(r[0] for r in runs)
        report = runs[0][1]
        base = base or t
        print(f"{n:>10} {t:>11.2f} {report.regions:>8} {report.distinct_regions:>9} {report.stop_reason:<12} "
              f"({base / t:.2f}x the first)")


if __name__ == "__main__":
    main()
