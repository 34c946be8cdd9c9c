"""Do SIMD vector widths matter, and does the search pick them right? Each case is compiled with
the search on (this machine's calibrated profile); then its chosen kernel graph is emitted again
with every kernel forced to each vector width (0: LLVM's own choice, none asked for), and all
variants are timed together on the executor (Executor.Profile: interleaved, medians). Prints the
widths the search chose per kernel, each variant's predicted and measured time, and the
calibrated in-cache rate per width.

    .venv/bin/python benchmarks/vector_widths.py [--repeats 100]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from schedules import _B1, _W1, _Fn  # this directory's schedules.py: the same GEMM case's weights


CASES = [
    ("softmax(x, -1), x [256, 1024]", _Fn(lambda x: torch.softmax(x, -1)), (256, 1024)),
    ("layer_norm(x), x [2048, 384]", torch.nn.LayerNorm(384), (2048, 384)),
    ("(x*x).sum(-1), x [512, 1024]", _Fn(lambda x: (x * x).sum(-1)), (512, 1024)),
    ("gelu(x @ w + b), x [512, 384], w [384, 1536]", _Fn(lambda x: torch.nn.functional.gelu(x @ _W1 + _B1)),
     (512, 384)),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=100)
    args = ap.parse_args()
    import kiln
    from kiln.ir.serialize import kernel_graph_from_pb, kernel_graph_to_pb
    from kiln.runtime.vectorwidth import host_widths
    from kiln.v1 import ir_pb2
    from optimizer_svc.cost import predict

    pipeline = kiln.Pipeline()
    _, profile = pipeline.calibrate()
    print("calibrated in-cache rate per width (bits: Gelem/s; 0 = LLVM's choice):",
          ", ".join(f"{v.bits}: {v.gelems:.2f}" for v in profile.vector_rates))
    torch.manual_seed(0)
    for name, module, shape in CASES:
        module = module.eval()
        x = torch.randn(shape)
        compiled = kiln.compile(module, (x,), pipeline=pipeline)
        kg = kernel_graph_from_pb(pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
        print(name)
        print("  search chose:", ", ".join(f"{k.name} {k.vector or 'llvm'}" for k in kg.kernels))
        variants = []
        for bits in (0,) + host_widths():
            forced = dataclasses.replace(kg, kernels=tuple(dataclasses.replace(k, vector=bits) for k in kg.kernels))
            digest = pipeline.store.put_message(kernel_graph_to_pb(forced))
            bundle, _, _ = pipeline.emit(digest)
            variants.append((bits, forced, bundle))
        timings = {str(b): (med, low) for b, med, low, _, _ in
                   pipeline.profile([b for _, _, b in variants], compiled.result.manifest, args.repeats)}
        for bits, forced, bundle in variants:
            med, low = timings[str(bundle)]
            predicted = sum(c.seconds for c in predict(forced, profile))
            print(f"  width {bits or 'llvm':>4}: predicted {predicted * 1e6:8.1f} us  measured median "
                  f"{med * 1e6:8.1f} us (min {low * 1e6:8.1f})")
        with torch.no_grad():
            got, ref = compiled(x), module(x)
        print(f"  max abs err of the compiled program against eager: {float((got - ref).abs().max()):.3g}")


if __name__ == "__main__":
    main()
