"""Prometheus metrics for every service, served at /metrics by `kiln serve --metrics-port`.

Per RPC: requests by status code and a latency histogram (a server interceptor). Per stage: the
action cache's hits and misses and their ratio. Optimizer: e-graph sizes per saturation
iteration. Executor: Run calls in flight, generation queue depth and decode batch sizes.

Generation, under the names dashboards made for vLLM read (vLLM's `vllm:` prefix is `kiln:`
here), each with a `model_name` label: time to first token, inter-token latency, end-to-end
request latency and queue time (histograms); requests running and waiting and the KV cache's
use (gauges); prompt and generation tokens, and finished requests by `finished_reason`
(counters). The KV cache's use is the tokens the running sequences hold over what the model's
sequences may hold at most (max sequences x max context).
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

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
            40.0, 80.0)
TIME_TO_FIRST_TOKEN = Histogram("kiln:time_to_first_token_seconds", "from a request's arrival to its first token",
                                ["model_name"], buckets=_LATENCY)
INTER_TOKEN_LATENCY = Histogram("kiln:inter_token_latency_seconds", "between a sequence's consecutive tokens",
                                ["model_name"], buckets=_LATENCY)
E2E_REQUEST_LATENCY = Histogram("kiln:e2e_request_latency_seconds", "from a request's arrival to its last token",
                                ["model_name"], buckets=_LATENCY)
REQUEST_QUEUE_TIME = Histogram("kiln:request_queue_time_seconds", "from a request's arrival to its prefill",
                               ["model_name"], buckets=_LATENCY)
REQUESTS_RUNNING = Gauge("kiln:num_requests_running", "sequences being generated", ["model_name"])
REQUESTS_WAITING = Gauge("kiln:num_requests_waiting", "requests waiting for their prefill", ["model_name"])
KV_CACHE_USAGE = Gauge("kiln:kv_cache_usage_perc", "tokens the running sequences' caches hold, over what the "
                       "model's sequences may hold at most (1 = full)", ["model_name"])
PROMPT_TOKENS = Counter("kiln:prompt_tokens", "prompt tokens prefilled", ["model_name"])
GENERATION_TOKENS = Counter("kiln:generation_tokens", "tokens generated", ["model_name"])
REQUEST_SUCCESS = Counter("kiln:request_success", "requests finished, by finish reason (length, eos, stop)",
                          ["model_name", "finished_reason"])

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
