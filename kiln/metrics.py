"""Prometheus metrics for every service, served at /metrics by `kiln serve --metrics-port`.

Per RPC: requests by status code and a latency histogram (a server interceptor). Per stage: the
action cache's hits and misses and their ratio. Optimizer: e-graph sizes per saturation
iteration. Executor: Run calls in flight, generation queue depth and decode batch sizes.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RPC_REQUESTS = Counter("kiln_rpc_requests", "RPCs handled, by service, method and status code",
                       ["service", "method", "code"])
RPC_LATENCY = Histogram("kiln_rpc_latency_seconds", "RPC handling time, by service and method",
                        ["service", "method"],
                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                 30, 60, 120))
RPC_IN_FLIGHT = Gauge("kiln_rpc_in_flight", "RPCs being handled now, by service and method", ["service", "method"])
CACHE_LOOKUPS = Counter("kiln_action_cache_lookups", "action-cache lookups, by stage and result (hit or miss)",
                        ["stage", "result"])
CACHE_HIT_RATIO = Gauge("kiln_action_cache_hit_ratio", "hits over lookups since start, by stage", ["stage"])
EGRAPH_ENODES = Histogram("kiln_egraph_enodes", "e-graph e-nodes after each saturation iteration",
                          buckets=(100, 300, 1000, 3000, 10_000, 30_000, 100_000, 300_000, 1_000_000))
EGRAPH_ECLASSES = Histogram("kiln_egraph_eclasses", "e-graph e-classes after each saturation iteration",
                            buckets=(100, 300, 1000, 3000, 10_000, 30_000, 100_000, 300_000, 1_000_000))
EXECUTOR_QUEUE = Gauge("kiln_executor_queue_depth", "generation requests waiting to join the batch")
EXECUTOR_ACTIVE = Gauge("kiln_executor_active_sequences", "sequences being generated")
EXECUTOR_BATCH = Histogram("kiln_executor_batch_size", "sequences computed together per decode step",
                           buckets=(1, 2, 4, 8, 16, 32, 64, 128))

_cache_lock = threading.Lock()
_cache_counts: dict[str, list[int]] = {}


def count_cache_lookup(stage: str, hit: bool) -> None:
    CACHE_LOOKUPS.labels(stage, "hit" if hit else "miss").inc()
    with _cache_lock:
        c = _cache_counts.setdefault(stage, [0, 0])
        c[0] += hit
        c[1] += 1
        CACHE_HIT_RATIO.labels(stage).set(c[0] / c[1])


def _split_method(full: str) -> tuple[str, str]:
    """'/kiln.v1.Executor/Run' -> ('kiln.v1.Executor', 'Run')."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service or "unknown", method or full


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every RPC the server handles (unary and server-streaming), with its final code."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            service, method = _split_method(handler_call_details.method)
            RPC_REQUESTS.labels(service, method, "UNIMPLEMENTED").inc()
            return None
        service, method = _split_method(handler_call_details.method)

        def finish(context, t0: float, error: Optional[BaseException]) -> None:
            code = context.code() if hasattr(context, "code") else None
            if code is None:
                code = grpc.StatusCode.UNKNOWN if error is not None else grpc.StatusCode.OK
            name = code.name if isinstance(code, grpc.StatusCode) else str(code)
            RPC_REQUESTS.labels(service, method, name).inc()
            RPC_LATENCY.labels(service, method).observe(time.perf_counter() - t0)
            RPC_IN_FLIGHT.labels(service, method).dec()

        if handler.unary_unary is not None:
            inner = handler.unary_unary

            def unary(request, context):
                t0, error = time.perf_counter(), None
                RPC_IN_FLIGHT.labels(service, method).inc()
                try:
                    return inner(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    finish(context, t0, error)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_stream = handler.unary_stream

            def stream(request, context):
                t0, error = time.perf_counter(), None
                RPC_IN_FLIGHT.labels(service, method).inc()
                try:
                    yield from inner_stream(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    finish(context, t0, error)

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler  # client- and bidi-streaming: kiln has none


def serve_metrics(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> int:
    """Serve /metrics over HTTP on a daemon thread; returns the bound port (0 picks a free one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
