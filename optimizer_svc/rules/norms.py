"""Softmax and norms: recognise softmax, RMS norm and layer norm as row kernels.

Each is a few reductions along one axis read back along that axis by elementwise work; computed
as one kernel per row (each reduction's loop, then the row's outputs) it reads its input from
memory once and writes only its result. The rules name the primitive forms the importer lowers
them to (kiln/ir/compose.py, their one definition) with `Term.softmax`, `Term.rms_norm` and
`Term.layer_norm` e-nodes in the same e-class, so the search can choose them; extraction
rebuilds them with the same compose functions (the `*_primitives` below) and marks the row's
root with `Node.kernel = "row"` for the partition. The rules' left-hand sides are these
compositions as patterns; tests/unit check each pattern against its composition.

A reduction's result is read back along its axis through a view that broadcasts it there
(`row_bcast`, filled from Python for the specs the graph contains). RMS norm is
x * rsqrt(mean(x*x) + eps) in either operand order; layer norm is an RMS norm of x - mean(x);
softmax is exp(x - max(x)) / sum(exp(x - max(x))). Affine weights and biases stay elementwise
work on the row's result, fused by the partition like any other.
"""

from __future__ import annotations

from egglog import String, eq, f64, i64, rule, ruleset, union, var

from kiln.ir import compose
from optimizer_svc.terms import Term, row_bcast

norms = ruleset(name="norms")


_x, _e, _r = var("x", Term), var("e", Term), var("r", Term)
_a = var("a", i64)
_n, _eps = var("n", f64), var("eps", f64)
_d = var("d", String)
_s1, _s2, _s3, _c1, _c2, _c3, _c4 = (var(v, String) for v in ("s1", "s2", "s3", "c1", "c2", "c3", "c4"))


def _scalar(value, spec):
    return Term.view(Term.const(value, _d), spec)


def _back(r, spec, viewed: bool):
    """A row value r read back along the row: through a broadcasting view, or directly where
    the axis has size 1 and the importer needed no view."""
    return Term.view(r, spec) if viewed else r


def _rstd(x, viewed: bool):
    """rsqrt(mean(x*x) + eps) along _a, read back along it."""
    mean_sq = Term.mul(Term.sum_reduce(Term.mul(x, x), _a), _scalar(_n, _c1))
    return _back(Term.recip(Term.sqrt(Term.add(mean_sq, _scalar(_eps, _c2)))), _s1, viewed)


def _exp(max_viewed: bool):
    shifted = Term.add(_x, Term.mul(_back(Term.max_reduce(_x, _a), _s1, max_viewed), _scalar(-1.0, _c1)))
    return Term.exp2(Term.mul(shifted, _scalar(compose.LOG2_E, _c2)))


def _softmax(max_viewed: bool, sum_viewed: bool):
    e = _exp(max_viewed)
    conds = [row_bcast(s, _a) for s, v in ((_s1, max_viewed), (_s2, sum_viewed)) if v]
    return rule(eq(_e).to(Term.mul(e, _back(Term.recip(Term.sum_reduce(e, _a)), _s2, sum_viewed))), *conds
                ).then(union(_e).with_(Term.softmax(_x, _a)))


def _rms(x_first: bool, viewed: bool):
    lhs = Term.mul(_x, _rstd(_x, viewed)) if x_first else Term.mul(_rstd(_x, viewed), _x)
    conds = [row_bcast(_s1, _a)] if viewed else []
    return rule(eq(_e).to(lhs), *conds).then(union(_e).with_(Term.rms_norm(_x, _a, _n, _eps)))


_centered = Term.add(_x, Term.mul(Term.view(Term.mul(Term.sum_reduce(_x, _a), _scalar(_n, _c3)), _s3),
                                  _scalar(-1.0, _c4)))

norms.register(
    *(_softmax(m, v) for m in (True, False) for v in (True, False)),
    *(_rms(first, v) for first in (True, False) for v in (True, False)),
    rule(eq(_e).to(Term.rms_norm(_r, _a, _n, _eps)), eq(_r).to(_centered), row_bcast(_s3, _a))
    .then(union(_e).with_(Term.layer_norm(_x, _a, _n, _eps))),
)


def softmax_primitives(b, x: int, axis: int) -> int:
    return compose.softmax(b, x, axis, kernel="row")


def rms_norm_primitives(b, x: int, axis: int, inv_n: float, eps: float) -> int:
    return compose.rms_norm(b, x, [axis], eps, inv_n, kernel="row")


def layer_norm_primitives(b, x: int, axis: int, inv_n: float, eps: float) -> int:
    return compose.layer_norm(b, x, [axis], eps, inv_n, kernel="row")[0]
