"""PyTorch's OpInfo samples through kiln, for every op the lowering registry claims.

For each OpInfo whose ATen name has a lowering, up to N float32 samples are exported, lowered
and evaluated with the IR's reference semantics, and compared with torch eager; each sample that
lowers is then compiled (search on, the cost model's pick) and run through the generated CPU
kernels, and compared again: an op's passing samples as one program (one compile per op), each
sample alone again when that program fails or is wrong anywhere, so every result is the sample's
own. Each sample ends, on each path, as `pass`, `mismatch` (a wrong
answer: always a bug), `error` (a kiln bug) or `unsupported` (kiln refused it with
FAILED_PRECONDITION, e.g. an argument combination with no lowering).

    python tests/opsuite.py --write docs/ops.md    # regenerate the supported-ops table
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections import Counter

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
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


def _run_kernels(pipeline, ep, xs, refs) -> list[tuple[str, str]]:
    """The exported program `ep` (inputs `xs`) compiled (search on) and run through the generated
    CPU kernels; the outputs of each of its calls (refs: torch's, one list per call) compared
    with torch: a (result, detail) per call."""
    from kiln.core.errors import FailedPrecondition, KilnError
    from kiln.v1 import ir_pb2

    try:
        r = pipeline.compile_program(pipeline.upload_program(ep), search=True, candidates=1)
        session = pipeline.load(r.bundle, r.manifest)
        names = [t.name for t in pipeline.store.get_message(r.bundle, ir_pb2.Bundle).inputs]
        outs = [a for _, a in pipeline.run(session, [(n, x.detach().numpy()) for n, x in zip(names, xs)])]
    except FailedPrecondition as e:
        return [("unsupported", str(e)[:160])] * len(refs)
    except (KilnError, AssertionError, ValueError, IndexError) as e:
        return [("error", f"{type(e).__name__}: {str(e)[:160]}")] * len(refs)
    if len(outs) != sum(len(r) for r in refs):
        return [("mismatch", f"{len(outs)} outputs, torch gives {sum(len(r) for r in refs)}")] * len(refs)
    results, at = [], 0
    for r in refs:
        results.append(_compare(outs[at:at + len(r)], r))
        at += len(r)
    return results


def _run_batch(pipeline, lowered: list["_Lowered"]) -> list[tuple[str, str]]:
    """Several samples of one op through the kernels as one program (one compile, not one each)."""
    calls = _Calls([x.module for x in lowered])
    xs = [x.x for x in lowered]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = torch.export.export(calls, tuple(xs))
    except Exception as e:  # noqa: BLE001 - each sample alone exported; the caller runs them so
        return [("error", f"the samples together do not export: {type(e).__name__}")] * len(lowered)
    return _run_kernels(pipeline, ep, xs, [x.refs for x in lowered])


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


class _Calls(torch.nn.Module):
    """Several samples of one op as one program: input i is sample i's first argument; the
    outputs are each call's tensors in turn."""

    def __init__(self, calls: list[_Call]):
        super().__init__()
        self.calls = torch.nn.ModuleList(calls)

    def forward(self, *xs):
        outs = []
        for call, x in zip(self.calls, xs):
            outs += [r for r in torch.utils._pytree.tree_leaves(call(x)) if isinstance(r, torch.Tensor)]
        return tuple(outs)


@dataclasses.dataclass
class _Lowered:
    """A sample that the reference evaluator ran: what the kernel path needs."""
    result: SampleResult
    module: _Call
    ep: torch.export.ExportedProgram
    x: torch.Tensor
    refs: list


def _evaluate(opinfo, sample):
    """The sample through the importer and the reference evaluator: a SampleResult when it went
    no further, else _Lowered."""
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
    return _Lowered(SampleResult(opinfo.name, status, detail), module, ep, x, refs)


def run_op(opinfo, samples, pipeline=None) -> list[SampleResult]:
    """An OpInfo's samples on both paths. The kernel path compiles the samples that the evaluator
    passed as one program (one compile per op, not per sample); if that program fails or any of
    its samples is wrong, each sample is compiled on its own, so each result is its own."""
    lowered = [_evaluate(opinfo, s) for s in samples]
    if pipeline is None:
        return [x.result if isinstance(x, _Lowered) else x for x in lowered]
    batch = [x for x in lowered if isinstance(x, _Lowered) and x.result.status == "pass"]
    batched = _run_batch(pipeline, batch) if len(batch) > 1 else []
    done = {id(x): r for x, r in zip(batch, batched)} if all(r[0] == "pass" for r in batched) else {}
    results = []
    for x in lowered:
        if not isinstance(x, _Lowered):
            results.append(x)
            continue
        (kernels, detail), = [done[id(x)]] if id(x) in done else _run_kernels(pipeline, x.ep, [x.x], [x.refs])
        results.append(dataclasses.replace(x.result, kernels=kernels, kernels_detail=detail))
    return results


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
            results += run_op(opinfo, samples, pipeline)
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
