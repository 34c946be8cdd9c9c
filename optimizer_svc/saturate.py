"""Saturation: the rulesets run over the encoded graph, bounded, one family at a time.

The schedule is RULESETS, in order, once each per iteration; after each iteration the families'
Python-decided facts for what it added are entered (encode.discover). The run stops when nothing
changes (saturated) or at the first bound it hits: iterations, e-nodes, its time budget, the
caller's deadline, or the memory it may add to the process (RESOURCE_EXHAUSTED). A bound that is
hit is reported (SearchReport.stop_reason), never silent. Then extraction (extract.py).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Optional

from egglog import EGraph
from egglog.pretty import pretty_decl

from kiln.core.errors import ResourceExhausted
from kiln.core.limits import memory_limit, resident_bytes
from kiln.core.metrics import EGRAPH_ECLASSES, EGRAPH_ENODES
from kiln.core.telemetry import span
from kiln.ir.graph import Graph
from optimizer_svc.cost import Pool
from optimizer_svc.encode import EGraphView, Encoder, discover, encode, serialize
from optimizer_svc.extract import extract
from optimizer_svc.rules.algebra import algebra
from optimizer_svc.rules.attention import attention
from optimizer_svc.rules.matmul import MatmulFacts, matmul
from optimizer_svc.rules.norms import norms
from optimizer_svc.rules.reductions import ReductionFacts, reductions
from optimizer_svc.rules.schedules import schedules
from optimizer_svc.rules.views import ViewFacts, views

# the rule schedule: each family's ruleset once per iteration, in this order
RULESETS = {"algebra": algebra, "views": views, "reductions": reductions, "matmul": matmul, "norms": norms,
            "attention": attention, "schedules": schedules}
# the families that enter facts from Python, in the order they see each node
FACTS = (ViewFacts, ReductionFacts, MatmulFacts)


@dataclass
class SearchLimits:
    max_iterations: int = 16
    max_enodes: int = 200_000
    time_budget_s: float = 30.0
    deadline: Optional[float] = None  # time.monotonic() at which the caller's deadline expires
    pool: Optional[Pool] = None  # the target's pool: schedules are searched only when it is known
    # bytes one saturation may add to the process (KILN_OPTIMIZE_MEMORY_MB; default a quarter of
    # the machine); past it the request is RESOURCE_EXHAUSTED
    max_memory_bytes: int = field(default_factory=lambda: memory_limit("KILN_OPTIMIZE_MEMORY_MB", 0.25))


def _check_memory(limits: SearchLimits, start: int, where: str) -> None:
    grown = resident_bytes() - start
    if grown > limits.max_memory_bytes:
        raise ResourceExhausted(f"the search grew this process by {grown / (1 << 20):.1f} MiB {where}, over the "
                                f"per-request cap of {limits.max_memory_bytes / (1 << 20):.1f} MiB "
                                "(KILN_OPTIMIZE_MEMORY_MB); lower max_enodes or max_iterations")


@dataclass
class IterationStat:
    iteration: int
    enodes: int
    eclasses: int
    rules_fired: int


@dataclass
class SearchReport:
    iterations: list[IterationStat] = field(default_factory=list)
    rules: dict[str, int] = field(default_factory=dict)
    rulesets: dict[str, int] = field(default_factory=dict)
    stop_reason: str = ""
    seconds: float = 0.0


_RULE_NAMES: dict = {}  # a rule's declaration -> its printed form; the rules are the modules' own, so few


def _rule_name(decls, decl) -> str:
    """A fired rule's name for the report: egglog prints it through its formatter (ms a call:
    two fifths of a small graph's saturation), so once per rule per process."""
    name = _RULE_NAMES.get(decl)
    if name is None:
        name = _RULE_NAMES[decl] = pretty_decl(decls, decl)
    return name


def saturate(g: Graph, limits: SearchLimits) -> tuple[Graph, SearchReport]:
    eg = EGraph()
    state = getattr(eg, "_state", None)  # egglog's Python state: it holds the native e-graph
    try:
        return _saturate(g, limits, eg)
    finally:
        # an egglog EGraph must be freed on the thread that made it (gRPC workers are a pool).
        # Each run leaves a closure cycle that holds its state (egglog's schedule processing), so
        # dropping our references frees nothing; emptying the state drops the native e-graph
        # now, and the cycle left is plain Python for any collection. (Only if egglog changed
        # that layout: a full collection, 0.2-0.4 s in a process that loaded torch, which once
        # per region was a fifth of a compile.)
        del eg
        if hasattr(state, "__dict__"):
            state.__dict__.clear()
        else:
            gc.collect()
        del state


def _saturate(g: Graph, limits: SearchLimits, eg: EGraph) -> tuple[Graph, SearchReport]:
    t0 = time.monotonic()
    rss0 = resident_bytes()
    report = SearchReport()
    enc = Encoder(g)
    families = [f(enc) for f in FACTS]
    with span("optimizer.encode", **{"kiln.nodes": len(g.nodes)}):
        refs = encode(eg, enc, families, limits.pool)
    _check_memory(limits, rss0, "encoding the graph")
    stop = "iteration limit"
    serialized = None
    for it in range(1, limits.max_iterations + 1):
        now = time.monotonic()
        if limits.deadline is not None and now >= limits.deadline:
            stop = "deadline"
            break
        if now - t0 >= limits.time_budget_s:
            stop = "time budget"
            break
        with span("optimizer.iteration", **{"kiln.iteration": it}) as s:
            fired, updated = 0, False
            for family, ruleset in RULESETS.items():  # scheduled one family at a time
                r = eg.run(1, ruleset=ruleset)
                updated |= r.updated
                for decl, count in r.num_matches_per_rule.items():
                    if count:
                        name = _rule_name(r._decls, decl)
                        report.rules[name] = report.rules.get(name, 0) + count
                        report.rulesets[family] = report.rulesets.get(family, 0) + count
                        fired += count
            serialized = serialize(eg)
            new_pairs = discover(eg, families, EGraphView(enc, serialized))
            new_pairs |= enc.flush_tables(eg)
            enodes = sum(size for _, size in eg.all_function_sizes())
            eclasses = len({n["eclass"] for n in serialized["nodes"].values()})
            report.iterations.append(IterationStat(it, enodes, eclasses, fired))
            s.set_attribute("kiln.enodes", enodes)
            s.set_attribute("kiln.eclasses", eclasses)
            s.set_attribute("kiln.rules_fired", fired)
            EGRAPH_ENODES.observe(enodes)
            EGRAPH_ECLASSES.observe(eclasses)
        _check_memory(limits, rss0, f"by iteration {it}")
        if not updated and not new_pairs:
            stop = "saturated"
            break
        if enodes >= limits.max_enodes:
            stop = "e-node limit"
            break
    report.stop_reason = stop
    with span("optimizer.extract"):
        if serialized is None or report.stop_reason != "saturated":
            serialized = serialize(eg)
        out = extract(g, enc, serialized, limits.pool)
    del eg, refs
    report.seconds = time.monotonic() - t0
    return out, report
