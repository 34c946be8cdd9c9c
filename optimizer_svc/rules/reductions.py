"""Reductions: constant scaling and shifting commute with reductions.

sum(x * c) = sum(x) * c and max(x + c) = max(x) + c for finite c, and max(x * c) = max(x) * c
for finite c > 0 (an infinite c turns 0 * inf into NaN on one side only):
the right-hand sides do the scalar work once per output element instead of once per input
element (softmax's max-subtraction, mean's 1/n and attention's scale all take this form).
The constant on the right is the same scalar broadcast to the reduced shape; its view is the
`reduce_view` table, filled from Python. sum(x + c) = sum(x) + n*c is not used: it changes
the rounding of large sums, for no saving that the first rule does not already give.
"""

from __future__ import annotations

from egglog import String, eq, f64, i64, ne, rule, ruleset, union, var

from optimizer_svc.terms import Term, reduce_view

reductions = ruleset(name="reductions")

_x, _e = var("x", Term), var("e", Term)
_a = var("a", f64)
_d, _s, _r = var("d", String), var("s", String), var("r", String)
_k = var("k", i64)


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
)
