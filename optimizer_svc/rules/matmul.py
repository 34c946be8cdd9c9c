"""Matmul: recognise a broadcast Mul reduced by a SumReduce as a GEMM.

sum_k(view(a) * view(b)) is a GEMM when the two views vary along disjoint sets of the other
axes (a's rows M, b's columns N, both along batch axes) and both vary along k. Which view pairs
qualify is decided from their strides in Python (`gemm_layout`, filled as new pairs appear),
and the rule adds the `Term.gemm` e-node to the reduction's e-class. Extraction weighs a GEMM's
multiply-adds at a quarter of a generated loop's (BLAS), so it is chosen where it exists, and
the rebuilt SumReduce carries the choice (`Node.kernel = "gemm"`) for the partition.

Transposes fold into the GEMM through the views rules: a transpose of an operand composes with
the broadcast that feeds the Mul into one view, whose strides the GEMM reads directly.
"""

from __future__ import annotations

from egglog import String, eq, i64, rule, ruleset, union, var

from kiln.ir.view import ViewSpec
from optimizer_svc.terms import Term, gemm_layout

matmul = ruleset(name="matmul")

_x, _y, _e = var("x", Term), var("y", Term), var("e", Term)
_sa, _sb = var("sa", String), var("sb", String)
_k = var("k", i64)

matmul.register(
    rule(eq(_e).to(Term.sum_reduce(Term.mul(Term.view(_x, _sa), Term.view(_y, _sb)), _k)), gemm_layout(_sa, _sb, _k))
    .then(union(_e).with_(Term.gemm(Term.view(_x, _sa), Term.view(_y, _sb), _k))),
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

