"""Matmul: recognise a broadcast Mul reduced by a SumReduce as a GEMM.

sum_k(view(a) * view(b)) is a GEMM when the two views vary along disjoint sets of the other
axes (a's rows M, b's columns N, both along batch axes) and both vary along k. Which view pairs
qualify is decided from their strides in Python (`gemm_layout`, filled as new pairs appear),
and the rule adds the `Term.gemm` e-node to the reduction's e-class. Extraction weighs a GEMM's
multiply-adds at a quarter of a generated loop's (BLAS), so it is chosen where it exists, and
the rebuilt SumReduce carries the choice (`Node.kernel = "gemm"`) for the partition.

Transposes fold into the GEMM through the views rules: a transpose of an operand composes with
the broadcast that feeds the Mul into one view, whose strides the GEMM reads directly.

Merging GEMMs that share an operand (Q/K/V, gate/up): GEMMs of one operand e-class against
weights that differ only in their first (N) axis are one GEMM against the weights concatenated
along it, each member's result a slice of the merged result; biases added to the members'
results are one bias, their concatenation, added to the merged result (so it stays the GEMM's
epilogue). The groups are found in Python from the e-graph (`gemm_merge`, `bias_member`) and
their views entered as tables; the rule then rewrites each
member. The concatenation is weight-only work: extraction prices it at nothing and the optimizer
hoists it out of the program, to be done once when a session loads its weights. A merged GEMM
pays off only through sharing (one call, the shared operand read once), which a per-e-class
extraction cannot see: extraction tries each shared e-class for all its readers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from egglog import EGraph, String, eq, i64, rule, ruleset, set_, union, var

from kiln.ir import view as view_specs
from kiln.ir.shape import contiguous_strides, is_static, numel
from kiln.ir.view import ViewSpec
from optimizer_svc.encode import Facts, literal
from optimizer_svc.terms import (Term, bias_group, gemm_layout, member_slice, merge_group, merged_bias,
                                 merged_bias_view, merged_operand, merged_weight, merged_weight_view)

matmul = ruleset(name="matmul")

_x, _y, _e = var("x", Term), var("y", Term), var("e", Term)
_sa, _sb = var("sa", String), var("sb", String)
_k = var("k", i64)
_w, _g, _ma, _mb, _sl, _bc, _h = (var(n, String) for n in ("w", "g", "ma", "mb", "sl", "bc", "h"))
_p = var("p", Term)


def _sides(shared, weight, side: int):
    """A GEMM's operands with the weight at position `side`."""
    return (weight, shared) if side == 0 else (shared, weight)


matmul.register(
    rule(eq(_e).to(Term.sum_reduce(Term.mul(Term.view(_x, _sa), Term.view(_y, _sb)), _k)), gemm_layout(_sa, _sb, _k))
    .then(union(_e).with_(Term.gemm(Term.view(_x, _sa), Term.view(_y, _sb), _k))),
    *(rule(eq(_e).to(Term.gemm(*_sides(_x, Term.view(Term.weight(_w), _sb), side), _k)),
           eq(_g).to(merge_group(_w, _sb, _k, side)), eq(_ma).to(merged_operand(_g, _w)),
           eq(_mb).to(merged_weight_view(_g)), eq(_sl).to(member_slice(_g, _w)))
      .then(union(_e).with_(Term.view(Term.gemm(*_sides(Term.view(_x, _ma), Term.view(merged_weight(_g), _mb), side),
                                                _k), _sl)))
      for side in (0, 1)),
    # a bias on each member's slice is one bias on the merged result (the GEMM's epilogue)
    *(rule(eq(_e).to(Term.add(*_sides(Term.view(_x, _sl), Term.view(Term.weight(_w), _bc), side))),
           eq(_x).to(Term.gemm(*_sides(_p, Term.view(merged_weight(_g), _mb), gside), _k)),
           eq(_h).to(bias_group(_g, _sl, _w, _bc)), eq(_ma).to(merged_bias_view(_h)))
      .then(union(_e).with_(Term.view(Term.add(*_sides(_x, Term.view(merged_bias(_h), _ma), side)), _sl)))
      for side in (0, 1) for gside in (0, 1)),
)


def is_gemm_layout(a: ViewSpec, b: ViewSpec, k: int) -> bool:
    """Whether sum over axis k of view a times view b is a GEMM: both vary along k, every other
    axis of size > 1 varies in at least one, and some axis varies in only one (M or N)."""
    if len(a.shape) != len(b.shape) or tuple(a.shape) != tuple(b.shape) or not 0 <= k < len(a.shape):
        return False
    if a.strides[k] == 0 or b.strides[k] == 0:
        return False
    one_sided = False
    for j, d in enumerate(a.shape):
        if j == k or d == 1:
            continue
        va, vb = a.strides[j] != 0, b.strides[j] != 0
        if not (va or vb):
            return False
        one_sided |= va != vb
    return one_sided



@dataclass(frozen=True)
class GemmMember:
    weight: str         # a weight leaf's name
    weight_shape: tuple
    spec: ViewSpec      # the GEMM's view of the weight
    axis: int           # the reduced axis
    side: int           # the weight's operand position
    shared: ViewSpec    # the other operand's view of its source (one source for the whole group)


@dataclass(frozen=True)
class GemmMerge:
    name: str
    members: tuple[GemmMember, ...]  # in concatenation order
    n_axis: int
    operand: dict        # weight name -> view of a member's shared operand at the merged shape
    weight_view: ViewSpec
    slices: dict         # weight name -> view of the merged result
    pads: dict           # weight name -> zero-padding view of the weight to the concatenated shape
    result: tuple        # the merged GEMM's result shape
    starts: dict         # weight name -> its first column along n_axis


def _n_axis(m: GemmMember):
    """The axis along which the weight's view varies and the shared operand does not (stride 0
    there in the broadcast): the weight's first axis, which the concatenation extends."""
    v, w = m.spec, m.weight_shape
    if v.mask is not None or v.offset != 0 or not is_static(v.shape) or not is_static(w) or len(w) < 1:
        return None
    rest = 1
    for d in w[1:]:
        rest *= d
    axes = [j for j, (d, st) in enumerate(zip(v.shape, v.strides)) if j != m.axis and st == rest and d == w[0]]
    if len(axes) != 1:
        return None
    n = axes[0]
    # the other axes read within one row of the weight
    if sum((d - 1) * st for j, (d, st) in enumerate(zip(v.shape, v.strides)) if j != n) >= max(rest, 1):
        return None
    return n


def gemm_merge(name: str, members: list[GemmMember]):
    """The merge of GEMMs of one shared operand against the given weights, or None when they do
    not differ only along the weight's first axis."""
    if len(members) < 2 or len({m.weight for m in members}) != len(members):
        return None
    first = members[0]
    n = _n_axis(first)
    if n is None:
        return None
    for m in members:
        if (_n_axis(m) != n or m.axis != first.axis or m.side != first.side
                or tuple(m.weight_shape[1:]) != tuple(first.weight_shape[1:])
                or m.spec.strides != first.spec.strides
                or m.shared.mask is not None or m.shared.strides[n] != 0
                or m.shared.strides != first.shared.strides or m.shared.offset != first.shared.offset
                or any(a != b for j, (a, b) in enumerate(zip(m.shared.shape, first.shared.shape)) if j != n)
                or any(a != b for j, (a, b) in enumerate(zip(m.spec.shape, first.spec.shape)) if j != n)):
            return None
    total = sum(m.weight_shape[0] for m in members)
    wide = tuple(total if j == n else d for j, d in enumerate(first.spec.shape))
    result = tuple(1 if j == first.axis else d for j, d in enumerate(wide))
    rstrides = contiguous_strides(result)
    operand, slices, pads, starts, start = {}, {}, {}, {}, 0
    for m in members:
        shape = tuple(m.spec.shape)
        # the shared operand is constant along n: read its index 0 there
        st = tuple(0 if j == n else s for j, s in enumerate(contiguous_strides(shape)))
        operand[m.weight] = ViewSpec(wide, st)
        slices[m.weight] = ViewSpec(tuple(1 if j == m.axis else d for j, d in enumerate(shape)), rstrides,
                                    start * rstrides[n])
        rows = m.weight_shape[0]
        starts[m.weight] = start
        pads[m.weight] = view_specs.pad(tuple(m.weight_shape),
                                        ((start, total - start - rows),) + ((0, 0),) * (len(m.weight_shape) - 1))
        start += rows
    return GemmMerge(name, tuple(members), n, operand, ViewSpec(wide, first.spec.strides), slices, pads,
                     result, starts)


MAX_BIAS_CHECK = 1 << 22  # elements of a view checked index by index for reading a member's bias


def bias_member(merge: GemmMerge, view: ViewSpec, bias_view: ViewSpec, length: int):
    """The member whose bias a 1-D weight of `length` is, when added through `bias_view` to the
    merged result read through `view`: every element read lies in that member's columns and
    meets the bias element of its own column. None otherwise (checked index by index)."""
    if (view.mask is not None or bias_view.mask is not None or not is_static(view.shape)
            or tuple(view.shape) != tuple(bias_view.shape) or not is_static(view.strides)
            or not is_static(bias_view.strides) or not isinstance(view.offset, int)
            or not isinstance(bias_view.offset, int) or numel(view.shape) > MAX_BIAS_CHECK):
        return None
    idx = np.indices(tuple(view.shape), dtype=np.int64).reshape(len(view.shape), -1)
    flat = view.offset + np.asarray(view.strides, dtype=np.int64) @ idx
    at = bias_view.offset + np.asarray(bias_view.strides, dtype=np.int64) @ idx
    size = numel(merge.result)
    if flat.size == 0 or flat.min() < 0 or flat.max() >= size:
        return None
    col = (flat // contiguous_strides(merge.result)[merge.n_axis]) % merge.result[merge.n_axis]
    for m in merge.members:
        start, rows = merge.starts[m.weight], m.weight_shape[0]
        if rows == length and col.min() >= start and col.max() < start + rows and np.array_equal(col - start, at):
            return m.weight
    return None


def merged_bias_tables(merge: GemmMerge, biases: dict) -> "dict | None":
    """For one bias weight per member (member weight -> (bias name, length)), the zero-padding
    views that concatenate them and their view over the merged result; None unless every
    member has its own bias."""
    if set(biases) != {m.weight for m in merge.members} or len({b for b, _ in biases.values()}) != len(biases):
        return None
    total = merge.result[merge.n_axis]
    pads = {}
    for m in merge.members:
        name, length = biases[m.weight]
        start = merge.starts[m.weight]
        pads[name] = view_specs.pad((length,), ((start, total - start - length),))
    strides = tuple(1 if j == merge.n_axis else 0 for j in range(len(merge.result)))
    return {"pads": pads, "view": ViewSpec(tuple(merge.result), strides)}


class MatmulFacts(Facts):
    """gemm_layout for each Mul-of-views pair a SumReduce reads; the tables of each group of GEMMs
    of one operand against weights (merge_group, merged_operand, member_slice, merged_weight_view)
    and of their biases (bias_group, merged_bias_view)."""

    def __init__(self, enc):
        super().__init__(enc)
        self.gemm_checked: set[tuple[str, str, int]] = set()
        self.merged: set[tuple] = set()  # (weight, spec, axis, side) already in a GEMM merge group
        self.merges = 0
        self.merge_info: dict[str, GemmMerge] = {}  # group name -> its merge
        self.bias_merged: dict[str, dict] = {}  # group -> member weight -> its bias weight
        self.bias_entries: set[tuple] = set()
        self.groups: dict[tuple, list[GemmMember]] = {}  # this iteration's GEMMs against a weight
        self.weight_shape = {t.name: tuple(t.shape) for t in enc.g.weights}

    def see(self, eg, view, n) -> bool:
        nodes, enc = view.nodes, self.enc
        if n["op"] == "Term.gemm":
            # GEMMs against a weight, by the source of their other operand's broadcast view
            weight_shape = self.weight_shape
            kids = [view.eclass(c) for c in n["children"][:2]]
            axis = view.literal(n["children"][2])
            for side in (0, 1):
                for w, k in view.weight_views(kids[side]):
                    if w not in weight_shape:
                        continue
                    for m in view.by_class.get(kids[1 - side], []):
                        if m["op"] != "Term.view" or view.literal(m["children"][1]) not in enc.specs:
                            continue
                        shared = enc.specs[view.literal(m["children"][1])]
                        group = self.groups.setdefault((nodes[m["children"][0]]["eclass"], axis, side), [])
                        if all(x.weight != w for x in group):
                            group.append(GemmMember(w, weight_shape[w], enc.specs[k], axis, side, shared))
            return False
        added = False
        if n["op"] == "Term.sum_reduce":
            axis = view.literal(n["children"][1])
            for m in view.by_class.get(view.eclass(n["children"][0]), []):
                if m["op"] == "Term.mul":
                    ca, cb = (view.eclass(c) for c in m["children"])
                    for sa in view.view_specs(ca):
                        for sb in view.view_specs(cb):
                            added |= self.register_gemm_layout(eg, sa, sb, axis)
        return added

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
                              set_(merged_operand(merge.name, m.weight)).to(String(self.enc.spec_key(merge.operand[m.weight]))),
                              set_(member_slice(merge.name, m.weight)).to(String(self.enc.spec_key(merge.slices[m.weight])))]
                facts.append(set_(merged_weight_view(merge.name)).to(String(self.enc.spec_key(merge.weight_view))))
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
            facts += [union(merged_bias(name)).with_(self._sum_of([Term.view(Term.weight(b), self.enc.spec_key(v))
                                                                   for b, v in tables["pads"].items()])),
                      set_(merged_bias_view(name)).to(String(self.enc.spec_key(tables["view"])))]
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
        return self._sum_of([Term.view(Term.weight(m.weight), self.enc.spec_key(merge.pads[m.weight]))
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
        if not is_gemm_layout(self.enc.specs[a], self.enc.specs[b], axis):
            return False
        eg.register(gemm_layout(a, b, axis))
        return True

    def finish(self, eg, view) -> bool:
        groups, self.groups = self.groups, {}
        added = self.register_gemm_merges(eg, groups)
        return self._register_bias_merges(eg, view) | added

    def _register_bias_merges(self, eg, view) -> bool:
        """For each merged GEMM whose members' results each get a bias weight added (through any
        views), enter the tables of the merged bias (rules/matmul.py)."""
        if not self.merge_info:
            return False
        nodes, by_class, enc, weight_shape = view.nodes, view.by_class, self.enc, self.weight_shape
        group_of_class = {n["eclass"]: literal(nodes[n["children"][0]]) for n in nodes.values()
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
                spec = literal(nodes[n["children"][1]])
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
                        if m["op"] != "Term.view" or literal(nodes[m["children"][1]]) not in enc.specs:
                            continue
                        bc = literal(nodes[m["children"][1]])
                        for leaf in by_class.get(nodes[m["children"][0]]["eclass"], []):
                            b = literal(nodes[leaf["children"][0]]) if leaf["op"] == "Term.weight" else None
                            if b not in weight_shape or len(weight_shape[b]) != 1:
                                continue
                            w = bias_member(self.merge_info[group], enc.specs[sv], enc.specs[bc], weight_shape[b][0])
                            if w is not None:
                                entry = found.setdefault(group, {}).setdefault(w, (b, weight_shape[b][0], []))
                                if entry[0] == b:
                                    entry[2].append((sv, bc))
        added = False
        for group, members in found.items():
            added |= self.register_bias_merge(eg, group, members)
        return added
