"""How far is a choice made on a busy machine from the one made on a quiet one?

Each model is compiled twice with 8 timed schedule candidates, each time into a fresh store (so
the machine is calibrated and the candidates timed anew): once beside N processes spinning on the
CPUs, once with the machine quiet. Then, quiet, the two chosen programs are timed together on the
executor (Profile: interleaved rounds, paired ratios to each round's fastest, medians). Prints
what each compile saw (others' share of the CPUs while it timed) and the busy choice's time over
the quiet choice's.

    .venv/bin/python benchmarks/busy_choice.py [--spinners 2] [--repeats 50]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile

import torch

import kiln
from kiln.apps.examples import encoder_example, mlp_example
from kiln.pipeline import Pipeline


def _bert_layer():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=384, num_hidden_layers=2, num_attention_heads=6, intermediate_size=1536,
                     vocab_size=1000)
    model = BertModel(cfg).eval()
    return model, (torch.randint(0, 1000, (8, 64)),)


CASES = {"mlp": mlp_example, "encoder": encoder_example, "bert-2-layers": _bert_layer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spinners", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args()
    print(f"{'model':<16}{'busy: others':>14}{'quiet: others':>15}{'same choice':>13}{'busy / quiet time':>19}")
    for name, make in CASES.items():
        model, inputs = make()
        chosen = {}
        for mode in ("busy", "quiet"):
            p = Pipeline(f"file://{tempfile.mkdtemp(prefix=f'kiln-{mode}-')}")
            spinners = ([subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
                        if mode == "busy" else [])
            try:
                compiled = kiln.compile(model, inputs, pipeline=p, candidates=8)
            finally:
                for s in spinners:
                    s.kill()
                    s.wait()
            chosen[mode] = (p, compiled.result)
        (pq, rq), (pb, rb) = chosen["quiet"], chosen["busy"]
        # both choices timed together, quiet, from the quiet compile's store (the busy choice's
        # kernel graph copied there and emitted; the weights are the same blobs)
        pq.store.put(pb.store.get(rb.kernel_graph))
        busy_bundle = pq.emit(rb.kernel_graph)[0]
        timings = pq.profile([busy_bundle, rq.bundle], rq.manifest, repeats=args.repeats)
        for p, _ in chosen.values():
            shutil.rmtree(str(p.store.url)[len("file://"):], ignore_errors=True)
        ratio = timings[0][3] / timings[1][3]
        print(f"{name:<16}{rb.report.others_busy:>14.2f}{rq.report.others_busy:>15.2f}"
              f"{str(rb.kernel_graph == rq.kernel_graph):>13}{ratio:>19.3f}")


if __name__ == "__main__":
    main()
