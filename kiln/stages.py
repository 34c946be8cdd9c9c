"""The four stages behind one interface, run in this process or called over gRPC.

`Stages` is what kiln.Pipeline drives. LocalStages calls the stage functions in process with
plain Python arguments (digests, OptimizeOptions, Sampling, numpy arrays): no request or
response message is built. RemoteStages calls the services: it is the one place on the client
side that encodes those arguments as requests and decodes responses, retries UNAVAILABLE with
backoff inside the deadline (kiln.rpc.client) and streams Generate. Results that are stored
artifacts (an OptimizeReport, a TargetProfile) are the same message types either way: they are
what the store holds. Both raise the same KilnError types.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Mapping, Optional, Protocol, Sequence

import numpy as np

from kiln.cas.digest import Digest
from kiln.cas.store import BlobStore
from kiln.core.errors import NotFound
from kiln.core.telemetry import span
from kiln.rpc.client import call, channel, kiln_error, retrying, wait_ready
from kiln.rpc.tensors import array_from_pb, array_to_pb
from kiln.v1 import services_pb2
from executor_svc.generate import Sampling
from optimizer_svc.optimizer import OptimizeOptions

STAGES = ("importer", "optimizer", "codegen", "executor")

# (bundle, median s, min s, relative to each round's fastest, share of the CPUs others took)
Timing = tuple[Digest, float, float, float, float]


class Token(tuple):
    """A new token: the pair (token id, finish reason: "" until the last one, then "length", "eos"
    or "stop"), with `logprob`, its log-probability under the model, and `top`, the most likely
    tokens' ((id, log-probability), ...), where the request asked (Sampling.logprobs); else None
    and ()."""

    def __new__(cls, token: int, reason: str, logprob: Optional[float] = None, top=()):
        t = super().__new__(cls, (token, reason))
        t.logprob, t.top = logprob, tuple(top)
        return t


class Stages(Protocol):
    def import_program(self, program: Digest) -> tuple[Digest, Digest]: ...

    def optimize(self, graph: Digest, options: OptimizeOptions) -> tuple[Digest, services_pb2.OptimizeReport]: ...

    def emit(self, kernel_graph: Digest, target: str, block: int, tile: int) -> tuple[Digest, int, int]: ...

    def load(self, bundle: Digest, manifest: Digest) -> str: ...

    def run(self, session: str, inputs: Sequence[tuple[str, np.ndarray]]) -> list[tuple[str, np.ndarray]]: ...

    def generate(self, model: Digest, prompt_ids: Sequence[int], max_new_tokens: int, sampling: Sampling,
                 stop_sequences: Sequence[Sequence[int]], ignore_eos: bool) -> Iterator[Token]: ...

    def calibrate(self, target: str, force: bool) -> tuple[Digest, services_pb2.TargetProfile]: ...

    def known_profile(self, target: str) -> Optional[Digest]: ...

    def profile(self, bundles: Sequence[Digest], manifest: Digest, repeats: int,
                symbols: Optional[dict]) -> list[Timing]: ...


class LocalStages:
    """The stages as function calls in this process, over one store; one Executor for its sessions."""

    def __init__(self, store: BlobStore):
        self.store = store
        self._executor = None

    @property
    def executor(self):
        if self._executor is None:
            from executor_svc.executor import Executor

            self._executor = Executor(self.store)
        return self._executor

    def import_program(self, program):
        from importer_svc.importer import import_program

        r = import_program(self.store, program)
        return r.graph, r.manifest

    def import_exported(self, ep):
        from importer_svc.importer import import_exported

        r = import_exported(self.store, ep)
        return r.graph, r.manifest

    def optimize(self, graph, options):
        from optimizer_svc.optimizer import optimize

        return optimize(self.store, graph, options)

    def emit(self, kernel_graph, target, block, tile):
        from codegen_svc.codegen import emit

        # a span per emit, as the service's own (codegen.Emit) is remotely: codegen names the
        # bundle on it, so a compile's span names only the bundle it chose
        with span("codegen.Emit", **{"kiln.kernel_graph": str(kernel_graph), "kiln.target": target}):
            return emit(self.store, kernel_graph, target, None, block, tile)

    def load(self, bundle, manifest):
        return self.executor.load(bundle, manifest)

    def run(self, session, inputs):
        return self.executor.run(session, inputs)

    def generate(self, model, prompt_ids, max_new_tokens, sampling, stop_sequences, ignore_eos):
        batcher = self.executor.batcher(model)
        seq = batcher.submit(list(prompt_ids), max_new_tokens, sampling, tuple(tuple(s) for s in stop_sequences),
                             ignore_eos)
        try:
            for token, _, reason, logprob, top in seq.stream():
                yield Token(token, reason, logprob, top)
        finally:
            batcher.cancel(seq)

    def calibrate(self, target, force):
        from executor_svc.calibrate import calibrate

        d, p, _ = calibrate(self.store, target, force)
        return d, p

    def known_profile(self, target):
        from executor_svc.calibrate import known_profile

        known = known_profile(self.store, target)
        return known[0] if known is not None else None

    def profile(self, bundles, manifest, repeats, symbols):
        return self.executor.profile(bundles, manifest, repeats, symbols)


class RemoteStages:
    """The stages as calls to their services at `addresses` (stage -> address), each with the
    timeout as its deadline."""

    def __init__(self, store: BlobStore, addresses: Mapping[str, str], timeout: Optional[float]):
        self.store = store
        self.addresses = dict(addresses)
        self.timeout = timeout
        self._stubs: dict = {}

    def _stub(self, stage: str):
        if stage not in self._stubs:
            from kiln.v1 import services_pb2_grpc

            cls = {"importer": services_pb2_grpc.ImporterStub, "optimizer": services_pb2_grpc.OptimizerStub,
                   "codegen": services_pb2_grpc.CodegenStub, "executor": services_pb2_grpc.ExecutorStub}[stage]
            ch = channel(self.addresses[stage])
            wait_ready(ch, self._named(stage))  # the first use: a wrong address fails in seconds
            self._stubs[stage] = cls(ch)
        return self._stubs[stage]

    def _named(self, stage: str) -> str:
        return f"the {stage} at {self.addresses[stage]}"

    def _sent(self, stage: str, digests, fn):
        """fn(), where the request names blobs this client put in its store: a NOT_FOUND for one
        of them that the client's store holds says the client and the service use different stores."""
        try:
            return fn()
        except NotFound as e:
            mine = [d for d in digests if self.store.exists(d)]
            if mine:
                url = getattr(self.store, "url", "")
                raise NotFound(f"{e}; this client's store {url} holds {mine[0]}: the client and "
                               f"{self._named(stage)} use different stores (point KILN_STORE at the services' "
                               "store)") from None
            raise

    def import_program(self, program):
        r = self._sent("importer", [program], lambda: call(
            self._stub("importer").Import, services_pb2.ImportRequest(program=program.to_pb()), self.timeout))
        graph = Digest.from_pb(r.graph)
        if not self.store.exists(graph):  # the services' store had the program already: the client's lacks their results
            raise NotFound(f"{self._named('importer')} wrote graph {graph} to its store, which this client's store "
                           f"{getattr(self.store, 'url', '')} does not hold: the client and the services use "
                           "different stores (point KILN_STORE at the services' store)")
        return graph, Digest.from_pb(r.manifest)

    def optimize(self, graph, options):
        req = services_pb2.OptimizeRequest(graph=graph.to_pb(), search=options.search,
                                           max_iterations=options.max_iterations, max_enodes=options.max_enodes,
                                           time_budget_s=options.time_budget_s, candidates=options.candidates)
        if options.target_profile is not None:
            req.target_profile.CopyFrom(options.target_profile.to_pb())
        r = call(self._stub("optimizer").Optimize, req, self.timeout)
        return Digest.from_pb(r.kernel_graph), r.report

    def emit(self, kernel_graph, target, block, tile):
        req = services_pb2.EmitRequest(kernel_graph=kernel_graph.to_pb(), target=target, block=block, tile=tile)
        r = call(self._stub("codegen").Emit, req, self.timeout)
        return Digest.from_pb(r.bundle), r.kernels, r.peak_bytes

    def load(self, bundle, manifest):
        req = services_pb2.LoadRequest(bundle=bundle.to_pb(), manifest=manifest.to_pb())
        return self._sent("executor", [bundle, manifest],
                          lambda: call(self._stub("executor").Load, req, self.timeout)).session

    def run(self, session, inputs):
        req = services_pb2.RunRequest(session=session, inputs=[array_to_pb(n, a, self.store) for n, a in inputs])
        r = call(self._stub("executor").Run, req, self.timeout)
        return [(t.name, array_from_pb(t, self.store)) for t in r.outputs]

    def generate(self, model, prompt_ids, max_new_tokens, sampling, stop_sequences, ignore_eos):
        req = services_pb2.GenerateRequest(
            model=model.to_pb(), prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed,
            ignore_eos=ignore_eos, stop_sequences=[services_pb2.TokenIds(ids=list(s)) for s in stop_sequences],
            logprobs=sampling.logprobs if sampling.logprobs >= 0 else None)
        return _stream(self._stub("executor").Generate, req, self.timeout)

    def calibrate(self, target, force):
        r = call(self._stub("executor").Calibrate, services_pb2.CalibrateRequest(target=target, force=force),
                 self.timeout)
        return Digest.from_pb(r.profile), r.target_profile

    def known_profile(self, target):
        r = call(self._stub("executor").Calibrate, services_pb2.CalibrateRequest(target=target, lookup_only=True),
                 self.timeout)
        return Digest.from_pb(r.profile) if r.HasField("profile") else None

    def profile(self, bundles, manifest, repeats, symbols):
        req = services_pb2.ProfileRequest(bundles=[b.to_pb() for b in bundles], manifest=manifest.to_pb(),
                                          repeats=repeats, symbols=symbols or {})
        r = call(self._stub("executor").Profile, req, self.timeout)
        return [(Digest.from_pb(t.bundle), t.median_s, t.min_s, t.relative, t.others_busy) for t in r.timings]


def _stream(method, request, timeout: Optional[float]):
    """A server stream; a failure before its first message is retried like a unary call."""
    import grpc

    def first(remaining):
        c = method(request, timeout=remaining)
        it = iter(c)
        try:
            return c, it, next(it)
        except StopIteration:
            return c, it, None
        except BaseException:
            (c.cancel if hasattr(c, "cancel") else c.close)()
            raise

    c, it, head = retrying(first, timeout)
    try:
        if head is None:
            return
        for r in itertools.chain((head,), it):
            yield Token(r.token_id, r.finish_reason, r.logprob if r.HasField("logprob") else None,
                        [(t.token_id, t.logprob) for t in r.top_logprobs])
    except grpc.RpcError as e:
        raise kiln_error(e) from None
    finally:  # a caller that stops early frees the sequence on the executor: the call is cancelled
        # (the tracing interceptor hands back a generator over it; closing that drops the last
        # reference to the call, which cancels it)
        (c.cancel if hasattr(c, "cancel") else c.close)()
