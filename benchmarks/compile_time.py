"""Compile time at real size: a cold compile in a new process over an empty store, with default
settings (search on, candidates timed), then a second process over the warm store.

Per case it prints the cold and warm wall times, the cold process's peak resident memory against
the target (2x the fp32 weights plus 1 GB) and its largest compile worker's (executor_svc/precompile.py), and where the cold time went (the compile trace's
spans, summed by name: import, calibrate, search, emit, choose, load). Weights are random and
seeded; the shapes are the named models' (nothing is downloaded).

    .venv/bin/python benchmarks/compile_time.py [--cases minilm,bert-base] [--layers 8,16,30]

Cases: minilm (6 layers, hidden 384, batch 8 x seq 64), bert-base (12 layers, 768, 1 x 128),
smollm2-135m (prefill + decode; --layers picks the depths), qwen2-0.5b (24 layers, prefill +
decode). Each child gets --timeout seconds. A compile's time is kiln.compile's (compile_causal_lm's)
call alone: the first run and the check against eager come after it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the child: build the model, compile it once into the store, report times, memory and spans
CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import torch
case, layers, store = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
import kiln
from kiln.pipeline import Pipeline

def bert(hidden, layers, heads, inter):
    from transformers import BertConfig, BertModel
    cfg = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                     intermediate_size=inter, vocab_size=30522)
    return BertModel(cfg).eval()

def llama(layers):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                      max_position_embeddings=2048)
    return LlamaForCausalLM(cfg).eval()

def qwen2(layers):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=896, num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                      max_position_embeddings=2048)
    return Qwen2ForCausalLM(cfg).eval()

p = Pipeline("file://" + store)
if case in ("minilm", "bert-base"):
    from kiln.hf import ModelOutputTensor
    model = bert(384, layers, 12, 1536) if case == "minilm" else bert(768, layers, 12, 3072)
    batch, seq = (8, 64) if case == "minilm" else (1, 128)
    kwargs = {"input_ids": torch.randint(0, 30522, (batch, seq)), "attention_mask": torch.ones(batch, seq, dtype=torch.long)}
    wrapped = ModelOutputTensor(model)
    built = time.perf_counter()
    compiled = kiln.compile(wrapped, (), kwargs, pipeline=p)
    done = time.perf_counter()
    with torch.no_grad():
        err = float((compiled(**kwargs) - wrapped(**kwargs)).abs().max())
else:
    from kiln.llm import compile_causal_lm
    model = llama(layers) if case == "smollm2-135m" else qwen2(layers)
    built = time.perf_counter()
    compile_causal_lm(model, p, max_context=256, max_batch=16)
    done = time.perf_counter()
    err = None
weights = sum(t.numel() * 4 for t in model.state_dict().values())
print(json.dumps({"compile_s": done - built, "process_s": time.perf_counter() - t0, "err": err, "weights_bytes": weights,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

CASES = {"minilm": 6, "bert-base": 12, "smollm2-135m": 30, "qwen2-0.5b": 24}
TARGET_COLD_S = {"minilm": 30, "bert-base": 60, "smollm2-135m": 120, "qwen2-0.5b": 300}
STAGES = ("kiln.export", "importer", "executor.calibrate", "optimizer.search", "codegen", "kiln.choose",
          "executor.profile", "executor.precompile", "executor.load")


def child(case: str, layers: int, store: str, trace: str, timeout: float) -> dict:
    # the machine's own caches (compiled kernels) beside the store, not ~/.cache/kiln: a cold
    # compile starts from nothing, and the warm one has what the cold one left
    env = {k: v for k, v in os.environ.items() if k != "KILN_KERNEL_CACHE"}
    env.update(KILN_TRACE_FILE=trace, KILN_PROGRESS="0", KILN_CACHE_DIR=str(Path(store).parent / "cache"),
               PYTHONPATH=str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, case, str(layers), store], env=env, capture_output=True,
                       text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"{case} ({layers} layers) failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["wall_s"] = wall
    return out


def where(trace: str) -> dict[str, float]:
    """Seconds per stage in the trace file: spans summed by name prefix, outermost only."""
    from kiln.core.telemetry import read_spans

    spans = read_spans(Path(trace))
    by_id = {s["span_id"]: s for s in spans}
    out: dict[str, float] = {}
    for s in spans:
        stage = next((p for p in STAGES if s["name"].startswith(p)), None)
        if stage is None:
            continue
        parent, nested = by_id.get(s["parent_id"]), False
        while parent is not None:  # a stage inside the same stage (codegen.Emit > codegen.emit) counts once
            if parent["name"].startswith(stage):
                nested = True
                break
            parent = by_id.get(parent["parent_id"])
        if not nested:
            out[stage] = out.get(stage, 0.0) + (s["end_ns"] - s["start_ns"]) / 1e9
    return out


def worker_rss(trace: str) -> float:
    """The largest compile worker's peak resident MiB (executor.precompile's kiln.worker_peak_rss_mb)."""
    from kiln.core.telemetry import read_spans

    return max([s["attributes"].get("kiln.worker_peak_rss_mb", 0.0) for s in read_spans(Path(trace))
                if s["name"] == "executor.precompile"], default=0.0)


def chosen(trace: str) -> list[dict]:
    """Per choice in the trace (a program's candidates timed): which one won, counted from 0 in
    the cost model's order (best predicted first), and each candidate's paired ratio and rounds."""
    from kiln.core.telemetry import read_spans

    spans = read_spans(Path(trace))
    out = []
    for c in (s for s in spans if s["name"] == "kiln.choose"):
        timed = sorted((s for s in spans if s["name"] == "executor.candidate" and s["trace_id"] == c["trace_id"]
                        and c["start_ns"] <= s["start_ns"] <= c["end_ns"]), key=lambda s: s["attributes"]["kiln.candidate"])
        out.append({"chosen": c["attributes"].get("kiln.chosen"),
                    "relative": [round(s["attributes"].get("kiln.relative", 0.0), 3) for s in timed],
                    "rounds": [s["attributes"].get("kiln.rounds") for s in timed]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="minilm,bert-base,smollm2-135m,qwen2-0.5b")
    ap.add_argument("--layers", default="", help="smollm2-135m depths to compile (default: 8,16,30)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()
    runs = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; cases: {', '.join(CASES)}")
        depths = [int(x) for x in (args.layers or "8,16,30").split(",")] if case == "smollm2-135m" else [CASES[case]]
        runs += [(case, n) for n in depths]
    rows = []
    for case, layers in runs:
        with tempfile.TemporaryDirectory(prefix="kiln-compile-time-") as d:
            store, trace = str(Path(d) / "store"), str(Path(d) / "cold.jsonl")
            print(f"{case} ({layers} layers): cold compile ...", file=sys.stderr, flush=True)
            cold = child(case, layers, store, trace, args.timeout)
            stages = where(trace)
            choices, worker_mb = chosen(trace), worker_rss(trace)
            print(f"{case} ({layers} layers): warm compile ...", file=sys.stderr, flush=True)
            warm = child(case, layers, store, str(Path(d) / "warm.jsonl"), args.timeout)
        w = cold["weights_bytes"]
        row = {"case": case, "layers": layers, "cold_s": cold["compile_s"], "cold_process_s": cold["wall_s"],
               "warm_s": warm["compile_s"], "peak_rss_gb": cold["peak_rss_bytes"] / 2**30,
               "worker_peak_rss_gb": worker_mb / 2**10, "weights_gb": w / 2**30,
               "rss_target_gb": (2 * w + 2**30) / 2**30, "err": cold["err"], "stages_s": stages,
               "choices": choices}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print(f"{'case':<22} {'cold s':>8} {'target':>7} {'warm s':>7} {'peak RSS GB':>12} {'worker GB':>10} {'target GB':>10}  where the cold time went")
    for r in rows:
        spent = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["stages_s"].items(), key=lambda kv: -kv[1]) if v >= 0.05)
        print(f"{r['case'] + ' x' + str(r['layers']):<22} {r['cold_s']:>8.1f} {TARGET_COLD_S[r['case']]:>7} "
              f"{r['warm_s']:>7.2f} {r['peak_rss_gb']:>12.2f} {r['worker_peak_rss_gb']:>10.2f} {r['rss_target_gb']:>10.2f}  {spent}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
