"""Equality saturation over a primitive Graph: encode, run bounded rulesets, extract.

Extraction reads the serialized e-graph and picks, per e-class, the cheapest e-node by a
bottom-up fixpoint (a compute op costs the elements it computes, weighted by op; views 0.01;
leaves and constants 0; e-class shapes are inferred from the leaves), then rebuilds a
Graph through GraphBuilder so shapes and dtypes are re-inferred and checked.
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from egglog import EGraph, String, i64, set_, union
from egglog.pretty import pretty_decl

from kiln.core.errors import ResourceExhausted
from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.graph import ATTENTION_TILES, DEFAULT_GEMM_TILE, GEMM_TILES, Graph
from kiln.ir.kernel import flat_preserving, row_broadcast_axis
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import evaluate_dim, numel
from kiln.ir import view as view_specs
from kiln.ir.view import ViewSpec, compose
from kiln.core.limits import memory_limit, resident_bytes
from kiln.core.metrics import EGRAPH_ECLASSES, EGRAPH_ENODES
from kiln.core.telemetry import span
from optimizer_svc.rules.algebra import algebra
from optimizer_svc.rules.attention import attention
from optimizer_svc.rules.matmul import GemmMember, bias_member, gemm_merge, is_gemm_layout, matmul, merged_bias_tables
from optimizer_svc.rules.norms import layer_norm_primitives, norms, rms_norm_primitives, softmax_primitives
from optimizer_svc.rules.reductions import reductions, split_parts
from optimizer_svc.rules.schedules import schedules
from optimizer_svc.rules.views import views
from optimizer_svc.terms import (Term, bias_group, compose_views, gemm_layout, member_slice, merge_axis, merge_group, merge_in,
                                 merge_out, merged_bias, merged_bias_view, merged_operand, merged_weight, merged_weight_view, plain_view,
                                 pool_threads, pool_vector_bits, reduce_view, row_bcast, shape_of, split_in,
                                 split_out)

_UNARY = {Op.EXP2: Term.exp2, Op.LOG2: Term.log2, Op.SIN: Term.sin, Op.SQRT: Term.sqrt, Op.RECIP: Term.recip}
_BINARY = {Op.ADD: Term.add, Op.MUL: Term.mul, Op.MOD: Term.mod, Op.LESS_THAN: Term.less_than}
_BY_NAME = {"Term." + n: n for n in ("input", "weight", "const", "view", "exp2", "log2", "sin", "sqrt", "recip",
                                      "add", "mul", "mod", "less_than", "where", "sum_reduce", "max_reduce",
                                      "iota", "gather", "scatter", "cast", "gemm", "softmax", "rms_norm",
                                      "layer_norm", "attention", "scheduled", "output")}
_BY_NAME.update(merged_weight="merged_weight", merged_bias="merged_weight")  # rules/matmul.py: name a
# concatenation, never extracted


GEMM_WEIGHT = 0.25  # one multiply-add of a BLAS GEMM, against 1 for each op of a generated loop


VECTOR_NOISE = 0.05  # vector rates within this of LLVM's own width's count as equal to it


def vector_factors(profile) -> dict[int, float]:
    """Per SIMD vector width (bits) the target measured, its in-cache work's time against LLVM's
    preferred width (Calibrate's vector_rates): below 1 where the width runs faster; 1 where
    the two differ by no more than VECTOR_NOISE, so a width is asked for only when it matters."""
    rates = {v.bits: v.gelems for v in profile.vector_rates if v.gelems > 0}
    if 0 not in rates:
        return {}
    factors = {bits: rates[0] / rate for bits, rate in sorted(rates.items()) if bits}
    return {bits: 1.0 if abs(f - 1.0) <= VECTOR_NOISE else round(f, 3) for bits, f in factors.items()}


@dataclass(frozen=True)
class Pool:
    """What schedules cost on the target (rules/schedules.py), in extraction's units (one
    elementwise op on one element by one thread): its parallel pool's threads, the fixed cost
    of a parallel and of a serial kernel, one thread's BLAS multiply-add, an elementwise op on
    data in cache, and each SIMD vector width's factor on in-cache work (vector_factors)."""
    threads: int
    parallel_overhead: float
    serial_overhead: float
    gemm_mac: float = GEMM_WEIGHT
    cached: float = 1.0
    vector: tuple[tuple[int, float], ...] = ()

    @staticmethod
    def from_profile(profile) -> Optional["Pool"]:
        """From a TargetProfile (Executor.Calibrate); None for one thread or no measurements."""
        if profile is None or profile.threads <= 1 or profile.elementwise_gelems <= 0:
            return None
        unit_us = profile.threads / (profile.elementwise_gelems * 1e3)  # µs per element-op, one thread
        serial = profile.serial_overhead_us or profile.kernel_overhead_us
        rates = sorted(g.gflops for g in profile.gemm if g.m > 1 and g.n > 1 and g.gflops > 0)
        mac = 2e-3 / rates[len(rates) // 2] / unit_us if rates else GEMM_WEIGHT  # µs per MAC / µs per unit
        cached = min(1.0, profile.elementwise_gelems / profile.cached_gelems) if profile.cached_gelems > 0 else 1.0
        return Pool(profile.threads, round(profile.kernel_overhead_us / unit_us, 1), round(serial / unit_us, 1),
                    round(mac, 4), round(cached, 4), tuple(vector_factors(profile).items()))

    @property
    def widest_vector(self) -> int:
        return max((bits for bits, _ in self.vector), default=0)

    def canonical(self) -> dict:
        return {"threads": self.threads, "parallel_overhead": self.parallel_overhead,
                "serial_overhead": self.serial_overhead, "gemm_mac": self.gemm_mac, "cached": self.cached,
                "vector": [list(v) for v in self.vector]}


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


class _Encoder:
    def __init__(self, g: Graph):
        self.g = g
        self.specs: dict[str, ViewSpec] = {}
        self.shapes: dict[str, tuple] = {}
        self.composed: set[tuple[str, str]] = set()
        self.gemm_checked: set[tuple[str, str, int]] = set()
        self.merged: set[tuple] = set()  # (weight, spec, axis, side) already in a GEMM merge group
        self.merges = 0
        self.merge_info: dict[str, object] = {}  # group name -> rules.matmul.GemmMerge
        self.bias_merged: dict[str, dict] = {}  # group -> member weight -> its bias weight
        self.bias_entries: set[tuple] = set()
        self.pending: list[str] = []  # specs whose tables are not yet in the e-graph

    def spec_key(self, v: ViewSpec) -> str:
        k = v.key()
        if k not in self.specs:
            self.specs[k] = v
            self.pending.append(k)
        return k

    def flush_tables(self, eg: EGraph) -> bool:
        """Enter the Python-computed facts of new specs: plain_view for views without a mask,
        row_bcast for views that read a row value back along its axis, reduce_view for
        broadcast scalars. True when anything was added."""
        added = False
        while self.pending:
            k = self.pending.pop()
            v = self.specs[k]
            if v.mask is None:
                eg.register(plain_view(String(k)))
                added = True
            for axis, (d, st) in enumerate(zip(v.shape, v.strides)):
                src = tuple(1 if j == axis else x for j, x in enumerate(v.shape))
                # along an axis of size 1: a view that reads its source in order
                if (row_broadcast_axis(v, src) == axis if d != 1 else flat_preserving(v, src)):
                    eg.register(row_bcast(String(k), axis))
                    added = True
            if v.mask is None and v.offset == 0 and all(st == 0 for st in v.strides):
                for axis in range(len(v.shape)):
                    r = ViewSpec(tuple(1 if j == axis else d for j, d in enumerate(v.shape)), v.strides)
                    eg.register(set_(reduce_view(k, axis)).to(String(self.spec_key(r))))
                    added = True
        return added

    def term(self, n, args):
        op = n.op
        if op is Op.INPUT:
            return Term.input(n.name)
        if op is Op.WEIGHT:
            return Term.weight(n.name)
        if op is Op.CONSTANT:
            return Term.const(n.value, n.dtype.value)
        if op is Op.VIEW:
            return Term.view(args[0], self.spec_key(n.view))
        if op in _UNARY:
            return _UNARY[op](args[0])
        if op in _BINARY:
            return _BINARY[op](args[0], args[1])
        if op is Op.WHERE:
            return Term.where(*args)
        if op is Op.SUM_REDUCE:
            return Term.sum_reduce(args[0], n.axis)
        if op is Op.MAX_REDUCE:
            return Term.max_reduce(args[0], n.axis)
        if op is Op.IOTA:
            key = ",".join(map(str, n.shape))
            self.shapes[key] = n.shape
            return Term.iota(key, n.axis, n.dtype.value)
        if op is Op.GATHER:
            return Term.gather(args[0], args[1], n.axis)
        if op is Op.SCATTER:
            return Term.scatter(args[0], args[1], args[2], n.axis)
        if op is Op.CAST:
            return Term.cast(args[0], n.dtype.value)
        raise ValueError(f"cannot encode {op}")

    def register_composition(self, eg: EGraph, inner: str, outer: str) -> bool:
        if (inner, outer) in self.composed:
            return False
        self.composed.add((inner, outer))
        c = compose(self.specs[inner], self.specs[outer])
        if c is None:
            return False
        eg.register(set_(compose_views(inner, outer)).to(String(self.spec_key(c))))
        return True

    def register_merge(self, eg: EGraph, x, shape, a: int, b: int) -> None:
        """Enter x's shape and the reshapes that merge reduced axes a then b of it, when the
        axes are adjacent, static and not of size 1 (rules/reductions.py)."""
        if abs(a - b) != 1 or not all(isinstance(d, int) for d in shape) or 1 in (shape[a], shape[b]):
            return
        key = ",".join(map(str, shape))
        lo = min(a, b)
        merged = tuple(shape[:lo]) + (shape[lo] * shape[lo + 1],) + tuple(shape[lo + 2:])
        reduced = tuple(1 if j == lo else d for j, d in enumerate(merged))
        out = tuple(1 if j in (a, b) else d for j, d in enumerate(shape))
        eg.register(set_(shape_of(x)).to(String(key)),
                    set_(merge_in(key, a, b)).to(String(self.spec_key(view_specs.reshape(tuple(shape), merged)))),
                    set_(merge_axis(key, a, b)).to(i64(lo)),
                    set_(merge_out(key, a, b)).to(String(self.spec_key(view_specs.reshape(reduced, out)))))

    def register_split(self, eg: EGraph, x, shape, axis: int, threads: int) -> None:
        """Enter x's shape and the reshapes that split reduced `axis` of it into parts for the
        pool, when split_parts allows (rules/reductions.py)."""
        parts = split_parts(tuple(shape), axis, threads)
        if parts is None:
            return
        shape = tuple(shape)
        key = ",".join(map(str, shape))
        split = shape[:axis] + (parts, shape[axis] // parts) + shape[axis + 1:]
        reduced = shape[:axis] + (1, 1) + shape[axis + 1:]
        out = shape[:axis] + (1,) + shape[axis + 1:]
        eg.register(set_(shape_of(x)).to(String(key)),
                    set_(split_in(key, axis)).to(String(self.spec_key(view_specs.reshape(shape, split)))),
                    set_(split_out(key, axis)).to(String(self.spec_key(view_specs.reshape(reduced, out)))))

    def register_gemm_merges(self, eg: EGraph, groups: dict[tuple, list[GemmMember]]) -> bool:
        """Enter the tables of each new group of GEMMs of one shared operand against weights
        (rules/matmul.py). A member joins one group only, so each table entry is set once."""
        added = False
        for members in sorted(groups.values(), key=len, reverse=True):
            members = [m for m in members if (m.weight, m.spec.key(), m.axis, m.side) not in self.merged]
            by_layout: dict[tuple, list[GemmMember]] = {}
            for m in sorted(members, key=lambda m: m.weight):
                by_layout.setdefault((m.weight_shape[1:], m.spec.strides, m.axis, m.side), []).append(m)
            for sub in by_layout.values():
                merge = gemm_merge(f"g{self.merges}", sub)
                if merge is None:
                    continue
                self.merges += 1
                self.merge_info[merge.name] = merge
                facts = [union(merged_weight(merge.name)).with_(self._concatenation(merge))]
                for m in merge.members:
                    self.merged.add((m.weight, m.spec.key(), m.axis, m.side))
                    facts += [set_(merge_group(m.weight, m.spec.key(), m.axis, m.side)).to(String(merge.name)),
                              set_(merged_operand(merge.name, m.weight)).to(String(self.spec_key(merge.operand[m.weight]))),
                              set_(member_slice(merge.name, m.weight)).to(String(self.spec_key(merge.slices[m.weight])))]
                facts.append(set_(merged_weight_view(merge.name)).to(String(self.spec_key(merge.weight_view))))
                eg.register(*facts)
                added = True
        return added

    def register_bias_merge(self, eg: EGraph, group: str, members: dict) -> bool:
        """Enter the merged bias of the group, once every member is seen with its bias, and a
        bias_group entry for each (view, bias view) pair that adds a member's bias."""
        merge = self.merge_info[group]
        name = f"{group}b"
        facts = []
        if group not in self.bias_merged:
            tables = merged_bias_tables(merge, {w: (b, n) for w, (b, n, _) in members.items()})
            if tables is None:
                return False
            self.bias_merged[group] = {w: b for w, (b, _, _) in members.items()}
            facts += [union(merged_bias(name)).with_(self._sum_of([Term.view(Term.weight(b), self.spec_key(v))
                                                                   for b, v in tables["pads"].items()])),
                      set_(merged_bias_view(name)).to(String(self.spec_key(tables["view"])))]
        for w, (b, _, pairs) in members.items():
            if self.bias_merged[group].get(w) != b:
                continue
            for sv, bc in pairs:
                if (group, sv, b, bc) not in self.bias_entries:
                    self.bias_entries.add((group, sv, b, bc))
                    facts.append(set_(bias_group(group, sv, b, bc)).to(String(name)))
        if facts:
            eg.register(*facts)
        return bool(facts)

    def _concatenation(self, merge):
        return self._sum_of([Term.view(Term.weight(m.weight), self.spec_key(merge.pads[m.weight]))
                             for m in merge.members])

    @staticmethod
    def _sum_of(parts):
        out = parts[-1]
        for p in reversed(parts[:-1]):
            out = Term.add(p, out)
        return out

    def register_gemm_layout(self, eg: EGraph, a: str, b: str, axis: int) -> bool:
        if (a, b, axis) in self.gemm_checked:
            return False
        self.gemm_checked.add((a, b, axis))
        if not is_gemm_layout(self.specs[a], self.specs[b], axis):
            return False
        eg.register(gemm_layout(a, b, axis))
        return True


def saturate(g: Graph, limits: SearchLimits) -> tuple[Graph, SearchReport]:
    eg = EGraph()
    try:
        return _saturate(g, limits, eg)
    finally:
        # an egglog EGraph must be freed on the thread that made it (gRPC workers are a pool);
        # its Python state sits in reference cycles, so only a collection here frees it
        del eg
        gc.collect()


def _saturate(g: Graph, limits: SearchLimits, eg: EGraph) -> tuple[Graph, SearchReport]:
    t0 = time.monotonic()
    rss0 = resident_bytes()
    report = SearchReport()
    enc = _Encoder(g)
    refs = []
    with span("optimizer.encode", **{"kiln.nodes": len(g.nodes)}):
        for i, n in enumerate(g.nodes):
            refs.append(eg.let(f"n{i}", enc.term(n, [refs[j] for j in n.inputs])))
            if n.op is Op.VIEW and g.nodes[n.inputs[0]].op is Op.VIEW:
                enc.register_composition(eg, g.nodes[n.inputs[0]].view.key(), n.view.key())
            inner = g.nodes[n.inputs[0]] if n.inputs else None
            if n.op in GroupOp.Reduce and inner.op is n.op:  # a reduction of a reduction
                enc.register_merge(eg, refs[inner.inputs[0]], g.nodes[inner.inputs[0]].shape, inner.axis, n.axis)
            if n.op in GroupOp.Reduce and limits.pool is not None:
                enc.register_split(eg, refs[n.inputs[0]], inner.shape, n.axis, limits.pool.threads)
        for k, o in enumerate(g.outputs):
            eg.register(Term.output(k, refs[o]))
        if limits.pool is not None:
            eg.register(set_(pool_threads()).to(i64(limits.pool.threads)))
            if limits.pool.widest_vector:
                eg.register(set_(pool_vector_bits()).to(i64(limits.pool.widest_vector)))
        enc.flush_tables(eg)
    _check_memory(limits, rss0, "encoding the graph")
    rulesets = {"algebra": algebra, "views": views, "reductions": reductions, "matmul": matmul, "norms": norms,
                "attention": attention, "schedules": schedules}
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
            for family, ruleset in rulesets.items():  # scheduled one family at a time
                r = eg.run(1, ruleset=ruleset)
                updated |= r.updated
                for decl, count in r.num_matches_per_rule.items():
                    if count:
                        name = pretty_decl(r._decls, decl)
                        report.rules[name] = report.rules.get(name, 0) + count
                        report.rulesets[family] = report.rulesets.get(family, 0) + count
                        fired += count
            serialized = _serialize(eg)
            new_pairs = _register_facts(eg, enc, serialized)
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
            serialized = _serialize(eg)
        out = _extract(g, enc, serialized, limits.pool)
    del eg, refs
    report.seconds = time.monotonic() - t0
    return out, report


def _serialize(eg: EGraph) -> dict:
    return json.loads(eg._serialize(split_primitive_outputs=False).to_json())


def _literal(node: dict):
    op = node["op"]
    if op.startswith('"'):
        return json.loads(op)
    try:
        return int(op)
    except ValueError:
        return float(op.replace("NaN", "nan"))


def _register_facts(eg: EGraph, enc: _Encoder, ser: dict) -> bool:
    """Enter the Python-decided facts for the view pairs new e-nodes brought: compositions of a
    view of a view, and GEMM layouts of a SumReduce of a Mul of two views."""
    nodes = ser["nodes"]
    by_class: dict[str, list[dict]] = {}
    for n in nodes.values():
        by_class.setdefault(n["eclass"], []).append(n)

    def view_specs(cls: str) -> list[str]:
        return [k for m in by_class.get(cls, []) if m["op"] == "Term.view"
                for k in [_literal(nodes[m["children"][1]])] if k in enc.specs]

    def weight_views(cls: str) -> list[tuple[str, str]]:  # (weight name, spec) of views of a weight
        out = []
        for m in by_class.get(cls, []):
            if m["op"] == "Term.view":
                k = _literal(nodes[m["children"][1]])
                for leaf in by_class.get(nodes[m["children"][0]]["eclass"], []):
                    if leaf["op"] == "Term.weight" and k in enc.specs:
                        out.append((_literal(nodes[leaf["children"][0]]), k))
        return out

    weight_shape = {t.name: tuple(t.shape) for t in enc.g.weights}
    # GEMMs against a weight, by the source of their other operand's broadcast view
    groups: dict[tuple, list[GemmMember]] = {}
    added = False
    for n in nodes.values():
        if n["op"] == "Term.gemm":
            kids = [nodes[c]["eclass"] for c in n["children"][:2]]
            axis = _literal(nodes[n["children"][2]])
            for side in (0, 1):
                for w, k in weight_views(kids[side]):
                    if w not in weight_shape:
                        continue
                    for m in by_class.get(kids[1 - side], []):
                        if m["op"] != "Term.view" or _literal(nodes[m["children"][1]]) not in enc.specs:
                            continue
                        shared = enc.specs[_literal(nodes[m["children"][1]])]
                        group = groups.setdefault((nodes[m["children"][0]]["eclass"], axis, side), [])
                        if all(x.weight != w for x in group):
                            group.append(GemmMember(w, weight_shape[w], enc.specs[k], axis, side, shared))
        if n["op"] == "Term.view":
            outer_key = _literal(nodes[n["children"][1]])
            if outer_key in enc.specs:
                for inner_key in view_specs(nodes[n["children"][0]]["eclass"]):
                    added |= enc.register_composition(eg, inner_key, outer_key)
        elif n["op"] == "Term.sum_reduce":
            axis = _literal(nodes[n["children"][1]])
            for m in by_class.get(nodes[n["children"][0]]["eclass"], []):
                if m["op"] == "Term.mul":
                    ca, cb = (nodes[c]["eclass"] for c in m["children"])
                    for sa in view_specs(ca):
                        for sb in view_specs(cb):
                            added |= enc.register_gemm_layout(eg, sa, sb, axis)
    added |= enc.register_gemm_merges(eg, groups)
    added |= _register_bias_merges(eg, enc, nodes, by_class)
    return added


def _register_bias_merges(eg: EGraph, enc: _Encoder, nodes: dict, by_class: dict) -> bool:
    """For each merged GEMM whose members' results each get a bias weight added (through any
    views), enter the tables of the merged bias (rules/matmul.py)."""
    if not enc.merge_info:
        return False
    weight_shape = {t.name: tuple(t.shape) for t in enc.g.weights}
    group_of_class = {n["eclass"]: _literal(nodes[n["children"][0]]) for n in nodes.values()
                      if n["op"] == "merged_weight"}
    merged_class: dict[str, str] = {}  # e-class of a merged GEMM's result -> its group
    for n in nodes.values():
        if n["op"] == "Term.gemm":
            for ch in n["children"][:2]:
                for m in by_class.get(nodes[ch]["eclass"], []):
                    if m["op"] == "Term.view" and nodes[m["children"][0]]["eclass"] in group_of_class:
                        merged_class[n["eclass"]] = group_of_class[nodes[m["children"][0]]["eclass"]]
    reads: dict[str, list[tuple[str, str]]] = {}  # e-class -> (group, view spec) of views of a merged result
    for n in nodes.values():
        if n["op"] == "Term.view" and nodes[n["children"][0]]["eclass"] in merged_class:
            spec = _literal(nodes[n["children"][1]])
            if spec in enc.specs:
                reads.setdefault(n["eclass"], []).append((merged_class[nodes[n["children"][0]]["eclass"]], spec))
    found: dict[str, dict] = {}  # group -> member weight -> (bias, length, [(view, bias view)])
    for n in nodes.values():
        if n["op"] != "Term.add":
            continue
        kids = [nodes[c]["eclass"] for c in n["children"]]
        for side in (0, 1):
            for group, sv in reads.get(kids[1 - side], []):
                for m in by_class.get(kids[side], []):
                    if m["op"] != "Term.view" or _literal(nodes[m["children"][1]]) not in enc.specs:
                        continue
                    bc = _literal(nodes[m["children"][1]])
                    for leaf in by_class.get(nodes[m["children"][0]]["eclass"], []):
                        b = _literal(nodes[leaf["children"][0]]) if leaf["op"] == "Term.weight" else None
                        if b not in weight_shape or len(weight_shape[b]) != 1:
                            continue
                        w = bias_member(enc.merge_info[group], enc.specs[sv], enc.specs[bc], weight_shape[b][0])
                        if w is not None:
                            entry = found.setdefault(group, {}).setdefault(w, (b, weight_shape[b][0], []))
                            if entry[0] == b:
                                entry[2].append((sv, bc))
    added = False
    for group, members in found.items():
        added |= enc.register_bias_merge(eg, group, members)
    return added


# relative cost of one element of each op: transcendental ops are polynomial evaluations
_OP_WEIGHT = {"exp2": 4.0, "log2": 4.0, "sin": 4.0, "sqrt": 2.0, "recip": 2.0, "mod": 2.0}
VIEW_COST = 0.01  # views are free at run time; a small cost prefers fewer of them
# a row kernel's cost per element: below its primitive ops' (softmax 10, RMS norm 3, layer norm 5)
# because it reads its input once and writes only its result
_ROW_WEIGHT = {"softmax": 5.0, "rms_norm": 2.0, "layer_norm": 3.0}
ATTENTION_SAVING = 1.0  # per probability: a fused attention kernel never writes nor reads P


def _node_cost(name: str, elements: int) -> float:
    if name in ("input", "weight", "const"):
        return 0.0
    if name == "view":
        return VIEW_COST
    if name == "gemm":  # elements: the multiply-adds
        return GEMM_WEIGHT * elements
    if name in _ROW_WEIGHT:
        return _ROW_WEIGHT[name] * elements
    return _OP_WEIGHT.get(name, 1.0) * elements


def graph_cost(g: Graph) -> float:
    """The cost extraction minimizes, for a whole Graph: elements computed, weighted by op."""
    largest = {name: hi for name, _, hi in g.symbols}
    name = {v: k for k, v in _TERM_OF_OP.items()}
    in_gemm = {n.inputs[0] for n in g.nodes if n.kernel in ("gemm", "attention")}  # a GEMM's Mul
    total = 0.0
    for i, n in enumerate(g.nodes):
        if i in in_gemm:
            continue
        if n.kernel in ("gemm", "attention"):
            total += _node_cost("gemm", evaluate_dim(numel(g.nodes[n.inputs[0]].shape), largest))
        else:
            total += _node_cost(name.get(n.op, "other"), evaluate_dim(numel(n.shape), largest))
    return total


_TERM_OF_OP = {"input": Op.INPUT, "weight": Op.WEIGHT, "const": Op.CONSTANT, "view": Op.VIEW, "exp2": Op.EXP2,
               "log2": Op.LOG2, "sin": Op.SIN, "sqrt": Op.SQRT, "recip": Op.RECIP, "mod": Op.MOD}


def _enode_cost(n: dict, cls: str, nodes: dict, elements: dict[str, int]) -> float:
    """An e-node's own cost. A reduction costs the elements it reads; a GEMM its multiply-adds
    (the elements of its broadcast operand views); attention, those of P · V less what not
    writing P saves."""
    name = _BY_NAME[n["op"]]
    kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["op"] in _BY_NAME]
    if name in ("merged_weight", "scheduled"):  # a schedule prices its class's kernel (_schedule_costs)
        return float("inf")
    if name in ("gemm", "sum_reduce", "max_reduce"):
        return _node_cost(name, elements.get(kids[0], 1))
    if name == "attention":
        return max(0.0, _node_cost("gemm", elements.get(kids[1], 1)) - ATTENTION_SAVING * elements.get(kids[0], 1))
    return _node_cost(name, elements.get(cls, 1))


def _class_shapes(g: Graph, enc: "_Encoder", nodes: dict, classes: dict[str, list[str]]) -> dict[str, tuple]:
    """The shape of each e-class's value (all members of a class have one shape), inferred
    bottom-up from the leaves."""
    leaf = {t.name: t.shape for t in list(g.inputs) + list(g.weights)}
    shape: dict[str, tuple] = {}
    changed = True
    while changed:
        changed = False
        for cls, members in classes.items():
            if cls in shape:
                continue
            for nid in members:
                n = nodes[nid]
                name = _BY_NAME[n["op"]]
                kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["op"] in _BY_NAME]
                lits = [_literal(nodes[ch]) for ch in n["children"] if nodes[ch]["op"] not in _BY_NAME]
                if name in ("merged_weight", "scheduled"):  # a concatenation's name; a kernel's schedule
                    continue
                if name in ("input", "weight"):
                    shape[cls] = tuple(leaf[lits[0]])
                elif name == "const":
                    shape[cls] = ()
                elif name == "view":
                    shape[cls] = tuple(enc.specs[lits[0]].shape)
                elif name == "iota":
                    shape[cls] = tuple(enc.shapes[lits[0]])
                elif not all(k in shape for k in kids):
                    continue
                elif name in ("sum_reduce", "max_reduce", "gemm"):
                    s = list(shape[kids[0]])
                    s[int(lits[0])] = 1
                    shape[cls] = tuple(s)
                elif name == "attention":  # P · V: V's broadcast view, reduced along k
                    s = list(shape[kids[1]])
                    s[int(lits[1])] = 1
                    shape[cls] = tuple(s)
                elif name == "gather":
                    shape[cls] = shape[kids[1]]
                else:  # elementwise ops and scatter: the first operand's shape
                    shape[cls] = shape[kids[0]]
                changed = True
                break
    return shape


SCHEDULED = ("gemm", "attention", "softmax", "rms_norm", "layer_norm", "sum_reduce", "max_reduce")
GEMM_BLOCK_ROWS = 64  # codegen's fewest rows per block of a GEMM split across the pool
# loop order of a reduction whose axis is not its input's innermost: by default each output
# element's loop steps along the axis with the stride of the axes after it, a cache line per
# element once that stride reaches 16 floats; axis-outer reads in memory order but updates a
# row of accumulators per element (in cache: a load and a store)
STRIDED_READ = 3.0
ACCUMULATE = 0.5
LINE_ELEMENTS = 16


def order_factor(inner: int, axis_outer: bool) -> float:
    """A reduction's work factor for its loop order, `inner` the elements after its axis (also
    the roofline's, cost.predict)."""
    if inner <= 1:
        return 1.0
    if axis_outer:
        return 1.0 + ACCUMULATE
    return 1.0 + STRIDED_READ if inner >= LINE_ELEMENTS else 1.0


TILE_CACHE_BYTES = 1 << 18  # an attention tile's scores, probabilities and output rows stay in cache up to this
C_CACHE_BYTES = 1 << 21  # a GEMM's block of C stays in cache from BLAS writing it to its epilogue reading it up to this
VECTOR_TIE = 1e-3  # what asking LLVM for a vector width costs over not asking: equal work keeps its own choice
GEMM_PACK = 1.0  # per element of B: BLAS packs B again for every call (a tile of rows) after the first


def width_matters(reduce_read_bytes: int) -> bool:
    """Whether a reduction reading this many bytes runs from cache, where its vector width can
    matter (streamed from memory, it cannot); extraction and the roofline (cost.predict) both ask."""
    return reduce_read_bytes <= C_CACHE_BYTES


def gemm_tile_extra(rows: int, n: int, k: int, tile: int, epilogue: bool = True) -> tuple[int, float]:
    """What computing one thread's `rows` rows of a GEMM's C (N columns, K deep) `tile` rows per
    BLAS call (0: all in one), each block's epilogue right after, costs beyond the GEMM itself:
    (BLAS calls beyond the first, element units). Every call after the first packs B again; a
    block of C larger than C_CACHE_BYTES has left the cache before its epilogue reads it back.
    Extraction (_schedule_costs, which cannot know the fusion yet: it assumes an epilogue) and
    the roofline (cost.predict) both price a tile by it."""
    blocks = -(-rows // tile) if tile else 1
    block = min(tile, rows) if tile else rows
    cold = STRIDED_READ * rows * n if epilogue and block * n * 4 > C_CACHE_BYTES else 0.0
    return blocks - 1, (blocks - 1) * k * n * GEMM_PACK + cold


def attention_tile_extra(batch: int, m: int, keys: int, d: int, tile: int) -> tuple[int, float]:
    """What fused attention over `batch` matrices of M query rows, `keys` keys and D output
    columns, `tile` query rows at a time, costs beyond its two GEMMs: (BLAS calls, element
    units). Two BLAS calls per tile; a tile whose scores, probabilities and output rows outgrow
    TILE_CACHE_BYTES reads its scores and probabilities back from memory."""
    tasks = batch * -(-m // tile)
    cold = STRIDED_READ * 2 * batch * m * keys if (2 * keys + d) * tile * 4 > TILE_CACHE_BYTES else 0.0
    return 2 * tasks, cold


def _schedule_costs(n: dict, cls: str, nodes: dict, shapes: dict[str, tuple], largest: dict, work: float,
                    pool: Pool) -> dict[str, float]:
    """The cost of e-node n's kernel under each schedule: serial, its work plus a serial kernel's
    fixed cost; parallel, its work over the threads its outer loop can keep busy plus a parallel
    kernel's fixed cost. A GEMM (or attention) shares blocks of at least GEMM_BLOCK_ROWS rows of
    its result; a reduction or row kernel, its first loop of more than one iteration (in the
    axis-outer order, of the axes before the reduced one), or collapsed, all its outer loops'
    iterations. A GEMM's tile of rows per BLAS call and attention's tile of query rows add what
    gemm_tile_extra and attention_tile_extra say. Each schedule "/vec=N" for the widths the
    target measured scales the kernel's in-cache loop work (vector_work) by that width's factor,
    over the same threads."""
    name = _BY_NAME[n["op"]]
    out = [evaluate_dim(d, largest) for d in shapes.get(cls, ())]

    def first_loop(dims) -> int:
        return next((d for d in dims if d > 1), 1)

    product = math.prod
    costs: dict[str, tuple[float, int]] = {}  # schedule -> (cost, threads sharing the work)
    if name == "gemm":
        work *= pool.gemm_mac / GEMM_WEIGHT  # the target's BLAS rate, not extraction's flat weight
        axis = _literal(nodes[n["children"][2]])
        dims = [d for j, d in enumerate(out) if j != axis]  # batch.., M, N (N last)
        m, cols = product(dims[:-1]), dims[-1] if dims else 1
        depth = evaluate_dim(shapes.get(nodes[n["children"][0]]["eclass"], out)[axis], largest)
        # the pool shares blocks of at least GEMM_BLOCK_ROWS rows; then each thread's rows go
        # through BLAS a tile at a time (no tile: the codegen's, DEFAULT_GEMM_TILE rows on the pool)
        for head, threads, fixed in (("serial", 1, pool.serial_overhead),
                                     ("parallel", max(1, min(pool.threads, m // GEMM_BLOCK_ROWS)),
                                      pool.parallel_overhead)):
            for tile in (0,) + GEMM_TILES:
                calls, units = gemm_tile_extra(-(-m // threads), cols, depth,
                                               tile or (DEFAULT_GEMM_TILE if head == "parallel" else 0))
                costs[head + (f"/tile={tile}" if tile else "")] = (work / threads + calls * pool.serial_overhead
                                                                   + units + fixed, threads)
        vector_work = product(out) * pool.cached  # an epilogue (assumed: fusion comes later) on C in cache
    else:
        if name == "attention":
            axis = _literal(nodes[n["children"][3]])
            dims = [d for j, d in enumerate(out) if j != axis]  # batch.., M, D
            batch, m, d = product(dims[:-2]), dims[-2] if len(dims) > 1 else 1, dims[-1] if dims else 1
            p_class, v_class = nodes[n["children"][0]]["eclass"], nodes[n["children"][2]]["eclass"]
            p_elements = product(evaluate_dim(x, largest) for x in shapes.get(p_class, ()))
            keys = max(1, p_elements // max(1, batch * m))
            # P · V at the target's BLAS rate, less what never writing nor reading P saves
            macs = product(evaluate_dim(x, largest) for x in shapes.get(v_class, ()))
            work = max(0.0, macs * pool.gemm_mac - ATTENTION_SAVING * p_elements)
            orders = {}
            for t in ATTENTION_TILES:
                calls, cold = attention_tile_extra(batch, m, keys, d, t)
                # the pool shares the tiles, their BLAS calls and cache misses
                orders[f"/tile={t}"] = (work + calls * pool.serial_overhead + cold, batch * -(-m // t), None)
            vector_work = p_elements * pool.cached  # the softmax on each tile's scores
        elif name in ("sum_reduce", "max_reduce"):
            axis = _literal(nodes[n["children"][1]])
            inner = product(out[axis + 1:])
            orders = {"": (work * order_factor(inner, False), first_loop(out), product(out))}
            if inner > 1:  # the axes after the reduced one: the default order's stride
                orders["/axis-outer"] = (work * order_factor(inner, True), first_loop(out[:axis]), product(out[:axis]))
            vector_work = work if width_matters(int(work) * 4) else 0.0
        else:  # row kernels: the row axis is not looped over outside
            axis = _literal(nodes[n["children"][1]])
            rows = [d for j, d in enumerate(out) if j != axis]
            orders = {"": (work, first_loop(rows), product(rows))}
            vector_work = work  # each row's later passes read it from cache
        for order, (w, usable, collapsed) in orders.items():
            costs["serial" + order] = (w + pool.serial_overhead, 1)
            threads = max(1, min(pool.threads, usable))
            costs["parallel" + order] = (w / threads + pool.parallel_overhead, threads)
            if collapsed is not None:
                threads = max(1, min(pool.threads, collapsed))
                costs["parallel" + order + "/collapse"] = (w / threads + pool.parallel_overhead, threads)
    priced = {schedule: cost for schedule, (cost, _) in costs.items()}
    for bits, factor in pool.vector:
        for schedule, (cost, threads) in costs.items():
            # ties go to LLVM's own width: it asks for nothing
            priced[f"{schedule}/vec={bits}"] = cost + vector_work * (factor - 1.0) / threads + VECTOR_TIE
    return priced


def _weight_only(g: Graph, enc: _Encoder, nodes: dict, classes: dict[str, list[str]],
                 elements: dict[str, int]) -> set[str]:
    """The e-nodes computed from weights and constants alone, at a static shape no larger than
    all the weights together: the optimizer hoists them out of the program (fold.py), so they
    cost nothing per run."""
    limit = sum(evaluate_dim(numel(t.shape), {}) for t in g.weights if all(isinstance(d, int) for d in t.shape))
    static = {c for c in classes if c in elements}
    ok_class: set[str] = set()
    ok_node: set[str] = set()
    changed = True
    while changed:
        changed = False
        for cls, members in classes.items():
            for nid in members:
                if nid in ok_node:
                    continue
                n = nodes[nid]
                name = _BY_NAME[n["op"]]
                if name in ("input", "iota", "merged_weight", "scheduled", "output"):
                    continue
                if name not in ("weight", "const") and (cls not in static or elements[cls] > limit):
                    continue
                if name == "view" and not all(isinstance(d, int) for d in enc.specs[_literal(
                        nodes[n["children"][1]])].shape):
                    continue
                kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["op"] in _BY_NAME]
                if all(k in ok_class for k in kids):
                    ok_node.add(nid)
                    ok_class.add(cls)
                    changed = True
    return ok_node


KERNEL_CALL_COST = 2000.0  # a GEMM call's fixed cost, in element units: what sharing one GEMM saves
NODE_COST = 0.01  # per op of the program: between programs of equal work, the one with fewer ops


def _share(nodes: dict, classes: dict[str, list[str]], choice: dict[str, str], own: dict[str, float],
           folded: set[str], roots: list[str]) -> dict[str, str]:
    """Improve the per-e-class choice where e-classes can share one value: for each e-class S read
    through views by several e-classes (a merged GEMM's slices), choose those views for all of
    them at once, and keep the change when the whole program (each e-class counted once, each
    GEMM call at KERNEL_CALL_COST, each op at NODE_COST) gets cheaper."""
    def kids(nid):
        return [nodes[ch]["eclass"] for ch in nodes[nid]["children"] if nodes[ch]["eclass"] in classes]

    def dag_cost(ch: dict[str, str]) -> float:
        total, state, stack = 0.0, {}, [(r, False) for r in roots]
        while stack:
            c, done = stack.pop()
            if done:
                state[c] = 2
                continue
            if state.get(c) == 2:
                continue
            if state.get(c) == 1:
                return float("inf")  # a cycle through the new choices
            state[c] = 1
            nid = ch[c]
            total += own[nid]
            if nid not in folded:
                total += NODE_COST
                if _BY_NAME[nodes[nid]["op"]] in ("gemm", "attention"):
                    total += KERNEL_CALL_COST
            stack.append((c, True))
            stack.extend((k, False) for k in kids(nid) if state.get(k) != 2)
        return total

    readers: dict[str, list[tuple[str, str]]] = {}
    for cls, members in classes.items():
        for nid in members:
            if nodes[nid]["op"] == "Term.view":
                src = nodes[nodes[nid]["children"][0]]["eclass"]
                if src != cls:
                    readers.setdefault(src, []).append((cls, nid))
    # e-classes of GEMMs, and of elementwise epilogues on them (a merged GEMM's bias)
    gemms = {c for c, members in classes.items() if any(_BY_NAME[nodes[m]["op"]] in ("gemm", "attention")
                                                         for m in members)}
    epilogues = {c for c, members in classes.items() if any(
        nodes[m]["op"] in ("Term.add", "Term.mul") and set(kids(m)) & gemms for m in members)}
    shared = sorted(s for s, r in readers.items() if len({c for c, _ in r}) >= 2 and s in gemms | epilogues)
    cost = dag_cost(choice)
    for s in shared:
        trial = dict(choice)
        for cls, nid in readers[s]:
            trial[cls] = nid
        c = dag_cost(trial)
        if c < cost - 1e-9:
            choice, cost = trial, c
    return choice


def _extract(g: Graph, enc: _Encoder, ser: dict, pool: Optional[Pool] = None) -> Graph:
    nodes = ser["nodes"]
    classes: dict[str, list[str]] = {}
    for nid, n in nodes.items():
        if n["op"] in _BY_NAME and n["op"] != "Term.output":
            classes.setdefault(n["eclass"], []).append(nid)
    largest = {name: hi for name, _, hi in g.symbols}
    shapes = _class_shapes(g, enc, nodes, classes)
    elements = {c: evaluate_dim(numel(s), largest) for c, s in shapes.items()}
    folded = _weight_only(g, enc, nodes, classes, elements)
    own = {nid: 0.0 if nid in folded else _enode_cost(nodes[nid], cls, nodes, elements)
           for cls, members in classes.items() for nid in members}
    # a kernel whose e-class holds schedules costs its cheapest one, and is built with it
    schedule: dict[str, str] = {}
    for cls, members in classes.items():
        offered = {_literal(nodes[nodes[m]["children"][1]]) for m in members if nodes[m]["op"] == "Term.scheduled"}
        if not offered or pool is None:
            continue
        for nid in members:
            if _BY_NAME[nodes[nid]["op"]] in SCHEDULED and nid not in folded:
                costs = _schedule_costs(nodes[nid], cls, nodes, shapes, largest, own[nid], pool)
                usable = [s for s in costs if s in offered]
                if usable:
                    schedule[nid] = min(usable, key=lambda s: (costs[s], len(s), s))  # ties: the smaller tile
                    own[nid] = costs[schedule[nid]]
    best: dict[str, tuple[float, str]] = {}
    changed = True
    while changed:
        changed = False
        for cls, members in classes.items():
            for nid in members:
                n = nodes[nid]
                total = own[nid]
                ok = True
                for ch in n["children"]:
                    ccls = nodes[ch]["eclass"]
                    if ccls in classes:
                        if ccls not in best:
                            ok = False
                            break
                        total += best[ccls][0]
                if ok and (cls not in best or total < best[cls][0] - 1e-12):
                    best[cls] = (total, nid)
                    changed = True
    # Term.output(k, x) nodes mark the e-class of output k
    out_class = {_literal(nodes[n["children"][0]]): nodes[n["children"][1]]["eclass"]
                 for n in nodes.values() if n["op"] == "Term.output"}
    choice = _share(nodes, classes, {c: nid for c, (_, nid) in best.items()}, own, folded, list(out_class.values()))
    b = GraphBuilder()
    for t in g.inputs:
        b.input(t.name, t.shape, t.dtype)
    for t in g.weights:
        b.weight(t.name, t.shape, t.dtype)
    leaves = {t.name: t for t in list(g.inputs) + list(g.weights)}
    built: dict[str, int] = {}

    def build(cls: str) -> int:
        if cls in built:
            return built[cls]
        stack = [(cls, False)]
        while stack:
            c, ready = stack.pop()
            if c in built:
                continue
            nid = choice[c]
            n = nodes[nid]
            kids = [nodes[ch]["eclass"] for ch in n["children"] if nodes[ch]["eclass"] in classes]
            if not ready:
                stack.append((c, True))
                stack.extend((k, False) for k in kids if k not in built)
                continue
            built[c] = _rebuild(b, enc, leaves, n, nodes, [built[k] for k in kids])
            if nid in schedule:
                b.set_schedule(built[c], schedule[nid])
        return built[cls]

    outputs = []
    for k, o in enumerate(g.outputs):
        cls = out_class.get(k)
        if cls is None:
            raise RuntimeError(f"output %{o} lost its e-class during saturation")
        outputs.append(build(cls))
    return b.build(outputs, g.output_names, g.output_tree, g.symbols)


def _rebuild(b: GraphBuilder, enc: _Encoder, shapes, n: dict, nodes: dict, kids: list[int]) -> int:
    name = _BY_NAME[n["op"]]
    lits = [_literal(nodes[ch]) for ch in n["children"] if nodes[ch]["op"] not in _BY_NAME]
    if name in ("input", "weight"):
        t = shapes[lits[0]]
        return (b.input if name == "input" else b.weight)(t.name, t.shape, t.dtype)
    if name == "const":
        return b.const(float(lits[0]), DType(lits[1]))
    if name == "view":
        return b.view(kids[0], enc.specs[lits[0]])
    if name in ("exp2", "log2", "sin", "sqrt", "recip"):
        return b.unary(Op(name.capitalize() if name != "recip" else "Recip"), kids[0])
    if name in ("add", "mul", "mod", "less_than"):
        op = {"add": Op.ADD, "mul": Op.MUL, "mod": Op.MOD, "less_than": Op.LESS_THAN}[name]
        return b.binary(op, kids[0], kids[1])
    if name == "where":
        return b.where(*kids)
    if name in ("sum_reduce", "max_reduce"):
        return b.reduce(Op.SUM_REDUCE if name == "sum_reduce" else Op.MAX_REDUCE, kids[0], int(lits[0]))
    if name == "gemm":
        return b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, kids[0], kids[1]), int(lits[0]), kernel="gemm")
    if name == "softmax":
        return softmax_primitives(b, kids[0], int(lits[0]))
    if name == "rms_norm":
        return rms_norm_primitives(b, kids[0], int(lits[0]), float(lits[1]), float(lits[2]))
    if name == "layer_norm":
        return layer_norm_primitives(b, kids[0], int(lits[0]), float(lits[1]), float(lits[2]))
    if name == "attention":
        p = b.view(kids[0], enc.specs[lits[0]])
        return b.reduce(Op.SUM_REDUCE, b.binary(Op.MUL, p, kids[1]), int(lits[1]), kernel="attention")
    if name == "iota":
        return b.iota(enc.shapes[lits[0]], int(lits[1]), DType(lits[2]))
    if name == "gather":
        return b.gather(kids[0], kids[1], int(lits[0]))
    if name == "scatter":
        return b.scatter(kids[0], kids[1], kids[2], int(lits[0]))
    if name == "cast":
        return b.cast(kids[0], DType(lits[0]))
    raise ValueError(name)
