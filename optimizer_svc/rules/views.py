"""Views: compose chains of views into one view, and push views through elementwise ops.

Which pairs compose is decided by kiln.ir.view.compose in Python and entered into the
e-graph as the `compose_views` table before each round of saturation. A view of an
elementwise result is the elementwise op of the viewed operands, because every output element
is computed from the operands' elements at the same index. A padding view (one with a mask)
fills with zeros, so it moves only through ops that map zeros to zero (add, mul, sin, sqrt,
select, less-than, cast); exp2(0) = 1, log2(0) and recip(0) are infinite and mod(0, 0) is
NaN, so those need a view without a mask (`plain_view`). A view moves only onto operands that
are leaves or views (`viewable`), so pushes stay one level deep. Identity views are dropped when the
extracted program is rebuilt, which is where a chain that composes to nothing cancels.
"""

from __future__ import annotations

from egglog import EGraph, String, eq, rule, ruleset, set_, union, var

from kiln.ir.ops import Op
from kiln.ir.view import compose
from optimizer_svc.encode import Facts
from optimizer_svc.terms import Term, compose_views, plain_view, viewable

views = ruleset(name="views")

_x, _y, _c, _e = var("x", Term), var("y", Term), var("c", Term), var("e", Term)
_a, _b, _s = var("a", String), var("b", String), var("s", String)
_d = var("d", String)


def _push(lhs, rhs, operands, *conds):
    """view(op(operands)) -> op(view(operand) ...), when every operand is a leaf or a view: the
    pushed views then compose with the operands' views (or read a leaf directly), and a push
    never walks down a chain of ops, which would copy whole residual streams into the e-graph."""
    return rule(eq(_e).to(lhs), *[viewable(o) for o in operands], *conds).then(union(_e).with_(rhs))


views.register(
    rule(eq(_e).to(Term.view(Term.view(_x, _a), _b)), eq(_s).to(compose_views(_a, _b)))
    .then(union(_e).with_(Term.view(_x, _s))),
    # what a view may be pushed onto
    rule(eq(_e).to(Term.view(_x, _s))).then(viewable(_e)),
    rule(eq(_e).to(Term.input(_d))).then(viewable(_e)),
    rule(eq(_e).to(Term.weight(_d))).then(viewable(_e)),
    # zero-preserving ops commute with every view
    _push(Term.view(Term.add(_x, _y), _s), Term.add(Term.view(_x, _s), Term.view(_y, _s)), (_x, _y)),
    _push(Term.view(Term.mul(_x, _y), _s), Term.mul(Term.view(_x, _s), Term.view(_y, _s)), (_x, _y)),
    _push(Term.view(Term.less_than(_x, _y), _s), Term.less_than(Term.view(_x, _s), Term.view(_y, _s)), (_x, _y)),
    _push(Term.view(Term.where(_c, _x, _y), _s), Term.where(Term.view(_c, _s), Term.view(_x, _s), Term.view(_y, _s)),
          (_c, _x, _y)),
    _push(Term.view(Term.sin(_x), _s), Term.sin(Term.view(_x, _s)), (_x,)),
    _push(Term.view(Term.sqrt(_x), _s), Term.sqrt(Term.view(_x, _s)), (_x,)),
    _push(Term.view(Term.cast(_x, _d), _s), Term.cast(Term.view(_x, _s), _d), (_x,)),
    # the others only through views without padding
    _push(Term.view(Term.exp2(_x), _s), Term.exp2(Term.view(_x, _s)), (_x,), plain_view(_s)),
    _push(Term.view(Term.log2(_x), _s), Term.log2(Term.view(_x, _s)), (_x,), plain_view(_s)),
    _push(Term.view(Term.recip(_x), _s), Term.recip(Term.view(_x, _s)), (_x,), plain_view(_s)),
    _push(Term.view(Term.mod(_x, _y), _s), Term.mod(Term.view(_x, _s), Term.view(_y, _s)), (_x, _y), plain_view(_s)),
)


class ViewFacts(Facts):
    """compose_views: for each view of a view, the one view they compose to (if they do)."""

    def __init__(self, enc):
        super().__init__(enc)
        self.composed: set[tuple[str, str]] = set()

    def encode(self, eg, g, i, refs, pool) -> None:
        n = g.nodes[i]
        if n.op is Op.VIEW and g.nodes[n.inputs[0]].op is Op.VIEW:
            self.register_composition(eg, g.nodes[n.inputs[0]].view.key(), n.view.key())

    def see(self, eg, view, n) -> bool:
        added = False
        if n["op"] == "Term.view":
            outer_key = view.literal(n["children"][1])
            if outer_key in self.enc.specs:
                for inner_key in view.view_specs(view.eclass(n["children"][0])):
                    added |= self.register_composition(eg, inner_key, outer_key)
        return added

    def register_composition(self, eg: EGraph, inner: str, outer: str) -> bool:
        if (inner, outer) in self.composed:
            return False
        self.composed.add((inner, outer))
        c = compose(self.enc.specs[inner], self.enc.specs[outer])
        if c is None:
            return False
        eg.register(set_(compose_views(inner, outer)).to(String(self.enc.spec_key(c))))
        return True
