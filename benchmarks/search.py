"""Does the search matter? Per model: primitive nodes, kernels with and without the search,
optimize time, and run latency of the searched program over the same model compiled with the
search off (one kernel per primitive op), interleaved in one run, medians over repeats. The
searched compile times its schedule candidates ($KILN_CANDIDATES or 8) and keeps the fastest.

    .venv/bin/python benchmarks/search.py [--repeats 20] [--layers 2] [--candidates]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def models(layers: int):
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from kiln.apps.examples import encoder_example, mlp_example
    from kiln.hf import ModelOutputTensor

    torch.manual_seed(0)
    m, (x,) = mlp_example()
    yield "MLP (example)", _Positional(m), {"x": x}
    m, (x,) = encoder_example()
    yield "encoder (example, 2 layers, d 64)", _Positional(m), {"x": x}
    ids = torch.randint(0, 1000, (1, 32))
    yield f"tiny Llama ({layers} layers, hidden 128)", ModelOutputTensor(LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2)).eval()), {"input_ids": ids}
    yield f"tiny GPT-2 ({layers} layers, hidden 128)", ModelOutputTensor(GPT2LMHeadModel(GPT2Config(
        vocab_size=1000, n_embd=128, n_layer=layers, n_head=4)).eval()), {"input_ids": ids}
    yield f"tiny BERT ({layers} layers, hidden 128)", ModelOutputTensor(BertModel(BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=256)).eval()), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class _Positional(torch.nn.Module):
    """A module taking one positional tensor, called with keyword `x` like the others."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x):
        return self.m(x)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--only", default=None, help="substring of the model names to run")
    ap.add_argument("--candidates", action="store_true",
                    help="also list the searched compile's timed candidates (predicted and measured)")
    args = ap.parse_args()
    import kiln
    from kiln.pipeline import Pipeline

    store = Path(tempfile.mkdtemp(prefix="kiln-bench-search-"))
    print(f"{'model':<34} {'nodes':>6} {'after':>6} {'k off':>6} {'k on':>5} {'opt s':>6} {'stop':<16} "
          f"{'off ms':>8} {'on ms':>8} {'speedup':>8} {'max err':>9}")
    for name, module, kwargs in models(args.layers):
        if args.only and args.only not in name:
            continue
        runs = {}
        for search in (False, True):
            p = Pipeline(f"file://{store}")
            t0 = time.perf_counter()
            c = kiln.compile(module, (), kwargs, search=search, pipeline=p)
            runs[search] = (c, time.perf_counter() - t0)
        (off, _), (on, _) = runs[False], runs[True]
        with torch.no_grad():
            ref = module(**kwargs)
        err = max((off(**kwargs) - ref).abs().max().item(), (on(**kwargs) - ref).abs().max().item())
        t_off, t_on = [], []
        for _ in range(3):
            off(**kwargs), on(**kwargs)
        for c in (off, on):  # timed runs on the compiled entries, none beside their builds
            c.pipeline.local_executor().wait_compiled()
        for _ in range(args.repeats):
            s = time.perf_counter()
            off(**kwargs)
            t_off.append((time.perf_counter() - s) * 1e3)
            s = time.perf_counter()
            on(**kwargs)
            t_on.append((time.perf_counter() - s) * 1e3)
        r = on.result.report
        m_off, m_on = statistics.median(t_off), statistics.median(t_on)
        print(f"{name:<34} {r.nodes_before:>6} {r.nodes_after:>6} {off.result.kernels:>6} {on.result.kernels:>5} "
              f"{r.seconds:>6.2f} {r.stop_reason:<16} {m_off:>8.2f} {m_on:>8.2f} {m_off / m_on:>7.2f}x {err:>9.2e}",
              flush=True)
        if args.candidates:  # the searched compile's timed schedules: the cost model's error, visible
            for c in r.candidates:
                print(f"    {'*' if c.chosen else ' '} {c.schedule:<48} {c.kernels:>4} kernels  predicted "
                      f"{c.predicted_s * 1e3:8.3f} ms  measured {c.measured_s * 1e3:8.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
