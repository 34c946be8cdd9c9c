"""The e-graph term language: one egglog constructor per IR op.

A term's shape is determined by its structure (leaves carry names, Views carry specs, Cast
and Const carry dtypes), so hash-consing identical terms is sound.
"""

from __future__ import annotations

from egglog import Expr, String, StringLike, f64Like, i64, i64Like, function, relation


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
    # kernel choices (rules/matmul.py, norms.py, attention.py): equal to the primitive form they are unioned with
    @classmethod
    def gemm(cls, a: Term, b: Term, axis: i64Like) -> Term:
        """sum_reduce(mul(a, b), axis), computed by a GEMM (a and b are views)."""
    @classmethod
    def softmax(cls, x: Term, axis: i64Like) -> Term:
        """norms.softmax_primitives(x, axis), one row kernel."""
    @classmethod
    def rms_norm(cls, x: Term, axis: i64Like, inv_n: f64Like, eps: f64Like) -> Term:
        """norms.rms_norm_primitives(x, axis, inv_n, eps), one row kernel."""
    @classmethod
    def layer_norm(cls, x: Term, axis: i64Like, inv_n: f64Like, eps: f64Like) -> Term:
        """norms.layer_norm_primitives(x, axis, inv_n, eps), one row kernel."""
    @classmethod
    def attention(cls, p: Term, p_spec: StringLike, v: Term, k: i64Like) -> Term:
        """gemm(view(p, p_spec), v, k) for a row kernel's result p (a softmax), one fused kernel."""
    # schedule choices (rules/schedules.py)
    @classmethod
    def scheduled(cls, x: Term, schedule: StringLike) -> Term:
        """x's kernel run under `schedule` (kiln.ir.graph.parse_schedule): unioned with x itself, so
        the schedules of a kernel are members of its e-class that extraction prices beside it."""
    @classmethod
    def output(cls, index: i64Like, x: Term) -> Term:
        """Marks graph output `index`; never rewritten."""


@function
def pool_threads() -> i64:
    """The target's parallel pool size, set from Python when the search knows its target
    (rules/schedules.py adds parallel schedules only then)."""


@function
def pool_vector_bits() -> i64:
    """The widest SIMD vector (bits) the target measured a rate for; set with pool_threads when
    its profile has vector rates (rules/schedules.py offers vector widths up to it only then)."""


@function
def compose_views(inner: StringLike, outer: StringLike) -> String:
    """Filled from Python (kiln.ir.view.compose) for the view pairs the graph contains."""


@function
def reduce_view(spec: StringLike, axis: i64Like) -> String:
    """A broadcast scalar's view with dim `axis` reduced to 1; filled from Python for the
    broadcast specs the graph contains."""


@function
def shape_of(x: Term) -> String:
    """The static shape of a node the graph had ("d0,d1,..."), entered from Python."""


@function
def merge_in(shape: StringLike, a: i64Like, b: i64Like) -> String:
    """The reshape of a tensor of `shape` that merges the adjacent axes a and b (filled from Python)."""


@function
def merge_axis(shape: StringLike, a: i64Like, b: i64Like) -> i64:
    """The merged axis of merge_in."""


@function
def merge_out(shape: StringLike, a: i64Like, b: i64Like) -> String:
    """The reshape of the merged reduction's result back to `shape` with axes a and b of size 1."""


@function
def split_in(shape: StringLike, axis: i64Like) -> String:
    """The reshape of a tensor of `shape` that splits its reduced `axis` into (parts, rest), for
    a reduction too narrow to share across the pool (filled from Python)."""


@function
def split_out(shape: StringLike, axis: i64Like) -> String:
    """The reshape of the split reduction's result (axes axis and axis+1 of size 1) back to
    `shape` with `axis` of size 1."""


@function
def merge_group(weight: StringLike, spec: StringLike, axis: i64Like, side: i64Like) -> String:
    """The group of GEMMs sharing an operand that the GEMM of weight (through view spec, along
    axis, as operand `side`) belongs to (rules/matmul.py; filled from Python)."""


@function
def merged_operand(group: StringLike, weight: StringLike) -> String:
    """The view that broadcasts a member's shared operand to the merged GEMM's shape."""


@function
def merged_weight_view(group: StringLike) -> String:
    """The merged GEMM's view of the concatenated weights."""


@function
def member_slice(group: StringLike, weight: StringLike) -> String:
    """The view of the merged GEMM's result that is the member's result."""


@function
def merged_weight(group: StringLike) -> Term:
    """The group's weights concatenated along their first axis (unioned from Python with the sum
    of their zero-padded views); weight-only, so computed once when a session loads."""


@function
def bias_group(group: StringLike, view: StringLike, bias: StringLike, spec: StringLike) -> String:
    """The merged bias of GEMM merge `group` when the bias weight (through view spec) added to
    the merged result read through `view` is a member's bias (rules/matmul.py; filled from Python)."""


@function
def merged_bias_view(group: StringLike) -> String:
    """The view broadcasting the concatenated biases over the merged GEMM's result."""


@function
def merged_bias(group: StringLike) -> Term:
    """The group's biases concatenated (unioned from Python with their zero-padded views' sum)."""


# (view spec a, view spec b, axis) whose sum_reduce(mul(view a, view b), axis) is a GEMM (filled from Python)
gemm_layout = relation("gemm_layout", String, String, i64)

# results of a row kernel along an axis: softmax (fully masked rows zeroed or not), norms with
# their affine weight and bias (rules/attention.py)
row_result = relation("row_result", Term, i64)

# (view spec, axis): the view reads a [.., 1, ..] value back along axis (filled from Python)
row_bcast = relation("row_bcast", String, i64)

# leaves and views: what a view may be pushed onto (rules/views.py)
viewable = relation("viewable", Term)

# views without a padding mask (filled from Python)
plain_view = relation("plain_view", String)

# |x| <= 1 (or NaN) everywhere: exp2(x) is then finite and normal, so log2(exp2(x)) -> x is sound
unit_bounded = relation("unit_bounded", Term)

# x >= 0 (or NaN) everywhere: the analysis that makes exp2(log2(x)) -> x sound
nonneg = relation("nonneg", Term)
