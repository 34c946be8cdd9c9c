"""Optimizer stage: Graph digest -> KernelGraph digest and a search report."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Callable, Optional

from opentelemetry import context as otel_context

from kiln.cas import cache
from kiln.cas.digest import Digest, digest_message
from kiln.core.errors import DeadlineExceeded, InvalidArgument, KilnError, ResourceExhausted
from kiln.ir.kernel import KernelGraph
from kiln.ir.serialize import kernel_graph_to_pb
from kiln.ir.graph import Graph
from kiln.ir.serialize import graph_from_pb, graph_to_pb
from kiln.cas.store import BlobStore
from kiln.core import progress as live
from kiln.core.telemetry import current_span, span
from kiln.v1 import ir_pb2, services_pb2
from optimizer_svc.cost import predict
from optimizer_svc.fold import hoist
from optimizer_svc.partition import (DEFAULT_SCHEDULE, SCHEDULE_GRID, Schedule, partition, schedule_choices,
                                     with_choices)
from optimizer_svc.regions import RegionCycle, assemble, canonical, split
from optimizer_svc.cost import Pool, graph_cost
from optimizer_svc.saturate import IterationStat, SearchLimits, SearchReport, saturate

log = logging.getLogger("kiln.optimizer")

STAGE_VERSION = "optimizer-1-" + cache.code_version("optimizer_svc", "kiln.ir")
MAX_ITERATIONS_CAP = 1000
MAX_ENODES_CAP = 5_000_000  # default of KILN_MAX_ENODES
MAX_CANDIDATES = len(SCHEDULE_GRID)


@dataclass(frozen=True)
class OptimizeOptions:
    max_iterations: int = 16
    max_enodes: int = 200_000
    time_budget_s: float = 30.0
    search: bool = True
    target_profile: Optional[Digest] = None  # Executor.Calibrate's TargetProfile: predict run time
    candidates: int = 8  # schedule candidates returned for timing, best predicted first

    @classmethod
    def given(cls, search: bool, max_iterations: int = 0, max_enodes: int = 0, time_budget_s: float = 0.0,
              candidates: int = 0, target_profile: Optional[Digest] = None) -> "OptimizeOptions":
        """Options as a caller gives them: 0 for a bound or the candidates means the default."""
        d = cls()
        return cls(max_iterations=max_iterations or d.max_iterations, max_enodes=max_enodes or d.max_enodes,
                   time_budget_s=time_budget_s or d.time_budget_s, search=search,
                   target_profile=target_profile, candidates=candidates or d.candidates)

    def canonical(self) -> dict:
        return {"max_iterations": self.max_iterations, "max_enodes": self.max_enodes,
                "time_budget_s": self.time_budget_s, "search": self.search,
                "target_profile": str(self.target_profile) if self.target_profile else "",
                "candidates": self.candidates}


def check_bounds(max_iterations: int, max_enodes: int, time_budget_s: float) -> None:
    """A request's search bounds against this server's caps (KILN_MAX_ENODES)."""
    if max_iterations < 0 or max_enodes < 0 or not time_budget_s >= 0:
        raise InvalidArgument("search bounds must be non-negative")
    enodes_cap = int(os.environ.get("KILN_MAX_ENODES", "") or MAX_ENODES_CAP)
    if max_iterations > MAX_ITERATIONS_CAP or max_enodes > enodes_cap:
        raise ResourceExhausted(f"search bounds over the server's caps (iterations <= {MAX_ITERATIONS_CAP}, "
                                f"e-nodes <= {enodes_cap}, KILN_MAX_ENODES)")


def check_options(o: OptimizeOptions) -> None:
    check_bounds(o.max_iterations, o.max_enodes, o.time_budget_s)
    if not 1 <= o.candidates <= MAX_CANDIDATES:
        raise InvalidArgument(f"candidates must be in 1..{MAX_CANDIDATES}, got {o.candidates}")


@dataclass
class RegionStats:
    regions: int = 0
    distinct: int = 0
    cache_hits: int = 0  # distinct structures whose saturation the action cache already held


_STOP_ORDER = ("saturated", "iteration limit", "e-node limit", "time budget", "deadline")


def _bounds(limits: SearchLimits) -> dict:
    return {"max_iterations": limits.max_iterations, "max_enodes": limits.max_enodes,
            "pool": limits.pool.canonical() if limits.pool is not None else None}


def saturate_region(store: BlobStore, d: Digest, region: Graph, limits: SearchLimits
                    ) -> tuple[Graph, SearchReport, bool]:
    """One distinct region structure, saturated once by whichever replica gets there first
    (the others wait for it through the action cache); returns (graph, report, cached)."""
    key = cache.action_key("saturate-region", STAGE_VERSION, {"region": d}, _bounds(limits))
    with cache.flight(store, key, limits.deadline) as hit:
        if hit is not None:
            cached = graph_from_pb(store.get_message(hit["graph"], ir_pb2.Graph))
            return cached, SearchReport(stop_reason="saturated"), True
        with span("optimizer.region", **{"kiln.structure": str(d)}):
            opt, rep = saturate(region, limits)
        if rep.stop_reason == "saturated":  # a bounded result is not the structure's answer
            cache.record(store, key, {"graph": store.put_message(graph_to_pb(opt))})
        return opt, rep, False


# A peer optimizer's SaturateRegion (optimizer_svc/server.py builds it from KILN_OPTIMIZER_PEERS):
# (region digest, limits) -> (saturated region digest, report, cached)
PeerSaturate = Callable[[Digest, SearchLimits], tuple[Digest, SearchReport, bool]]


def saturate_regions(store: BlobStore, graph: Graph, limits: SearchLimits, peer: Optional[PeerSaturate] = None
                     ) -> tuple[Graph, SearchReport, RegionStats]:
    """Saturate each distinct region structure once (regions.py), from the action cache when an
    earlier compile or another replica already did. With peers, the distinct regions are sent
    to peer optimizers in parallel (fan-out; a failed peer's region is saturated here);
    without, they are saturated here one after another, sharing the time budget."""
    regions = split(graph)
    canon = {r.name: canonical(graph, r) for r in regions}
    digests = {name: digest_message(graph_to_pb(cg)) for name, cg in canon.items()}
    distinct: dict[Digest, Graph] = {}  # each structure's first region, in graph order
    for name, d in digests.items():
        distinct.setdefault(d, canon[name])
    stats = RegionStats(regions=len(regions), distinct=len(distinct))
    report = SearchReport(stop_reason="saturated")
    t0 = time.monotonic()

    def left() -> SearchLimits:
        return SearchLimits(limits.max_iterations, limits.max_enodes,
                            max(0.0, limits.time_budget_s - (time.monotonic() - t0)), limits.deadline, limits.pool)

    def remote(d: Digest, region: Graph) -> tuple[Graph, SearchReport, bool]:
        store.put_message(graph_to_pb(region))
        try:
            out_d, rep, cached = peer(d, left())
            return graph_from_pb(store.get_message(out_d, ir_pb2.Graph)), rep, cached
        except (KilnError, ValueError) as e:
            if isinstance(e, DeadlineExceeded):
                raise
            log.warning("peer optimizer failed on region %s (%s); saturating it here", d, e)
            current_span().add_event("kiln.fanout_fallback", {"kiln.structure": str(d), "kiln.error": str(e)})
            return saturate_region(store, d, region, left())

    done: dict[Digest, tuple[Graph, SearchReport, bool]] = {}
    order = list(distinct)
    if peer is not None and len(distinct) > 1:
        with span("optimizer.fanout", **{"kiln.regions": len(distinct)}), \
                ThreadPoolExecutor(len(distinct), thread_name_prefix="fanout") as pool:
            ctx = otel_context.get_current()  # the peers' spans join this trace
            futures = {d: pool.submit(_in_context(ctx, remote), d, distinct[d]) for d in order}
            live.count("regions searched", 0, len(order))
            for n, _ in enumerate(as_completed(futures.values()), 1):
                live.count("regions searched", n, len(order))
            done = {d: f.result() for d, f in futures.items()}
    else:
        for n, d in enumerate(order):
            live.count("regions searched", n, len(order))
            done[d] = saturate_region(store, d, distinct[d], left())
        live.count("regions searched", len(order), len(order))
    for d in order:
        _, rep, cached = done[d]
        if cached:
            stats.cache_hits += 1
            continue
        report.iterations += rep.iterations
        for k, v in rep.rules.items():
            report.rules[k] = report.rules.get(k, 0) + v
        for k, v in rep.rulesets.items():
            report.rulesets[k] = report.rulesets.get(k, 0) + v
        report.stop_reason = max(report.stop_reason, rep.stop_reason, key=_STOP_ORDER.index)
    try:
        out = assemble(graph, regions, {name: done[d][0] for name, d in digests.items()})
    except RegionCycle:  # regions feed each other both ways: no split, one saturation
        out, report = saturate(graph, left())
        stats = RegionStats(regions=1, distinct=1)
    report.seconds = time.monotonic() - t0
    return out, report, stats


def _in_context(ctx, fn):
    def run(*args):
        token = otel_context.attach(ctx)
        try:
            return fn(*args)
        finally:
            otel_context.detach(token)

    return run


def search_report_to_pb(rep: SearchReport, out: services_pb2.OptimizeReport) -> None:
    """The search's iterations and rule counts into a report (stop reason and time are the caller's)."""
    for it in rep.iterations:
        out.iterations.add(iteration=it.iteration, enodes=it.enodes, eclasses=it.eclasses,
                           rules_fired=it.rules_fired)
    for rule, n in sorted(rep.rules.items()):
        out.rules.add(rule=rule, matches=n)
    for family, n in sorted(rep.rulesets.items()):
        out.rulesets.add(rule=family, matches=n)


def search_report_from_pb(r: services_pb2.OptimizeReport) -> SearchReport:
    return SearchReport([IterationStat(i.iteration, i.enodes, i.eclasses, i.rules_fired) for i in r.iterations],
                        {x.rule: x.matches for x in r.rules}, {x.rule: x.matches for x in r.rulesets},
                        r.stop_reason, r.seconds)


def candidates(g: Graph, options: OptimizeOptions, profile) -> list[tuple[Schedule, KernelGraph, list]]:
    """Distinct partitions of the extracted program under the schedule grid, best predicted
    first (the grid's order without a profile, so the default schedule leads), at most
    options.candidates of them. With the search off: the one kernel per op partition."""
    if not options.search:
        kg = partition(g, fuse=False)
        return [(DEFAULT_SCHEDULE, kg, predict(kg, profile) if profile is not None else [])]
    seen, out, structures = set(), [], {}
    for schedule in (DEFAULT_SCHEDULE,) + SCHEDULE_GRID:
        # schedules that differ only in their parallel choices share one partition
        key = dataclasses.replace(schedule, parallel_min_elements=0, parallel_min_macs=0, searched=True)
        if key not in structures:
            kg = partition(g, schedule=schedule)
            structures[key] = kg, tuple((k.kind, k.output, k.nodes) for k in kg.kernels)
        kg, kernels = structures[key]
        choices = schedule_choices(kg, schedule)
        if (kernels, choices) in seen:
            continue
        seen.add((kernels, choices))
        kg = with_choices(kg, choices)
        out.append((schedule, kg, predict(kg, profile) if profile is not None else []))
    if profile is not None:
        out.sort(key=lambda c: sum(x.seconds for x in c[2]))  # stable: ties keep the grid's order
    return out[:options.candidates]


def optimize(store: BlobStore, graph_d: Digest, options: OptimizeOptions, deadline: Optional[float] = None,
             peer: Optional[PeerSaturate] = None) -> tuple[Digest, services_pb2.OptimizeReport]:
    check_options(options)
    key = cache.action_key("optimize", STAGE_VERSION, {"graph": graph_d}, options.canonical())
    with cache.flight(store, key, deadline) as hit:  # one replica does it; the others wait
        if hit is not None:
            return hit["kernel_graph"], store.get_message(hit["report"], services_pb2.OptimizeReport)
        t0 = time.monotonic()
        try:
            graph = graph_from_pb(store.get_message(graph_d, ir_pb2.Graph))
        except ValueError as e:
            raise InvalidArgument(f"graph {graph_d} is malformed: {e}") from e
        profile = (store.get_message(options.target_profile, services_pb2.TargetProfile)
                   if options.target_profile is not None else None)
        with span("optimizer.search", **{"kiln.graph": str(graph_d), "kiln.search": options.search}) as s:
            if options.search:
                limits = SearchLimits(options.max_iterations, options.max_enodes, options.time_budget_s, deadline,
                                      Pool.from_profile(profile))
                optimized, rep, dedup = saturate_regions(store, graph, limits, peer)
            else:
                optimized, rep, dedup = graph, SearchReport(stop_reason="search off"), RegionStats()
            optimized, prepare = hoist(optimized)  # weight-only work: done at Load, not per run
            cands = [(schedule, dataclasses.replace(kg, prepare=prepare), costs)
                     for schedule, kg, costs in candidates(optimized, options, profile)]
            s.set_attribute("kiln.stop_reason", rep.stop_reason)
            s.set_attribute("kiln.cost_before", graph_cost(graph))
            s.set_attribute("kiln.cost_after", graph_cost(optimized))
            s.set_attribute("kiln.folded_weights", len(prepare.outputs) if prepare is not None else 0)
            s.set_attribute("kiln.kernels", len(cands[0][1].kernels))
            s.set_attribute("kiln.candidates", len(cands))
        report = services_pb2.OptimizeReport(stop_reason=rep.stop_reason, nodes_before=len(graph.nodes),
                                             nodes_after=len(optimized.nodes), kernels=len(cands[0][1].kernels),
                                             cost_before=graph_cost(graph),
                                             cost_after=graph_cost(optimized), regions=dedup.regions,
                                             distinct_regions=dedup.distinct, region_cache_hits=dedup.cache_hits)
        for schedule, kg, costs in cands:
            d = store.put_message(kernel_graph_to_pb(kg, graph_d))
            report.candidates.add(kernel_graph=d.to_pb(), schedule=schedule.describe(), kernels=len(kg.kernels),
                                  predicted_s=sum(c.seconds for c in costs))
        kg_d = Digest.from_pb(report.candidates[0].kernel_graph)
        if profile is not None:
            report.predicted_s = report.candidates[0].predicted_s
            for c in cands[0][2]:
                report.kernel_predictions.add(kernel=c.kernel, kind=c.kind, seconds=c.seconds, bound=c.bound)
        search_report_to_pb(rep, report)
        report.seconds = time.monotonic() - t0
        # a run cut short by the caller's deadline is not a reusable result
        if rep.stop_reason != "deadline":
            cache.record(store, key, {"kernel_graph": kg_d, "report": store.put_message(report)})
        return kg_d, report
