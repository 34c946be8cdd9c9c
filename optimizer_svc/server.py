"""Optimizer gRPC servicer: decode, call optimizer.optimize, encode; and the fan-out client
that sends a graph's distinct regions to the peer optimizers named by KILN_OPTIMIZER_PEERS."""

import os
import time
from typing import Optional

from kiln.rpc import client
from kiln.cas.digest import Digest
from kiln.ir.serialize import graph_from_pb, graph_to_pb
from kiln.rpc.server import deadline_of, rpc
from kiln.core.telemetry import span
from kiln.v1 import ir_pb2, services_pb2, services_pb2_grpc
from optimizer_svc.optimizer import (OptimizeOptions, PeerSaturate, check_bounds, optimize, saturate_region,
                                     search_report_from_pb, search_report_to_pb)
from optimizer_svc.cost import Pool
from optimizer_svc.saturate import SearchLimits


def options_from_request(r: services_pb2.OptimizeRequest) -> OptimizeOptions:
    return OptimizeOptions.given(r.search, r.max_iterations, r.max_enodes, r.time_budget_s, r.candidates,
                                 Digest.from_pb(r.target_profile) if r.HasField("target_profile") else None)


def peer_client(stub: services_pb2_grpc.OptimizerStub, target_profile: Optional[Digest]) -> PeerSaturate:
    """SaturateRegion on the peers behind `stub` (a replica list or a DNS name, round-robin,
    UNAVAILABLE retried inside the deadline)."""

    def saturate_on_peer(region: Digest, limits: SearchLimits):
        req = services_pb2.SaturateRegionRequest(region=region.to_pb(), max_iterations=limits.max_iterations,
                                                 max_enodes=limits.max_enodes,
                                                 time_budget_s=max(limits.time_budget_s, 1e-3))
        if target_profile is not None:
            req.target_profile.CopyFrom(target_profile.to_pb())
        timeout = None if limits.deadline is None else max(0.01, limits.deadline - time.monotonic())
        r = client.call(stub.SaturateRegion, req, timeout)
        return Digest.from_pb(r.graph), search_report_from_pb(r.report), r.cached

    return saturate_on_peer


class OptimizerServicer(services_pb2_grpc.OptimizerServicer):
    SERVICE_NAME = "kiln.v1.Optimizer"

    def __init__(self, store, peers: Optional[str] = None):
        self.store = store
        self.peers = peers if peers is not None else os.environ.get("KILN_OPTIMIZER_PEERS", "")
        # one channel to the peers for the server's life
        self._peer_stub = services_pb2_grpc.OptimizerStub(client.channel(self.peers)) if self.peers else None

    def add_to_server(self, server):
        services_pb2_grpc.add_OptimizerServicer_to_server(self, server)

    @rpc
    def Optimize(self, request, context):
        options = options_from_request(request)
        peer = peer_client(self._peer_stub, options.target_profile) if self._peer_stub and options.search else None
        with span("optimizer.Optimize", **{"kiln.peers": self.peers}):
            kg, report = optimize(self.store, Digest.from_pb(request.graph), options, deadline_of(context), peer)
        return services_pb2.OptimizeResponse(kernel_graph=kg.to_pb(), report=report)

    @rpc
    def SaturateRegion(self, request, context):
        region_d = Digest.from_pb(request.region)
        try:
            region = graph_from_pb(self.store.get_message(region_d, ir_pb2.Graph))
        except ValueError as e:
            raise ValueError(f"region {region_d} is malformed: {e}") from e
        profile = (self.store.get_message(Digest.from_pb(request.target_profile), services_pb2.TargetProfile)
                   if request.HasField("target_profile") else None)
        d = OptimizeOptions()
        check_bounds(request.max_iterations, request.max_enodes, request.time_budget_s)
        limits = SearchLimits(request.max_iterations or d.max_iterations, request.max_enodes or d.max_enodes,
                              request.time_budget_s or d.time_budget_s, deadline_of(context),
                              Pool.from_profile(profile))
        with span("optimizer.SaturateRegion", **{"kiln.structure": str(region_d)}):
            out, rep, cached = saturate_region(self.store, region_d, region, limits)
        report = services_pb2.OptimizeReport(stop_reason=rep.stop_reason, seconds=rep.seconds)
        search_report_to_pb(rep, report)
        return services_pb2.SaturateRegionResponse(graph=self.store.put_message(graph_to_pb(out)).to_pb(),
                                                   report=report, cached=cached)
