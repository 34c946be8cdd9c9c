"""Importer gRPC servicer: decode, call importer.import_program, encode."""

from kiln.cas.digest import Digest
from kiln.rpc.server import deadline_of, rpc
from kiln.core.telemetry import span
from kiln.v1 import services_pb2, services_pb2_grpc
from importer_svc.importer import import_program


class ImporterServicer(services_pb2_grpc.ImporterServicer):
    SERVICE_NAME = "kiln.v1.Importer"

    def __init__(self, store):
        self.store = store

    def add_to_server(self, server):
        services_pb2_grpc.add_ImporterServicer_to_server(self, server)

    @rpc
    def Import(self, request, context):
        with span("importer.Import"):
            r = import_program(self.store, Digest.from_pb(request.program), deadline_of(context))
        return services_pb2.ImportResponse(graph=r.graph.to_pb(), manifest=r.manifest.to_pb(),
                                           node_count=r.node_count)
