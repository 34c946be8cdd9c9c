"""Optimizer stage: Graph digest -> KernelGraph digest and a search report."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from kiln import cache
from kiln.digest import Digest
from kiln.errors import InvalidArgument, ResourceExhausted
from kiln.ir.kernel import kernel_graph_to_pb
from kiln.ir.serialize import graph_from_pb
from kiln.store import BlobStore
from kiln.telemetry import span
from kiln.v1 import ir_pb2, services_pb2
from optimizer_svc.partition import partition
from optimizer_svc.search import SearchLimits, SearchReport, graph_cost, saturate

STAGE_VERSION = "optimizer-1-" + cache.code_version("optimizer_svc", "kiln.ir")
MAX_ITERATIONS_CAP = 1000
MAX_ENODES_CAP = 5_000_000


@dataclass(frozen=True)
class OptimizeOptions:
    max_iterations: int = 16
    max_enodes: int = 200_000
    time_budget_s: float = 30.0
    search: bool = True

    def canonical(self) -> dict:
        return {"max_iterations": self.max_iterations, "max_enodes": self.max_enodes,
                "time_budget_s": self.time_budget_s, "search": self.search}


def check_options(o: OptimizeOptions) -> None:
    if o.max_iterations < 0 or o.max_enodes < 0 or o.time_budget_s < 0:
        raise InvalidArgument("search bounds must be non-negative")
    if o.max_iterations > MAX_ITERATIONS_CAP or o.max_enodes > MAX_ENODES_CAP:
        raise ResourceExhausted(f"search bounds over the server's caps (iterations <= {MAX_ITERATIONS_CAP}, "
                                f"e-nodes <= {MAX_ENODES_CAP})")


def optimize(store: BlobStore, graph_d: Digest, options: OptimizeOptions,
             deadline: Optional[float] = None) -> tuple[Digest, services_pb2.OptimizeReport]:
    check_options(options)
    key = cache.action_key("optimize", STAGE_VERSION, {"graph": graph_d}, options.canonical())
    hit = cache.lookup(store, key)
    if hit is not None:
        return hit["kernel_graph"], store.get_message(hit["report"], services_pb2.OptimizeReport)
    t0 = time.monotonic()
    try:
        graph = graph_from_pb(store.get_message(graph_d, ir_pb2.Graph))
    except ValueError as e:
        raise InvalidArgument(f"graph {graph_d} is malformed: {e}") from e
    with span("optimizer.search", **{"kiln.graph": str(graph_d), "kiln.search": options.search}) as s:
        if options.search:
            limits = SearchLimits(options.max_iterations, options.max_enodes, options.time_budget_s, deadline)
            optimized, rep = saturate(graph, limits)
        else:
            optimized, rep = graph, SearchReport(stop_reason="search off")
        kg = partition(optimized, fuse=options.search)
        s.set_attribute("kiln.stop_reason", rep.stop_reason)
        s.set_attribute("kiln.cost_before", graph_cost(graph))
        s.set_attribute("kiln.cost_after", graph_cost(optimized))
        s.set_attribute("kiln.kernels", len(kg.kernels))
    kg_d = store.put_message(kernel_graph_to_pb(kg, graph_d))
    report = services_pb2.OptimizeReport(stop_reason=rep.stop_reason, nodes_before=len(graph.nodes),
                                         nodes_after=len(optimized.nodes), kernels=len(kg.kernels),
                                         seconds=time.monotonic() - t0, cost_before=graph_cost(graph),
                                         cost_after=graph_cost(optimized))
    for it in rep.iterations:
        report.iterations.add(iteration=it.iteration, enodes=it.enodes, eclasses=it.eclasses,
                              rules_fired=it.rules_fired)
    for rule, n in sorted(rep.rules.items()):
        report.rules.add(rule=rule, matches=n)
    for family, n in sorted(rep.rulesets.items()):
        report.rulesets.add(rule=family, matches=n)
    # a run cut short by the caller's deadline is not a reusable result
    if rep.stop_reason != "deadline":
        cache.record(store, key, {"kernel_graph": kg_d, "report": store.put_message(report)})
    return kg_d, report
