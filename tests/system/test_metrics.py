"""Prometheus /metrics from `kiln serve`: per-RPC requests and latency, action-cache hit ratio,
e-graph sizes, read over HTTP from a server process of its own (so every count is this test's)."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import kiln
from kiln.apps.examples import mlp_example
from kiln.v1 import services_pb2, services_pb2_grpc


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, kiln_serve_module):
    d = tmp_path_factory.mktemp("metrics")
    process = kiln_serve_module("all", "--port", "0", "--metrics-port", "0",
                                env={"KILN_STORE": f"file://{d / 'store'}", "KILN_CANDIDATES": "1"})
    metrics = process.readline()
    assert "/metrics" in metrics, process.first_line + metrics
    return process.addr, metrics.split(" metrics on ")[1].strip(), f"file://{d / 'store'}"


def test_rpc_counts_latency_cache_ratio_and_egraph_sizes(server):
    addr, url, store = server
    pipeline = kiln.Pipeline(store, {s: addr for s in ("importer", "optimizer", "codegen", "executor")})
    model, inputs = mlp_example(seed=21)
    compiled = kiln.compile(model, inputs, pipeline=pipeline)
    for _ in range(3):
        out = compiled(*inputs)
    with torch.no_grad():
        np.testing.assert_allclose(out.numpy(), model(*inputs).numpy(), rtol=1e-5, atol=1e-5)
    with grpc.insecure_channel(addr) as ch:  # two calls that fail, with their codes
        stub = services_pb2_grpc.ExecutorStub(ch)
        for _ in range(2):
            with pytest.raises(grpc.RpcError):
                stub.Run(services_pb2.RunRequest(session="0" * 64), timeout=10)
    m = scrape(url)
    executor, importer = "kiln.v1.Executor", "kiln.v1.Importer"
    assert value(m, "kiln_rpc_requests_total", service=importer, method="Import", code="OK") == 1
    assert value(m, "kiln_rpc_requests_total", service="kiln.v1.Optimizer", method="Optimize", code="OK") == 1
    assert value(m, "kiln_rpc_requests_total", service=executor, method="Run", code="OK") == 3
    assert value(m, "kiln_rpc_requests_total", service=executor, method="Run", code="NOT_FOUND") == 2
    assert value(m, "kiln_rpc_latency_seconds_count", service=executor, method="Run") == 5
    assert value(m, "kiln_rpc_latency_seconds_sum", service=importer, method="Import") > 0
    assert value(m, "kiln_rpc_in_flight", service=executor, method="Run") == 0
    assert value(m, "kiln_action_cache_lookups_total", stage="import", result="miss") == 1
    assert value(m, "kiln_action_cache_hit_ratio", stage="import") == 0
    iterations = value(m, "kiln_egraph_enodes_count")
    assert iterations == len(compiled.result.report.iterations) > 0
    assert value(m, "kiln_egraph_eclasses_count") == iterations
    assert value(m, "kiln_egraph_enodes_sum") == sum(i.enodes for i in compiled.result.report.iterations)

    # the same model again: its export and import are found under its export key (kiln.exportkey),
    # so Import is not called at all, and every stage after it hits its cache
    kiln.compile(model, inputs, pipeline=pipeline)
    m = scrape(url)
    assert value(m, "kiln_action_cache_lookups_total", stage="import", result="miss") == 1
    assert value(m, "kiln_action_cache_lookups_total", stage="import", result="hit") == 0
    assert value(m, "kiln_egraph_enodes_count") == iterations  # no new search
    # an archive imported twice: the second import is the cache's
    program = pipeline.upload_program(torch.export.export(model, inputs))
    for _ in range(2):
        pipeline.import_program(program)
    m = scrape(url)
    hits = value(m, "kiln_action_cache_lookups_total", stage="import", result="hit")
    misses = value(m, "kiln_action_cache_lookups_total", stage="import", result="miss")
    assert hits >= 1 and hits + misses == 3
    assert value(m, "kiln_action_cache_hit_ratio", stage="import") == pytest.approx(hits / 3)
