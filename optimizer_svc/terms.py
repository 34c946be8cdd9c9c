"""The e-graph term language: one egglog constructor per IR op.

A term's shape is determined by its structure (leaves carry names, Views carry specs, Cast
and Const carry dtypes), so hash-consing identical terms is sound.
"""

from __future__ import annotations

from egglog import Expr, StringLike, f64Like, i64Like, function, relation, String


class Term(Expr):
    @classmethod
    def input(cls, name: StringLike) -> Term: ...
    @classmethod
    def weight(cls, name: StringLike) -> Term: ...
    @classmethod
    def const(cls, value: f64Like, dtype: StringLike) -> Term: ...
    @classmethod
    def view(cls, x: Term, spec: StringLike) -> Term: ...
    @classmethod
    def exp2(cls, x: Term) -> Term: ...
    @classmethod
    def log2(cls, x: Term) -> Term: ...
    @classmethod
    def sin(cls, x: Term) -> Term: ...
    @classmethod
    def sqrt(cls, x: Term) -> Term: ...
    @classmethod
    def recip(cls, x: Term) -> Term: ...
    @classmethod
    def add(cls, a: Term, b: Term) -> Term: ...
    @classmethod
    def mul(cls, a: Term, b: Term) -> Term: ...
    @classmethod
    def mod(cls, a: Term, b: Term) -> Term: ...
    @classmethod
    def less_than(cls, a: Term, b: Term) -> Term: ...
    @classmethod
    def where(cls, c: Term, a: Term, b: Term) -> Term: ...
    @classmethod
    def sum_reduce(cls, x: Term, axis: i64Like) -> Term: ...
    @classmethod
    def max_reduce(cls, x: Term, axis: i64Like) -> Term: ...
    @classmethod
    def iota(cls, shape: StringLike, axis: i64Like, dtype: StringLike) -> Term: ...
    @classmethod
    def gather(cls, src: Term, index: Term, axis: i64Like) -> Term: ...
    @classmethod
    def scatter(cls, dst: Term, index: Term, src: Term, axis: i64Like) -> Term: ...
    @classmethod
    def cast(cls, x: Term, dtype: StringLike) -> Term: ...
    @classmethod
    def output(cls, index: i64Like, x: Term) -> Term:
        """Marks graph output `index`; never rewritten."""


@function
def compose_views(inner: StringLike, outer: StringLike) -> String:
    """Filled from Python (kiln.ir.view.compose) for the view pairs the graph contains."""


@function
def reduce_view(spec: StringLike, axis: i64Like) -> String:
    """A broadcast scalar's view with dim `axis` reduced to 1; filled from Python for the
    broadcast specs the graph contains."""


# leaves and views: what a view may be pushed onto (rules/views.py)
viewable = relation("viewable", Term)

# views without a padding mask (filled from Python)
plain_view = relation("plain_view", String)

# |x| <= 1 (or NaN) everywhere: exp2(x) is then finite and normal, so log2(exp2(x)) -> x is sound
unit_bounded = relation("unit_bounded", Term)

# x >= 0 (or NaN) everywhere: the analysis that makes exp2(log2(x)) -> x sound
nonneg = relation("nonneg", Term)
