"""Views: compose chains of views into one view where a single strided view exists.

Which pairs compose is decided by kiln.ir.view.compose in Python and entered into the
e-graph as the `compose_views` table before each round of saturation.
"""

from __future__ import annotations

from egglog import String, eq, rule, ruleset, union, var

from optimizer_svc.terms import Term, compose_views

views = ruleset(name="views")

_x, _e = var("x", Term), var("e", Term)
_a, _b, _c = var("a", String), var("b", String), var("c", String)

views.register(
    rule(eq(_e).to(Term.view(Term.view(_x, _a), _b)), eq(_c).to(compose_views(_a, _b)))
    .then(union(_e).with_(Term.view(_x, _c))),
)
