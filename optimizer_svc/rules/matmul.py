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

from egglog import String, eq, i64, rule, ruleset, union, var

from kiln.ir import view as view_specs
from kiln.ir.shape import contiguous_strides, is_static, numel
from kiln.ir.view import ViewSpec
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
