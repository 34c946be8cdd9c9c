"""Codegen gRPC servicer: decode, call codegen.emit, encode."""

from kiln.cas.digest import Digest
from kiln.rpc.server import deadline_of, rpc
from kiln.core.telemetry import span
from kiln.v1 import services_pb2, services_pb2_grpc
from codegen_svc.codegen import emit


class CodegenServicer(services_pb2_grpc.CodegenServicer):
    SERVICE_NAME = "kiln.v1.Codegen"

    def __init__(self, store):
        self.store = store

    def add_to_server(self, server):
        services_pb2_grpc.add_CodegenServicer_to_server(self, server)

    @rpc
    def Emit(self, request, context):
        with span("codegen.Emit"):
            d, n, peak = emit(self.store, Digest.from_pb(request.kernel_graph), request.target, deadline_of(context),
                              request.block, request.tile)
        return services_pb2.EmitResponse(bundle=d.to_pb(), kernels=n, peak_bytes=peak)
