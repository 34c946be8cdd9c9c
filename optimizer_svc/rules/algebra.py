"""Algebra: identities, constant folding (arithmetic, comparisons, selects on a constant
condition), folding of scalar constant chains, and distributing a shared scalar factor.

Constants are scalars broadcast by a View; a rule that folds two constants requires both to
be broadcast by the same spec, so the folded constant has the same shape. Bool constants are
never folded arithmetically (Add/Mul on bool mean or/and).
"""

from __future__ import annotations

from egglog import String, eq, f64, i64, ne, rewrite, rule, ruleset, union, var

from optimizer_svc.terms import Term, nonneg, unit_bounded

algebra = ruleset(name="algebra")

x, y = var("x", Term), var("y", Term)
a, b = var("a", f64), var("b", f64)
d, s = var("d", String), var("s", String)
e = var("e", Term)


def bcast(value, dtype=d, spec=s):
    return Term.view(Term.const(value, dtype), spec)


def _not_nan(*values):
    return [v <= f64(float("inf")) for v in values]


algebra.register(
    # identities
    rewrite(Term.mul(x, bcast(1.0))).to(x),
    rewrite(Term.mul(bcast(1.0), x)).to(x),
    rewrite(Term.add(x, bcast(0.0))).to(x),
    rewrite(Term.add(bcast(0.0), x)).to(x),
    rewrite(Term.recip(Term.recip(x))).to(x),
    rule(eq(e).to(Term.log2(Term.exp2(x))), unit_bounded(x)).then(union(e).with_(x)),
    rule(eq(e).to(Term.exp2(Term.log2(x))), nonneg(x)).then(union(e).with_(x)),
    # constant folding
    rewrite(Term.add(bcast(a), bcast(b))).to(bcast(a + b), ne(d).to(String("bool"))),
    rewrite(Term.mul(bcast(a), bcast(b))).to(bcast(a * b), ne(d).to(String("bool"))),
    rewrite(Term.add(Term.const(a, d), Term.const(b, d))).to(Term.const(a + b, d), ne(d).to(String("bool"))),
    rewrite(Term.mul(Term.const(a, d), Term.const(b, d))).to(Term.const(a * b, d), ne(d).to(String("bool"))),
    rewrite(Term.recip(bcast(a))).to(bcast(f64(1.0) / a), ne(a).to(f64(0.0)), eq(d).to(String("f32"))),
    # comparisons and selects of constants. egglog orders f64 totally (NaN above +inf), where
    # IEEE compares NaN false both ways: a comparison with a NaN is never folded
    rewrite(Term.less_than(bcast(a), bcast(b))).to(bcast(1.0, String("bool")), a < b, *_not_nan(a, b)),
    rewrite(Term.less_than(bcast(a), bcast(b))).to(bcast(0.0, String("bool")), a >= b, *_not_nan(a, b)),
    rewrite(Term.where(bcast(1.0, String("bool")), x, y)).to(x),
    rewrite(Term.where(bcast(0.0, String("bool")), x, y)).to(y),
    # scalar chains: (x * a) * b -> x * (a*b), (x + a) + b -> x + (a+b)
    rewrite(Term.mul(Term.mul(x, bcast(a)), bcast(b))).to(Term.mul(x, bcast(a * b)), ne(d).to(String("bool"))),
    rewrite(Term.add(Term.add(x, bcast(a)), bcast(b))).to(Term.add(x, bcast(a + b)), ne(d).to(String("bool"))),
    # distributing a shared scalar factor removes a multiply: x*c + y*c -> (x + y)*c
    rewrite(Term.add(Term.mul(x, bcast(a)), Term.mul(y, bcast(a)))).to(Term.mul(Term.add(x, y), bcast(a)),
                                                                       ne(d).to(String("bool"))),
    # |x| <= 1: sin, unit constants, selects of bounded values, products of bounded values
    rule(eq(e).to(Term.sin(x))).then(unit_bounded(e)),
    rule(eq(e).to(bcast(a)), a <= 1.0, a >= -1.0).then(unit_bounded(e)),
    rule(eq(e).to(Term.mul(x, y)), unit_bounded(x), unit_bounded(y)).then(unit_bounded(e)),
    rule(eq(e).to(Term.where(var("c", Term), x, y)), unit_bounded(x), unit_bounded(y)).then(unit_bounded(e)),
    rule(eq(e).to(Term.view(x, s)), unit_bounded(x)).then(unit_bounded(e)),
    # the non-negativity analysis
    rule(eq(e).to(Term.exp2(x))).then(nonneg(e)),
    rule(eq(e).to(Term.sqrt(x))).then(nonneg(e)),
    rule(eq(e).to(Term.mul(x, x))).then(nonneg(e)),
    rule(eq(e).to(bcast(a)), a >= 0.0).then(nonneg(e)),
    rule(eq(e).to(Term.add(x, y)), nonneg(x), nonneg(y)).then(nonneg(e)),
    rule(eq(e).to(Term.mul(x, y)), nonneg(x), nonneg(y)).then(nonneg(e)),
    rule(eq(e).to(Term.recip(x)), nonneg(x)).then(nonneg(e)),
    rule(eq(e).to(Term.view(x, s)), nonneg(x)).then(nonneg(e)),
    rule(eq(e).to(Term.sum_reduce(x, var("ax", i64))), nonneg(x)).then(nonneg(e)),
)
