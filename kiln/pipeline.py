"""kiln.Pipeline drives the four stages (kiln.stages), in process (default) or over gRPC.

Remote mode is chosen per stage by KILN_<STAGE>_ADDR (comma-separated for several replicas,
balanced round-robin, or one DNS name such as dns:///kiln-optimizer:50052) or by the addresses
passed in. A remote call that fails with UNAVAILABLE is retried with backoff inside its deadline.
Both modes raise the same KilnError types, so callers and tests do not care which one runs.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np

from kiln.cas import cache
from kiln.core import errors
from kiln.core import progress as live
from kiln.cas.digest import Digest
from codegen_svc.targets import target as target_named
from kiln.core.limits import contended_share, quieter_now
from kiln.cas.store import BlobStore, open_store
from kiln.core.telemetry import child_span, current_span, setup_tracing, span
from kiln.exportkey import EXPORT_KEY_VERSION, export_key
from kiln.ir.dtypes import numpy_to_torch, torch_to_numpy
from kiln.stages import STAGES, LocalStages, RemoteStages, Stages, Timing
from executor_svc.generate import Sampling
from optimizer_svc.optimizer import OptimizeOptions
from kiln.v1 import services_pb2

log = logging.getLogger(__name__)

DEFAULT_CANDIDATES = 8  # schedule candidates a compile times on the executor (KILN_CANDIDATES overrides)


def default_candidates() -> int:
    v = os.environ.get("KILN_CANDIDATES", "")
    try:
        n = int(v) if v else DEFAULT_CANDIDATES
    except ValueError:
        raise errors.InvalidArgument(f"KILN_CANDIDATES must be a whole number, got {v!r}") from None
    if n < 1:
        raise errors.InvalidArgument(f"KILN_CANDIDATES must be at least 1, got {n}")
    return n


CHOOSE_REPEATS = 20  # interleaved rounds a choice times its candidates (Pipeline.choose_repeats)
CHOOSE_VERSION = "choose-4"  # 4: chosen by paired ratios, recorded in the report


@dataclass
class CompileResult:
    graph: Digest
    manifest: Digest
    kernel_graph: Digest
    bundle: Digest
    report: services_pb2.OptimizeReport
    kernels: int
    peak_bytes: int


@dataclass(frozen=True)
class Imported:
    """A program imported already: its graph and weight manifest (what the export cache holds)."""
    graph: Digest
    manifest: Digest


def _with_launch_shapes(report: services_pb2.OptimizeReport, shapes) -> services_pb2.OptimizeReport:
    """The report with its first (best predicted) candidate added once per other launch shape."""
    out = services_pb2.OptimizeReport()
    out.CopyFrom(report)
    for block, tile in shapes:
        c = out.candidates.add()
        c.CopyFrom(report.candidates[0])
        c.block, c.tile = block, tile
        c.schedule = f"{c.schedule} block={block} tile={tile}".strip()
    return out


class Pipeline:
    """Drives the stages: each in process (LocalStages) unless an address is given for it
    (RemoteStages); the choice is made here, once per stage."""

    def __init__(self, store: BlobStore | str | None = None, addresses: Optional[Mapping[str, str]] = None,
                 timeout: Optional[float] = 600.0):
        setup_tracing("kiln-client")
        self.store = store if isinstance(store, BlobStore) else open_store(store)
        addresses = dict(addresses or {})
        for s in STAGES:
            env = os.environ.get(f"KILN_{s.upper()}_ADDR")
            if s not in addresses and env:
                addresses[s] = env
        self.addresses = addresses
        self.timeout = timeout
        self.choose_repeats = CHOOSE_REPEATS  # rounds that time a compile's candidates: fewer is quicker, noisier
        self._local = LocalStages(self.store)
        remote = RemoteStages(self.store, addresses, timeout) if addresses else None
        self._stages: dict[str, Stages] = {s: remote if s in addresses else self._local for s in STAGES}

    @property
    def remote(self) -> bool:
        return bool(self.addresses)

    def local_executor(self):
        """The Executor this process runs sessions on when the executor stage is in process."""
        return self._local.executor

    # ---- the four stages ----

    def import_program(self, program: Digest) -> tuple[Digest, Digest]:
        return self._stages["importer"].import_program(program)

    def import_exported(self, ep) -> tuple[Digest, Digest]:
        """A torch.export program of this process, imported: in local mode lowered as it is (no
        .pt2 archive written and read back); a remote importer gets its archive."""
        if self.remote:
            return self.import_program(self.upload_program(ep))
        return self._stages["importer"].import_exported(ep)

    def optimize(self, graph: Digest, search: bool = True, max_iterations: int = 0, max_enodes: int = 0,
                 time_budget_s: float = 0.0, target_profile: Optional[Digest] = None, candidates: int = 0
                 ) -> tuple[Digest, services_pb2.OptimizeReport]:
        """0 for a bound or the candidates: the optimizer's default."""
        options = OptimizeOptions.given(search, max_iterations, max_enodes, time_budget_s, candidates, target_profile)
        return self._stages["optimizer"].optimize(graph, options)

    def emit(self, kernel_graph: Digest, target: str = "cpu", block: int = 0, tile: int = 0
             ) -> tuple[Digest, int, int]:
        """`block` and `tile`: a cuda program's launch shape (0: the defaults)."""
        return self._stages["codegen"].emit(kernel_graph, target, block, tile)

    def load(self, bundle: Digest, manifest: Digest) -> str:
        return self._stages["executor"].load(bundle, manifest)

    def run(self, session: str, inputs: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]:
        return self._stages["executor"].run(session, inputs)

    def generate(self, model: Digest, prompt_ids: Sequence[int], max_new_tokens: int = 0, *,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 0.0, seed: int = 0,
                 stop_sequences: Sequence[Sequence[int]] = (), ignore_eos: bool = False, logprobs: int = -1):
        """New tokens of the CausalLM `model` (kiln.llm.compile_causal_lm) for the prompt, as
        they are made: an iterator of (token id, finish reason: "" until the last one, then
        "length", "eos" or "stop") pairs (kiln.stages.Token); with `logprobs` >= 0 each also has
        its log-probability (.logprob) and that many of the most likely tokens' (.top). Errors
        (a limit: ResourceExhausted) are raised when iteration starts, in both modes; closing the
        iterator early frees the sequence."""
        return self._stages["executor"].generate(model, prompt_ids, max_new_tokens,
                                                 Sampling(temperature, top_k, top_p, seed, logprobs), stop_sequences,
                                                 ignore_eos)

    def calibrate(self, target: str = "cpu", force: bool = False) -> tuple[Digest, services_pb2.TargetProfile]:
        """The target's measured cost-model constants (measured once per target fingerprint)."""
        return self._stages["executor"].calibrate(target, force)

    def known_profile(self, target: str = "cpu") -> Optional[Digest]:
        """The target's calibrated profile if it has been measured already; never measures."""
        return self._stages["executor"].known_profile(target)

    def profile(self, bundles: Sequence[Digest], manifest: Digest, repeats: int = 20,
                symbols: Optional[dict] = None) -> list[Timing]:
        """Time candidate bundles on the executor: (bundle, median s, min s, relative, others busy)
        each, relative the median over interleaved rounds of its time over the round's fastest,
        others busy the share of the machine other processes took meanwhile (kiln.core.limits.CpuLoad)."""
        return self._stages["executor"].profile(bundles, manifest, repeats, symbols)

    # ---- whole compiles ----

    def compile_program(self, program, search: bool = True, target: str = "cpu",
                        target_profile: Optional[Digest] = None, candidates: Optional[int] = None
                        ) -> CompileResult:
        """Import, optimize, emit. `program`: a .pt2 archive's digest, a torch.export program of
        this process (import_exported), or one Imported already. With the search on and more
        than one candidate, the optimizer's best predicted schedules (under the target's
        calibrated profile, measured once per target) are emitted and timed on the executor,
        and the fastest is kept. With one candidate the cost model's pick is kept, under the
        calibrated profile if the target has one already (a compile never measures the machine
        just to rank one candidate)."""
        candidates = default_candidates() if candidates is None else candidates
        with span("kiln.compile_program", **{"kiln.remote": self.remote}) as s:
            live.stage("import")
            if isinstance(program, Digest):
                s.set_attribute("kiln.program", str(program))
                graph, manifest = self.import_program(program)
            elif isinstance(program, Imported):
                s.set_attribute("kiln.graph", str(program.graph))
                graph, manifest = program.graph, program.manifest
            else:
                graph, manifest = self.import_exported(program)
            if search and target_profile is None:  # the program chosen depends on the profile, not on who asks
                live.stage("calibrate")
                target_profile = self.calibrate(target)[0] if candidates > 1 else self.known_profile(target)
            live.stage("search" if search else "optimize")
            kg, report = self.optimize(graph, search=search, target_profile=target_profile,
                                       candidates=candidates if search else 1)
            launch = (0, 0)
            if len(report.candidates) > 1:
                live.stage("emit and time candidates")
                kg, report = self.choose(report, manifest, target, target_profile)
                chosen = next(c for c in report.candidates if c.chosen)
                launch = (chosen.block, chosen.tile)
            live.stage("emit")
            bundle, kernels, peak = self.emit(kg, target, *launch)
            current_span().set_attribute("kiln.bundle", str(bundle))  # the chosen one, not the last timed
        return CompileResult(graph, manifest, kg, bundle, report, kernels, peak)

    def choose(self, report: services_pb2.OptimizeReport, manifest: Digest, target: str,
               target_profile: Optional[Digest]) -> tuple[Digest, services_pb2.OptimizeReport]:
        """Emit and time the report's candidates on the executor (Executor.Profile, interleaved,
        medians); the fastest wins. The report comes back with each candidate's measured time.
        A choice is recorded in the action cache per target fingerprint, so it is made once; one
        timed while other processes took over contended_share() of the CPUs is recorded with
        that share and used, and timed again once the machine is quieter (the quieter timing's
        choice is kept)."""
        fingerprint = (self.store.get_message(target_profile, services_pb2.TargetProfile).fingerprint
                       if target_profile is not None else "")
        shapes = target_named(target).launch_shapes
        if shapes:  # the best predicted program again, under each other launch shape
            report = _with_launch_shapes(report, shapes)
        kgs = [Digest.from_pb(c.kernel_graph) for c in report.candidates]
        # keyed by the emitted bundles: new generated code is timed again (emit is cached)
        bundles = [self.emit(d, target, c.block, c.tile)[0] for d, c in zip(kgs, report.candidates)]
        params = {"target": target, "fingerprint": fingerprint}
        if self.choose_repeats != CHOOSE_REPEATS:  # a choice timed in fewer rounds is not the default's
            params["repeats"] = self.choose_repeats
        key = cache.action_key("choose", CHOOSE_VERSION, {f"candidate{i}": d for i, d in enumerate(bundles)}, params)
        hit = cache.lookup(self.store, key)
        recorded = None
        if hit is not None:  # the timings are the bundles'; the rest of the report is this optimize's
            timed = self.store.get_message(hit["report"], services_pb2.OptimizeReport)
            out = services_pb2.OptimizeReport()
            out.CopyFrom(report)
            for c, t in zip(out.candidates, timed.candidates):
                c.measured_s, c.relative, c.chosen = t.measured_s, t.relative, t.chosen
            out.kernels, out.others_busy = timed.kernels, timed.others_busy
            recorded = hit["kernel_graph"], out
            # a choice timed on a contended machine is timed again once the machine is quieter
            if timed.others_busy <= contended_share() or not quieter_now(timed.others_busy):
                return recorded
        with span("kiln.choose", **{"kiln.candidates": len(kgs)}) as s:
            timings = self.profile(bundles, manifest, repeats=self.choose_repeats)
            # by paired ratios, not medians: a machine that slows for part of the timing moves
            # medians but not the ratios within a round (executor.paired_ratios)
            best = min(range(len(kgs)), key=lambda i: (timings[i][3], timings[i][1]))
            others = timings[0][4]
            s.set_attribute("kiln.chosen", best)
            s.set_attribute("kiln.others_busy", others)
        out = services_pb2.OptimizeReport()
        out.CopyFrom(report)
        for i, (c, (_, median, _, relative, _)) in enumerate(zip(out.candidates, timings)):
            c.measured_s, c.relative = median, relative
            c.chosen = i == best
        out.kernels = out.candidates[best].kernels
        out.others_busy = others
        if recorded is not None and others >= recorded[1].others_busy:
            return recorded  # timed again, but no quieter than the choice already recorded
        if others > contended_share():
            log.warning("other processes took %.0f%% of the CPUs while %d candidates were timed; the choice is "
                        "cached with that, and timed again when the machine is quieter", 100 * others, len(kgs))
        cache.record(self.store, key, {"kernel_graph": kgs[best], "report": self.store.put_message(out)})
        return kgs[best], out

    def exported(self, key: Optional[str], names: Sequence[str]) -> Optional[dict[str, Digest]]:
        """The programs exported and imported under a key of kiln.exportkey (their graphs and
        manifests, and what else was recorded with them), or None: no key, nothing recorded, or
        not every name."""
        if key is None:
            return None
        found = cache.lookup(self.store, _export_action(key))
        return found if found is not None and all(n in found for n in names) else None

    def record_exported(self, key: Optional[str], outputs: Mapping[str, object]) -> None:
        """Records imported programs (digests) and text (stored as blobs) under an export key."""
        if key is not None:
            digests = {n: v if isinstance(v, Digest) else self.store.put(str(v).encode()) for n, v in outputs.items()}
            cache.record(self.store, _export_action(key), digests)

    def upload_program(self, ep) -> Digest:
        import torch

        buf = io.BytesIO()
        torch.export.save(ep, buf)
        with buf.getbuffer() as archive:  # the archive holds every weight: not copied again
            return self.store.put(archive)


def _export_action(key: str) -> cache.ActionKey:
    """The action cache's key for the programs exported under an export key (kiln.exportkey)."""
    return cache.action_key("export", EXPORT_KEY_VERSION, {}, {"key": key})


class CompiledModule:
    """A compiled nn.Module: call it with the module's arguments, get its output structure."""

    def __init__(self, pipeline: Pipeline, result: CompileResult, session: str, in_spec):
        from torch.utils import _pytree as pytree

        from kiln.v1 import ir_pb2

        self.pipeline = pipeline
        self.result = result
        self.session = session
        self._in_spec = in_spec
        bundle = pipeline.store.get_message(result.bundle, ir_pb2.Bundle)
        # tensor inputs in placeholder order; export specialized non-tensor arguments away
        self._input_names = [t.name for t in bundle.inputs]
        self._out_tree = pytree.treespec_loads(bundle.output_tree) if bundle.output_tree else None
        # compiled for positional tensors only: a call passing just those skips flattening
        n = len(self._input_names)
        self._positional = in_spec is None or in_spec == pytree.tree_flatten((tuple(range(n)), {}))[1]

    def __call__(self, *args, **kwargs):
        import torch
        from torch.utils import _pytree as pytree

        if self._positional and not kwargs and len(args) == len(self._input_names) and \
                all(isinstance(x, torch.Tensor) for x in args):
            tensors = args
        else:
            leaves, spec = pytree.tree_flatten((args, kwargs))
            if self._in_spec is not None and spec != self._in_spec:
                raise errors.InvalidArgument(f"arguments have structure {spec}, the module was compiled for "
                                             f"{self._in_spec}")
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            if len(tensors) != len(self._input_names):
                raise errors.InvalidArgument(f"expected {len(self._input_names)} tensor arguments, "
                                             f"got {len(tensors)}")
        inputs = [(n, torch_to_numpy(t)) for n, t in zip(self._input_names, tensors)]
        # a remote call is its own trace (client, gRPC, executor); an in-process call is traced
        # only inside a caller's trace, so a forward pass costs no span when nothing traces it
        with span("kiln.call", **{"kiln.session": self.session}) if self.pipeline.remote else \
                child_span("kiln.call", **{"kiln.session": self.session}):
            outs = self.pipeline.run(self.session, inputs)
        result = [numpy_to_torch(a) for _, a in outs]
        return pytree.tree_unflatten(result, self._out_tree) if self._out_tree is not None else tuple(result)


def compile(module, example_args: tuple, example_kwargs: Optional[dict] = None, *, search: bool = True,
            target: str = "cpu", pipeline: Optional[Pipeline] = None, dynamic_shapes=None,
            candidates: Optional[int] = None, progress: Optional[bool] = None) -> CompiledModule:
    """Compile an nn.Module for the example inputs' shapes, or for every shape `dynamic_shapes`
    (torch.export's argument, with torch.export.Dim) allows; returns a callable with its signature.
    `candidates` schedules are timed on the executor and the fastest kept (1: the cost model's pick;
    default $KILN_CANDIDATES or 8). `progress` shows the compile's progress on stderr after 2 s
    (None: when stderr is a terminal; kiln.core.progress)."""
    import torch
    from torch.utils import _pytree as pytree

    pipeline = pipeline or Pipeline()
    # one trace per compile: export, the four stages and the executor's Load
    with live.progress(f"kiln.compile {type(module).__name__}", progress), \
            span("kiln.compile", **{"kiln.remote": pipeline.remote}):
        live.stage("export")
        module = module.eval() if hasattr(module, "eval") else module
        with span("kiln.export") as es:
            key = export_key(module, tuple(example_args), example_kwargs, dynamic_shapes, {"entry": "compile"},
                             code=(sys.modules[__name__],))
            found = pipeline.exported(key, ("graph", "manifest", "in_spec"))
            es.set_attribute("kiln.export_cache", "off" if key is None else "hit" if found else "miss")
            if found:
                program = Imported(found["graph"], found["manifest"])
                in_spec = pytree.treespec_loads(pipeline.store.get(found["in_spec"]).decode())
            else:
                try:
                    program = torch.export.export(module, tuple(example_args), example_kwargs or {},
                                                  dynamic_shapes=dynamic_shapes)
                except Exception as e:
                    raise errors.FailedPrecondition(f"torch.export failed: {type(e).__name__}: {e}") from e
                in_spec = program.call_spec.in_spec
        result = pipeline.compile_program(program, search=search, target=target, candidates=candidates)
        if not found and key is not None and in_spec is not None:
            try:  # a structure torch cannot write as text is exported again next time
                spec_text = pytree.treespec_dumps(in_spec)
            except (TypeError, ValueError, NotImplementedError, AttributeError) as e:
                log.info("export not recorded: its input structure cannot be written (%s)", e)
            else:
                pipeline.record_exported(key, {"graph": result.graph, "manifest": result.manifest,
                                               "in_spec": spec_text})
        current_span().set_attribute("kiln.bundle", str(result.bundle))
        live.stage("load")
        session = pipeline.load(result.bundle, result.manifest)
    return CompiledModule(pipeline, result, session, in_spec)
