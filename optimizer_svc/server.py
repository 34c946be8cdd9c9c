"""Optimizer gRPC servicer: decode, call optimizer.optimize, encode."""

from kiln.digest import Digest
from kiln.service import deadline_of, rpc
from kiln.telemetry import span
from kiln.v1 import services_pb2, services_pb2_grpc
from optimizer_svc.optimizer import OptimizeOptions, optimize


def options_from_request(r: services_pb2.OptimizeRequest) -> OptimizeOptions:
    d = OptimizeOptions()
    return OptimizeOptions(max_iterations=r.max_iterations or d.max_iterations,
                           max_enodes=r.max_enodes or d.max_enodes,
                           time_budget_s=r.time_budget_s or d.time_budget_s, search=r.search,
                           candidates=r.candidates or d.candidates,
                           target_profile=Digest.from_pb(r.target_profile) if r.HasField("target_profile") else None)


class OptimizerServicer(services_pb2_grpc.OptimizerServicer):
    SERVICE_NAME = "kiln.v1.Optimizer"

    def __init__(self, store):
        self.store = store

    def add_to_server(self, server):
        services_pb2_grpc.add_OptimizerServicer_to_server(self, server)

    @rpc
    def Optimize(self, request, context):
        with span("optimizer.Optimize"):
            kg, report = optimize(self.store, Digest.from_pb(request.graph), options_from_request(request),
                                  deadline_of(context))
        return services_pb2.OptimizeResponse(kernel_graph=kg.to_pb(), report=report)
