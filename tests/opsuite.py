"""PyTorch's OpInfo samples through kiln, for every op the lowering registry claims.

For each OpInfo whose ATen name has a lowering, up to N float32 samples are exported, lowered
and evaluated with the IR's reference semantics, and compared with torch eager; each sample that
lowers is then compiled (search on, the cost model's pick) and run through the generated CPU
kernels, and compared again. Each sample ends, on each path, as `pass`, `mismatch` (a wrong
answer: always a bug), `error` (a kiln bug) or `unsupported` (kiln refused it with
FAILED_PRECONDITION, e.g. an argument combination with no lowering).

    python tests/opsuite.py --write docs/ops.md    # regenerate the supported-ops table
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SampleResult:
    op: str
    status: str          # reference evaluator: pass | mismatch | unsupported | error (a kiln bug) | export-error
    detail: str = ""
    kernels: str = ""    # generated CPU kernels: pass | mismatch | unsupported | error; "" when not lowered
    kernels_detail: str = ""


def _compare(outs, refs) -> tuple[str, str]:
    if len(refs) != len(outs):
        return "mismatch", f"{len(outs)} outputs, torch gives {len(refs)}"
    for o, r in zip(outs, refs):
        r = r.detach().numpy()
        if o.shape != r.shape or not np.allclose(o, r, rtol=1e-4, atol=1e-5, equal_nan=True):
            diff = "shape" if o.shape != r.shape else f"max abs err {np.nanmax(np.abs(o.astype(np.float64) - r)):.3g}"
            return "mismatch", diff
    return "pass", ""


def _run_kernels(pipeline, ep, x, refs) -> tuple[str, str]:
    """The exported sample compiled and run through the generated CPU kernels, against torch."""
    from kiln.core.errors import FailedPrecondition, KilnError

    try:
        r = pipeline.compile_program(pipeline.upload_program(ep), search=True, candidates=1)
        session = pipeline.load(r.bundle, r.manifest)
        outs = [a for _, a in pipeline.run(session, [("x", x.detach().numpy())])]
    except FailedPrecondition as e:
        return "unsupported", str(e)[:160]
    except (KilnError, AssertionError, ValueError, IndexError) as e:
        return "error", f"{type(e).__name__}: {str(e)[:160]}"
    return _compare(outs, refs)


def registry_ops() -> list[str]:
    """The ATen ops kiln lowers, as `aten.name.overload`, sorted."""
    from importer_svc.lowerings import LOWERINGS

    return sorted(str(k) for k in LOWERINGS if str(k).startswith("aten."))


def claimed_opinfos():
    from torch.testing._internal.common_methods_invocations import op_db

    names = {op.split(".")[1] for op in registry_ops()}
    return [o for o in op_db if o.name.split(".")[-1] in names and not o.name.startswith(("sparse.", "masked."))]


class _Call(torch.nn.Module):
    def __init__(self, fn, args, kwargs):
        super().__init__()
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def forward(self, x):
        return self.fn(x, *self.args, **self.kwargs)


def run_sample(opinfo, sample, pipeline=None) -> SampleResult:
    from importer_svc.importer import lower_program
    from kiln.core.errors import FailedPrecondition, InvalidArgument, KilnError
    from kiln.ir.evaluate import evaluate

    x = sample.input
    if not isinstance(x, torch.Tensor) or any(isinstance(a, torch.Tensor) for a in sample.args) \
            or any(isinstance(v, torch.Tensor) for v in sample.kwargs.values()):
        # only the first argument is a graph input; tensors elsewhere would become constants
        tensors = [a for a in (x, *sample.args, *sample.kwargs.values()) if isinstance(a, torch.Tensor)]
        if not tensors:
            return SampleResult(opinfo.name, "export-error", "no tensor input")
    module = _Call(opinfo.op, sample.args, sample.kwargs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = module(x)
            ep = torch.export.export(module, (x,))
    except Exception as e:  # torch cannot export this sample: not kiln's verdict
        return SampleResult(opinfo.name, "export-error", f"{type(e).__name__}: {str(e)[:120]}")
    try:
        graph, weights = lower_program(ep)
        outs = evaluate(graph, {graph.inputs[0].name: x.detach().numpy()} if graph.inputs else {},
                        {k: v.detach().numpy() for k, v in weights.items()})
    except (FailedPrecondition, InvalidArgument) as e:
        return SampleResult(opinfo.name, "unsupported", str(e)[:160])
    except (KilnError, AssertionError, ValueError, IndexError) as e:
        return SampleResult(opinfo.name, "error", f"{type(e).__name__}: {str(e)[:160]}")
    refs = [r for r in torch.utils._pytree.tree_leaves(ref) if isinstance(r, torch.Tensor)]
    status, detail = _compare(outs, refs)
    kernels, kernels_detail = _run_kernels(pipeline, ep, x, refs) if pipeline is not None else ("", "")
    return SampleResult(opinfo.name, status, detail, kernels, kernels_detail)


def run_suite(max_samples: int = 3, kernels: bool = True) -> list[SampleResult]:
    """Every claimed OpInfo's samples; with `kernels`, through the generated CPU kernels too (one
    store for the whole suite, in a temporary folder)."""
    import tempfile

    from kiln.pipeline import Pipeline

    torch.manual_seed(0)
    results = []
    with tempfile.TemporaryDirectory(prefix="kiln-opsuite-") as d:
        pipeline = Pipeline(f"file://{d}", addresses={}) if kernels else None
        for opinfo in claimed_opinfos():
            if torch.float32 not in opinfo.supported_dtypes("cpu"):
                continue
            samples = list(opinfo.sample_inputs("cpu", torch.float32, requires_grad=False))[:max_samples]
            for sample in samples:
                results.append(run_sample(opinfo, sample, pipeline))
    return results


def render(results: list[SampleResult]) -> str:
    per_op: dict[str, Counter] = {}
    for r in results:
        c = per_op.setdefault(r.op, Counter())
        c[r.status] += 1
        c["k:" + r.kernels] += 1
    lines = ["# Supported ops", "",
             "Generated by `python tests/opsuite.py --write docs/ops.md` from the lowering registry and",
             "PyTorch's OpInfo samples (float32, up to 3 per op, checked with rtol=1e-4, atol=1e-5 against",
             "eager twice: through the importer and the IR's reference evaluator, and compiled (search on)",
             "and run through the generated CPU kernels). Do not edit by hand.", "",
             "## ATen ops with a lowering", ""]
    lines += [f"- `{op}`" for op in registry_ops()]
    lines += ["", "## OpInfo samples", "",
              "Reference evaluator, then generated CPU kernels (for the samples that lower).", "",
              "| OpInfo | pass | unsupported | error | mismatch | not exportable | kernels pass | kernels unsupported "
              "| kernels error | kernels mismatch |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for op, c in sorted(per_op.items()):
        lines.append(f"| `{op}` | {c['pass']} | {c['unsupported']} | {c['error']} | {c['mismatch']} | "
                     f"{c['export-error']} | {c['k:pass']} | {c['k:unsupported']} | {c['k:error']} | "
                     f"{c['k:mismatch']} |")
    total = Counter(r.status for r in results)
    kernels = Counter(r.kernels for r in results)
    lines += ["", f"Total: {total['pass']} pass, {total['unsupported']} unsupported, {total['error']} error, "
              f"{total['mismatch']} mismatch, {total['export-error']} not exportable by torch.export.",
              f"Through the CPU kernels: {kernels['pass']} pass, {kernels['unsupported']} unsupported, "
              f"{kernels['error']} error, {kernels['mismatch']} mismatch.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", help="write the markdown table here")
    ap.add_argument("--json", help="write per-sample results here")
    args = ap.parse_args(argv)
    results = run_suite()
    text = render(results)
    if args.write:
        with open(args.write, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)
    for r in results:
        if r.status in ("mismatch", "error"):
            print(f"{r.status.upper()} {r.op}: {r.detail}", file=sys.stderr)
        if r.kernels in ("mismatch", "error"):
            print(f"KERNELS {r.kernels.upper()} {r.op}: {r.kernels_detail}", file=sys.stderr)
    print("\n".join(line for line in text.splitlines() if line.startswith(("Total:", "Through"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
