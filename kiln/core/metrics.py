"""Prometheus metrics for every service, served at /metrics by `kiln serve --metrics-port`.

Per RPC: requests by status code and a latency histogram (a server interceptor). Per stage: the
action cache's hits and misses and their ratio. Optimizer: e-graph sizes per saturation
iteration. Executor: Run calls in flight, generation queue depth and decode batch sizes.
"""

from __future__ import annotations

import threading

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


def serve_metrics(port: int, host: str = "127.0.0.1", registry: CollectorRegistry = REGISTRY) -> int:
    """Serve /metrics over HTTP on a daemon thread; returns the bound port (0 picks a free one)."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
