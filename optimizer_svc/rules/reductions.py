"""Reductions: constant scaling and shifting commute with reductions.

sum(x * c) = sum(x) * c and max(x + c) = max(x) + c for finite c, and max(x * c) = max(x) * c
for finite c > 0 (an infinite c turns 0 * inf into NaN on one side only):
the right-hand sides do the scalar work once per output element instead of once per input
element (softmax's max-subtraction, mean's 1/n and attention's scale all take this form).
The constant on the right is the same scalar broadcast to the reduced shape; its view is the
`reduce_view` table, filled from Python. sum(x + c) = sum(x) + n*c is not used: it changes
the rounding of large sums, for no saving that the first rule does not already give.

Merging reduced axes: a reduction over axis a of a reduction over an adjacent axis b is one
reduction over the two axes merged by a reshape (a mean over H and W is one loop over H*W,
the inner reduction's intermediate gone). The reshapes come from the `merge_in`, `merge_axis`
and `merge_out` tables, filled from Python for the shapes the graph's nodes have (`shape_of`).

Splitting a reduced axis is the same rewrite read backwards: a reduction whose result has too
few rows to share across the target's pool (a whole-tensor sum, a norm of one long row) is a
reduction over `parts` slices of its axis (each slice one row of a parallel loop) and then a
small one over the parts. It adds work (the parts' reduction) and changes a sum's order, as
torch's own vectorized sums do, so it only pays through the schedule it makes possible:
extraction prices the inner reduction's parallel schedule (rules/schedules.py) and keeps the
split only where that wins. Its reshapes come from the `split_in` and `split_out` tables,
entered from Python only when the search knows the target's pool (`split_parts`).
"""

from __future__ import annotations

from egglog import EGraph, String, eq, f64, i64, ne, rule, ruleset, set_, union, var

from kiln.ir import view as view_specs
from kiln.ir.ops import GroupOp
from optimizer_svc.encode import Facts
from optimizer_svc.terms import Term, merge_axis, merge_in, merge_out, reduce_view, shape_of, split_in, split_out

reductions = ruleset(name="reductions")

_x, _e = var("x", Term), var("e", Term)
_a = var("a", f64)
_d, _s, _r = var("d", String), var("s", String), var("r", String)
_k, _j, _m = var("k", i64), var("j", i64), var("m", i64)
_sh, _si, _so = var("sh", String), var("si", String), var("so", String)


def _bcast(spec):
    return Term.view(Term.const(_a, _d), spec)


def _commute(reduce, op, const_first: bool, *conds):
    """reduce(op(x, c), k) = op(reduce(x, k), c reduced), for a finite non-bool scalar c."""
    lhs = reduce(op(_bcast(_s), _x) if const_first else op(_x, _bcast(_s)), _k)
    return rule(eq(_e).to(lhs), eq(_r).to(reduce_view(_s, _k)), ne(_d).to(String("bool")),
                _a < f64(float("inf")), _a > f64(float("-inf")), *conds
                ).then(union(_e).with_(op(reduce(_x, _k), _bcast(_r))))


reductions.register(
    _commute(Term.sum_reduce, Term.mul, False), _commute(Term.sum_reduce, Term.mul, True),
    _commute(Term.max_reduce, Term.add, False), _commute(Term.max_reduce, Term.add, True),
    _commute(Term.max_reduce, Term.mul, False, _a > f64(0.0)),
    _commute(Term.max_reduce, Term.mul, True, _a > f64(0.0)),
    *(rule(eq(_e).to(reduce(reduce(_x, _k), _j)), eq(_sh).to(shape_of(_x)), eq(_si).to(merge_in(_sh, _k, _j)),
           eq(_m).to(merge_axis(_sh, _k, _j)), eq(_so).to(merge_out(_sh, _k, _j)))
      .then(union(_e).with_(Term.view(reduce(Term.view(_x, _si), _m), _so)))
      for reduce in (Term.sum_reduce, Term.max_reduce)),
    *(rule(eq(_e).to(reduce(_x, _k)), eq(_sh).to(shape_of(_x)), eq(_si).to(split_in(_sh, _k)),
           eq(_so).to(split_out(_sh, _k)))
      .then(union(_e).with_(Term.view(reduce(reduce(Term.view(_x, _si), _k + 1), _k), _so)))
      for reduce in (Term.sum_reduce, Term.max_reduce)),
)

SPLIT_MIN = 1 << 14  # elements per part: below this a part's loop is too short to repay the pool


def split_parts(shape, axis: int, threads: int):
    """How many parts to split reduced `axis` of a static `shape` into, or None: only when the
    reduction's result gives the pool no outer loop (its first dim of more than one element,
    if any, is shorter than the pool) and the axis divides into at least `threads` parts of
    at least SPLIT_MIN elements each; the most such parts up to 4 per thread."""
    if not all(isinstance(d, int) for d in shape) or threads <= 1:
        return None
    outer = next((d for j, d in enumerate(shape) if j != axis and d > 1), 1)
    n = shape[axis]
    if outer >= threads or n < threads * SPLIT_MIN:
        return None
    parts = [p for p in range(threads, 4 * threads + 1) if n % p == 0 and n // p >= SPLIT_MIN]
    return parts[-1] if parts else None


class ReductionFacts(Facts):
    """The reshapes that merge a reduction of a reduction's adjacent axes (merge_in, merge_axis,
    merge_out) and, when the pool is known, split a reduced axis into parts (split_in, split_out)."""

    def encode(self, eg, g, i, refs, pool) -> None:
        n = g.nodes[i]
        if n.op not in GroupOp.Reduce:
            return
        inner = g.nodes[n.inputs[0]]
        if inner.op is n.op:  # a reduction of a reduction
            self.register_merge(eg, refs[inner.inputs[0]], g.nodes[inner.inputs[0]].shape, inner.axis, n.axis)
        if pool is not None:
            self.register_split(eg, refs[n.inputs[0]], inner.shape, n.axis, pool.threads)

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
                    set_(merge_in(key, a, b)).to(String(self.enc.spec_key(view_specs.reshape(tuple(shape), merged)))),
                    set_(merge_axis(key, a, b)).to(i64(lo)),
                    set_(merge_out(key, a, b)).to(String(self.enc.spec_key(view_specs.reshape(reduced, out)))))

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
                    set_(split_in(key, axis)).to(String(self.enc.spec_key(view_specs.reshape(shape, split)))),
                    set_(split_out(key, axis)).to(String(self.enc.spec_key(view_specs.reshape(reduced, out)))))
