"""Executor gRPC servicer: decode, call the Executor, encode."""

from kiln.cas.digest import Digest
from kiln.rpc.server import rpc, rpc_stream
from kiln.core.telemetry import span
from kiln.rpc.tensors import array_from_pb, array_to_pb
from kiln.v1 import services_pb2, services_pb2_grpc
from executor_svc.calibrate import calibrate, known_profile
from executor_svc.executor import Executor
from executor_svc.generate import Sampling


class ExecutorServicer(services_pb2_grpc.ExecutorServicer):
    SERVICE_NAME = "kiln.v1.Executor"

    def __init__(self, store):
        self.store = store
        self.executor = Executor(store)

    def add_to_server(self, server):
        services_pb2_grpc.add_ExecutorServicer_to_server(self, server)

    @rpc
    def Load(self, request, context):
        with span("executor.Load"):
            sid = self.executor.load(Digest.from_pb(request.bundle), Digest.from_pb(request.manifest))
        return services_pb2.LoadResponse(session=sid)

    @rpc
    def Run(self, request, context):
        with span("executor.Run"):
            inputs = [(t.name, array_from_pb(t, self.store)) for t in request.inputs]
            outs = self.executor.run(request.session, inputs)
        return services_pb2.RunResponse(outputs=[array_to_pb(n, a, self.store) for n, a in outs])

    @rpc
    def Calibrate(self, request, context):
        if request.lookup_only:
            known = known_profile(self.store, request.target or "cpu")
            if known is None:
                return services_pb2.CalibrateResponse()
            return services_pb2.CalibrateResponse(profile=known[0].to_pb(), target_profile=known[1], cached=True)
        d, profile, cached = calibrate(self.store, request.target or "cpu", request.force)
        return services_pb2.CalibrateResponse(profile=d.to_pb(), target_profile=profile, cached=cached)

    @rpc
    def Profile(self, request, context):
        bundles = [Digest.from_pb(b) for b in request.bundles]
        timings = self.executor.profile(bundles, Digest.from_pb(request.manifest), request.repeats or 20,
                                        dict(request.symbols))
        return services_pb2.ProfileResponse(timings=[
            services_pb2.BundleTiming(bundle=b.to_pb(), median_s=med, min_s=lo, repeats=request.repeats or 20,
                                      relative=rel, others_busy=others)
            for b, med, lo, rel, others in timings])

    @rpc_stream
    def Generate(self, request, context):
        batcher = self.executor.batcher(Digest.from_pb(request.model))
        sampling = Sampling(request.temperature, request.top_k, request.top_p, request.seed,
                            request.logprobs if request.HasField("logprobs") else -1)
        seq = batcher.submit(list(request.prompt_ids), request.max_new_tokens, sampling,
                             tuple(tuple(s.ids) for s in request.stop_sequences), request.ignore_eos)
        # a client that cancels or disconnects frees the sequence at once
        context.add_callback(lambda: batcher.cancel(seq))
        try:
            for token, index, reason, logprob, top in seq.stream():
                r = services_pb2.GenerateResponse(token_id=token, index=index, finish_reason=reason, top_logprobs=[
                    services_pb2.TokenLogprob(token_id=t, logprob=lp) for t, lp in top])
                if logprob is not None:
                    r.logprob = logprob
                yield r
        finally:
            batcher.cancel(seq)
