"""Attention: softmax(scores) · V as one fused kernel, reached from the primitive form.

A GEMM (rules/matmul.py) whose left operand is a view of probabilities P along the keys is
attention: P · V. P is a softmax (rules/norms.py) of the scores, or a softmax whose fully
masked rows are zeroed (where(c, 0, softmax(S)), as the importer lowers scaled_dot_product_attention).
The rule adds `Term.attention` to the GEMM's e-class; extraction rebuilds the GEMM and marks it
`Node.kernel = "attention"`. The partition then computes the scores GEMM
(Q · Kᵀ with its scale and mask), the softmax and P · V a tile of query rows at a time, in one
kernel, so neither the scores nor the probabilities are written to memory (flash-attention
style), when their layouts line up (partition._fuse_attention checks them).

The same kernel serves any GEMM that reads a row kernel's result (an RMS or layer norm, with
its affine weight and bias) along its contracted axis: a transformer's final norm and its LM
head are one kernel too. `row_result` is what such a GEMM may read.
"""

from __future__ import annotations

from egglog import String, eq, f64, i64, rule, ruleset, union, var

from optimizer_svc.terms import Term, row_result

attention = ruleset(name="attention")

_s, _p, _q, _c, _v, _w, _e = (var(n, Term) for n in ("s", "p", "q", "c", "v", "w", "e"))
_a, _k = var("a", i64), var("k", i64)
_n, _eps = var("n", f64), var("eps", f64)
_d, _sp, _z, _sw = var("d", String), var("sp", String), var("z", String), var("sw", String)

attention.register(
    rule(eq(_p).to(Term.softmax(_s, _a))).then(row_result(_p, _a)),
    rule(eq(_p).to(Term.rms_norm(_s, _a, _n, _eps))).then(row_result(_p, _a)),
    rule(eq(_p).to(Term.layer_norm(_s, _a, _n, _eps))).then(row_result(_p, _a)),
    # fully masked rows zeroed; a norm's affine weight and bias
    rule(eq(_p).to(Term.where(_c, Term.view(Term.const(0.0, _d), _z), _q)), row_result(_q, _a))
    .then(row_result(_p, _a)),
    *(rule(eq(_p).to(op(*args)), row_result(_q, _a)).then(row_result(_p, _a))
      for op in (Term.mul, Term.add) for args in ((_q, Term.view(_w, _sw)), (Term.view(_w, _sw), _q))),
    rule(eq(_e).to(Term.gemm(Term.view(_p, _sp), _v, _k)), row_result(_p, _a))
    .then(union(_e).with_(Term.attention(_p, _sp, _v, _k))),
)
