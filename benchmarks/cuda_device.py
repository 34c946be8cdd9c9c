"""The CUDA path on a real GPU: compile the BERT-shaped encoder and tiny Llama for target=cuda,
check each against torch on the GPU, and time kiln against torch eager (CUDA), interleaved,
medians. Prints a table and exits non-zero on a wrong answer.

    .venv/bin/python benchmarks/cuda_device.py [--repeats 50] [--json FILE]
    NUMBA_ENABLE_CUDASIM=1 .venv/bin/python benchmarks/cuda_device.py --small   # a dry run, no GPU

On the device machine: `pip install torch==2.13.0` brings a CUDA build there; numba.cuda needs
the driver (and, with numba >= 0.61, the `numba-cuda` package if `from numba import cuda` warns).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

import kiln
from kiln.apps.examples import Encoder


def models(small: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if small:  # shapes the simulator gets through in seconds
        bert = Encoder(d=32, heads=2, ff=64, layers=1).eval(), (torch.randn(2, 8, 32),)
        cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        seq = 7
    else:  # issue 5's BERT shape and kiln bench's tiny Llama
        bert = Encoder(d=384, heads=12, ff=1536, layers=6).eval(), (torch.randn(8, 64, 384),)
        cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256)
        seq = 128
    lm = LlamaForCausalLM(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(input_ids=ids, use_cache=False).logits

    return {"bert": bert, "llama": (Logits().eval(), (torch.randint(0, cfg.vocab_size, (1, seq)),))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--small", action="store_true", help="tiny shapes (for numba's simulator)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if gpu else 'cpu (no GPU: torch timed on cpu)'}")
    rows, ok = [], True
    with tempfile.TemporaryDirectory(prefix="kiln-cuda-") as d:
        pipeline = kiln.Pipeline(f"file://{d}")
        for name, (model, inputs) in models(args.small).items():
            t0 = time.perf_counter()
            compiled = kiln.compile(model, inputs, target="cuda", pipeline=pipeline, candidates=1)
            compile_s = time.perf_counter() - t0
            dev_model = model.to(device)
            dev_inputs = tuple(x.to(device) for x in inputs)
            with torch.no_grad():
                want = dev_model(*dev_inputs)
                got = compiled(*inputs)
                err = float((got.to(device) - want).abs().max())
                good = bool(torch.allclose(got.to(device), want, rtol=1e-3, atol=1e-4))
                ok &= good
                kiln_t, torch_t = [], []
                for _ in range(args.repeats):  # interleaved
                    t0 = time.perf_counter()
                    compiled(*inputs)
                    kiln_t.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    dev_model(*dev_inputs)
                    if gpu:
                        torch.cuda.synchronize()
                    torch_t.append(time.perf_counter() - t0)
            k, e = statistics.median(kiln_t) * 1e3, statistics.median(torch_t) * 1e3
            rows.append({"model": name, "kiln_ms": k, "torch_ms": e, "speedup": e / k, "max_abs_err": err,
                         "correct": good, "compile_s": compile_s, "kernels": compiled.result.kernels})
            print(f"{name:6} kiln {k:9.3f} ms  torch eager {e:9.3f} ms  ({e / k:5.2f}x)  max err {err:.1e}  "
                  f"{'ok' if good else 'WRONG'}  compile {compile_s:.1f} s, {compiled.result.kernels} kernels")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    # kiln's time includes moving inputs to the device and outputs back, as a caller sees it
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
