"""Generation: kiln's Executor.Generate against transformers' generate on the same model.

A Llama-shaped causal LM with random weights (hidden 256, 4 layers, 8 heads, 4 KV heads,
vocabulary 4096). kiln: one client, then 4 and 16 concurrent clients sharing decode steps
(continuous batching), each with its own prompt; aggregate new tokens per second, time to
first token, and per-token latency (gaps between a client's tokens) p50/p99. transformers
eager: generate at batch 1 and at batch 16 (16 prompts of one length), tokens per second, and
time to first token (generate of one token). torch.compile'd: the model's forward compiled
(dynamic shapes), generate at batch 1, where it compiles. Greedy throughout; every kiln
output is checked against transformers' for its prompt first.

    .venv/bin/python benchmarks/generate.py [--new 64] [--prompt 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      bos_token_id=0, eos_token_id=None)
    return LlamaForCausalLM(cfg).eval()


def prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 4096, (length,), generator=g).tolist() for _ in range(n)]


def hf_generate(model, batch: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(batch)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def kiln_clients(p, lm, batch: list[list[int]], new: int):
    """Run one client per prompt at once; (wall seconds, per client: [token arrival times], ids)."""
    start = threading.Barrier(len(batch) + 1)
    results = [None] * len(batch)

    def client(i):
        start.wait()
        t0 = time.perf_counter()
        stamps, ids = [], []
        for tok, _ in p.generate(lm, batch[i], new, ignore_eos=True):
            stamps.append(time.perf_counter() - t0)
            ids.append(tok)
        results[i] = (stamps, ids)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each setting (medians)")
    ap.add_argument("--no-inductor", action="store_true")
    args = ap.parse_args()

    from kiln.llm import compile_causal_lm
    from kiln.pipeline import Pipeline

    threads = torch.get_num_threads()
    model = build_model()
    p = Pipeline(f"file://{tempfile.mkdtemp(prefix='kiln-generate-bench-')}")
    t0 = time.perf_counter()
    lm = compile_causal_lm(model, p, max_context=args.prompt + args.new + 8, max_batch=16, candidates=1)
    print(f"compiled prefill + decode in {time.perf_counter() - t0:.1f} s (torch threads {threads})")
    ps = prompts(16, args.prompt)
    # correctness first (and numba's compile, outside the timings)
    for q in ps[:2]:
        got = [t for t, _ in p.generate(lm, q, args.new, ignore_eos=True)]
        assert got == hf_generate(model, [q], args.new)[1][0], "kiln's greedy tokens differ from transformers'"
    print("greedy tokens match transformers on the checked prompts\n")
    p.local_executor().wait_compiled()  # timed runs on the compiled entries, none beside their builds

    rows = []
    for clients in (1, 4, 16):
        walls, ttft, gaps, totals = [], [], [], []
        for _ in range(args.repeats):
            wall, res = kiln_clients(p, lm, ps[:clients], args.new)
            walls.append(wall)
            totals.append(sum(len(ids) for _, ids in res))
            ttft += [s[0] for s, _ in res]
            gaps += [b - a for s, _ in res for a, b in zip(s, s[1:])]
            for i, (_, ids) in enumerate(res):  # batched: still each prompt's own tokens
                if clients > 1 and i < 2:
                    assert ids == [t for t, _ in p.generate(lm, ps[i], args.new, ignore_eos=True)]
        wall = statistics.median(walls)
        rows.append((f"kiln, {clients} client{'s' if clients > 1 else ''}", statistics.median(totals) / wall,
                     pct(ttft, 50), pct(gaps, 50), pct(gaps, 99)))

    def hf_row(name, model_, batch):
        tps, firsts = [], []
        for _ in range(args.repeats):
            s, out = hf_generate(model_, batch, args.new)
            tps.append(sum(len(o) for o in out) / s)
            firsts.append(hf_generate(model_, batch, 1)[0])
        rows.append((name, statistics.median(tps), statistics.median(firsts) * 1e3, float("nan"), float("nan")))

    hf_generate(model, ps[:1], 4)  # warm-up
    hf_row("transformers eager, batch 1", model, ps[:1])
    hf_row("transformers eager, batch 16", model, ps[:16])
    if not args.no_inductor:
        try:
            compiled = build_model()
            compiled.forward = torch.compile(compiled.forward, dynamic=True)
            hf_generate(compiled, ps[:1], args.new)  # compiles
            hf_row("transformers + torch.compile, batch 1", compiled, ps[:1])
        except Exception as e:  # noqa: BLE001 - report, keep the other figures
            print(f"torch.compile'd generate did not run: {type(e).__name__}: {str(e)[:200]}")

    print(f"{args.prompt}-token prompts, {args.new} new tokens each, greedy; medians of {args.repeats} runs")
    print(f"{'setting':<40} {'tokens/s':>9} {'TTFT ms':>8} {'tok p50 ms':>10} {'tok p99 ms':>10}")
    for name, tps, first, p50, p99 in rows:
        print(f"{name:<40} {tps:9.1f} {first:8.2f} {p50:10.2f} {p99:10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
