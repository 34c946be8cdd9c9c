"""Import-stage time per model (torch.export + run_decompositions + lowering), median of repeats.

    .venv/bin/python benchmarks/import_time.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def models():
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from kiln.apps.examples import encoder_example, resnet_example
    from kiln.hf import ModelOutputTensor

    ids = torch.randint(0, 1000, (1, 32))
    yield "tiny Llama (2 layers, hidden 128)", ModelOutputTensor(LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).eval()), (), {"input_ids": ids}
    yield "tiny GPT-2 (2 layers, hidden 128)", ModelOutputTensor(GPT2LMHeadModel(GPT2Config(
        vocab_size=1000, n_embd=128, n_layer=2, n_head=4)).eval()), (), {"input_ids": ids}
    yield "tiny BERT (2 layers, hidden 128)", ModelOutputTensor(BertModel(BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=256)).eval()), (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    m, a = encoder_example()
    yield "example encoder (2 layers, d 64)", m, a, {}
    m, a = resnet_example()
    yield "ResNet-style CNN", m, a, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from importer_svc.importer import lower_program

    print(f"{'model':<36} {'export s':>9} {'lower s':>8} {'total s':>8} {'nodes':>6}")
    for name, module, a, kw in models():
        exp, low = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ep = torch.export.export(module, a, kw, strict=False)
            t1 = time.perf_counter()
            graph, _ = lower_program(ep)
            t2 = time.perf_counter()
            exp.append(t1 - t0)
            low.append(t2 - t1)
        e, l = statistics.median(exp), statistics.median(low)
        print(f"{name:<36} {e:>9.2f} {l:>8.2f} {e + l:>8.2f} {len(graph.nodes):>6}")


if __name__ == "__main__":
    main()
