"""Composite math built from the sixteen primitives: the one definition of each composition.

The importer's ATen lowerings compose with these; the optimizer rebuilds the row kernels it
recognised (softmax, RMS norm, layer norm) with the same functions, so a program round-trips
through the search node for node. Each function takes a GraphBuilder and node ids and returns a
node id; `kernel` marks the root of a row kernel the search chose.
"""

from __future__ import annotations

import math

from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.ops import Op

LOG2_E = 1.0 / math.log(2.0)
LN_2 = math.log(2.0)


def scalar(b: GraphBuilder, x: int, value: float) -> int:
    """A constant of x's dtype broadcast to x's shape."""
    return b.const(value, b.dtype(x), b.shape(x))


def dim_scalar(b: GraphBuilder, x: int, d) -> int:
    """A dim's value (an int, or a symbolic Dim bound at run time) broadcast to x's shape and
    dtype. A symbolic dim becomes data as the largest index of an Iota over it, plus one."""
    if isinstance(d, int):
        return scalar(b, x, d)
    top = b.reduce(Op.MAX_REDUCE, b.iota((d,), 0, b.dtype(x)), 0)
    n = add(b, top, b.const(1, b.dtype(x), (1,)))
    return b.expand(b.reshape(n, ()), b.shape(x))


def add(b, x, y):
    return b.binary(Op.ADD, x, y)


def mul(b, x, y):
    return b.binary(Op.MUL, x, y)


def neg(b, x):
    return mul(b, x, scalar(b, x, -1.0))


def sub(b, x, y):
    x, y = b.broadcast(x, y)
    return add(b, x, neg(b, y))


def div(b, x, y):
    x, y = b.broadcast(x, y)
    return mul(b, x, b.unary(Op.RECIP, y))


def exp(b, x):
    return b.unary(Op.EXP2, mul(b, x, scalar(b, x, LOG2_E)))


def log(b, x):
    return mul(b, b.unary(Op.LOG2, x), scalar(b, x, LN_2))


def sigmoid(b, x):
    return b.unary(Op.RECIP, add(b, scalar(b, x, 1.0), exp(b, neg(b, x))))


def tanh(b, x):
    s = sigmoid(b, mul(b, x, scalar(b, x, 2.0)))
    return sub(b, mul(b, s, scalar(b, s, 2.0)), scalar(b, s, 1.0))


def lt(b, x, y):
    return b.binary(Op.LESS_THAN, x, y)


def logical_not(b, x):
    return b.where(x, b.const(False, DType.BOOL, b.shape(x)), b.const(True, DType.BOOL, b.shape(x)))


def logical_and(b, x, y):
    x, y = b.broadcast(x, y)
    return b.where(x, y, b.const(False, DType.BOOL, b.shape(x)))


def logical_or(b, x, y):
    x, y = b.broadcast(x, y)
    return b.where(x, b.const(True, DType.BOOL, b.shape(x)), y)


def is_nan(b, x):
    """NaN is the only value that is neither below +inf nor above -inf."""
    if not b.dtype(x).is_float:
        return b.const(False, DType.BOOL, b.shape(x))
    below_inf = lt(b, x, scalar(b, x, math.inf))
    above_ninf = lt(b, scalar(b, x, -math.inf), x)
    return logical_not(b, logical_or(b, below_inf, above_ninf))


def eq(b, x, y):
    x, y = b.broadcast(x, y)
    ordered = logical_not(b, logical_or(b, lt(b, x, y), lt(b, y, x)))
    return logical_and(b, ordered, logical_not(b, logical_or(b, is_nan(b, x), is_nan(b, y))))


def maximum(b, x, y):
    """NaN-propagating max, as torch.maximum."""
    x, y = b.broadcast(x, y)
    m = b.where(lt(b, x, y), y, x)
    return b.where(is_nan(b, y), y, m) if b.dtype(x).is_float else m


def minimum(b, x, y):
    x, y = b.broadcast(x, y)
    m = b.where(lt(b, y, x), y, x)
    return b.where(is_nan(b, y), y, m) if b.dtype(x).is_float else m


def abs_(b, x):
    return b.where(lt(b, x, scalar(b, x, 0.0)), neg(b, x), x)


def pow_(b, x, y):
    """x ** y for floats, as torch (C's pow) defines it: |x| ** y = 2 ** (y * log2 |x|), negated
    for a negative base (-0.0 included) and odd integer y, NaN for a finite negative base and
    non-integer y; x ** 0 = 1 and
    1 ** y = 1 (NaN included), (-1) ** ±inf = 1."""
    x, y = b.broadcast(x, y)
    one, zero = scalar(b, x, 1.0), scalar(b, x, 0.0)
    mag = b.unary(Op.EXP2, mul(b, y, b.unary(Op.LOG2, abs_(b, x))))
    y_inf = eq(b, abs_(b, y), scalar(b, y, math.inf))
    y_int = logical_or(b, eq(b, b.binary(Op.MOD, y, one), zero), y_inf)
    y_odd = eq(b, b.binary(Op.MOD, y, scalar(b, y, 2.0)), one)
    # the sign bit: x < 0, or x = -0.0 (whose reciprocal is -inf)
    negative = logical_or(b, lt(b, x, zero), logical_and(b, eq(b, x, zero), lt(b, b.unary(Op.RECIP, x), zero)))
    r = b.where(logical_and(b, negative, y_odd), neg(b, mag), mag)
    finite_negative = logical_and(b, lt(b, x, zero), lt(b, scalar(b, x, -math.inf), x))
    r = b.where(logical_and(b, finite_negative, logical_not(b, y_int)), scalar(b, x, math.nan), r)
    unit = logical_or(b, logical_or(b, eq(b, y, zero), eq(b, x, one)), logical_and(b, eq(b, x, scalar(b, x, -1.0)), y_inf))
    return b.where(unit, one, r)


def relu(b, x):
    # Where keeps NaN: NaN < 0 is false, so NaN passes through as in torch
    return b.where(lt(b, x, scalar(b, x, 0.0)), scalar(b, x, 0.0), x)


# Abramowitz & Stegun 7.1.26: |erf(x) - approx| <= 1.5e-7 for all x; measured against
# float64 erf in tests/test_importer.py (fp32 evaluation stays under 1e-6).
_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(b, x):
    ax = abs_(b, x)
    t = b.unary(Op.RECIP, add(b, scalar(b, x, 1.0), mul(b, ax, scalar(b, x, _ERF_P))))
    poly = scalar(b, x, _ERF_A[4])
    for a in reversed(_ERF_A[:4]):
        poly = add(b, mul(b, poly, t), scalar(b, x, a))
    poly = mul(b, poly, t)
    r = sub(b, scalar(b, x, 1.0), mul(b, poly, exp(b, neg(b, mul(b, x, x)))))
    return b.where(lt(b, x, scalar(b, x, 0.0)), neg(b, r), r)


def gelu(b, x):
    inner = erf(b, mul(b, x, scalar(b, x, 1.0 / math.sqrt(2.0))))
    return mul(b, mul(b, x, scalar(b, x, 0.5)), add(b, inner, scalar(b, x, 1.0)))


def gelu_tanh(b, x):
    cube = mul(b, mul(b, x, x), x)
    inner = mul(b, add(b, x, mul(b, cube, scalar(b, x, 0.044715))), scalar(b, x, math.sqrt(2.0 / math.pi)))
    return mul(b, mul(b, x, scalar(b, x, 0.5)), add(b, tanh(b, inner), scalar(b, x, 1.0)))


def reduce_axes(b, op: Op, x: int, axes, keepdim: bool) -> int:
    rank = len(b.shape(x))
    if rank == 0:  # torch reduces a 0-d tensor over dim 0 / -1 to itself
        return x
    axes = sorted({a % rank for a in axes}) if axes else list(range(rank))
    for a in axes:
        x = b.reduce(op, x, a)
    if not keepdim:
        x = b.reshape(x, tuple(d for i, d in enumerate(b.shape(x)) if i not in axes))
    return x


def mean(b, x, axes, keepdim, inv_n=None):
    shape = b.shape(x)
    rank = len(shape)
    if rank == 0:
        return x
    axes_n = sorted({a % rank for a in axes}) if axes else list(range(rank))
    n = 1
    for a in axes_n:
        n = shape[a] * n
    s = reduce_axes(b, Op.SUM_REDUCE, x, axes_n, keepdim)
    return mul(b, s, scalar(b, s, 1.0 / n if inv_n is None else inv_n))


def softmax(b, x, dim, kernel: str = ""):
    m = b.reduce(Op.MAX_REDUCE, x, dim)
    e = exp(b, sub(b, x, m))
    s = b.reduce(Op.SUM_REDUCE, e, dim)
    return b.binary(Op.MUL, e, b.expand(b.unary(Op.RECIP, s), b.shape(e)), kernel=kernel)


def rms_norm(b, x, axes, eps: float, inv_n=None, kernel: str = ""):
    """x * rsqrt(mean(x*x) + eps) over `axes`; `inv_n` (default 1/n) is the mean's scale."""
    rstd = b.unary(Op.RECIP, b.unary(Op.SQRT, _plus(b, mean(b, mul(b, x, x), axes, True, inv_n), eps)))
    return b.binary(Op.MUL, x, rstd, kernel=kernel)  # binary broadcasts rstd back along the row


def layer_norm(b, x, axes, eps: float, inv_n=None, kernel: str = ""):
    """(x - mean(x)) * rsqrt(var(x) + eps) over `axes`: (y, mean, rstd)."""
    m = mean(b, x, axes, True, inv_n)
    xc = sub(b, x, m)
    rstd = b.unary(Op.RECIP, b.unary(Op.SQRT, _plus(b, mean(b, mul(b, xc, xc), axes, True, inv_n), eps)))
    return b.binary(Op.MUL, xc, rstd, kernel=kernel), m, rstd


def _plus(b, x, value: float):
    return add(b, x, scalar(b, x, value))


def log_softmax(b, x, dim):
    m = b.reduce(Op.MAX_REDUCE, x, dim)
    shifted = sub(b, x, m)
    lse = log(b, b.reduce(Op.SUM_REDUCE, exp(b, shifted), dim))
    return sub(b, shifted, lse)


def matmul(b, x, y):
    """x[..., M, K] @ y[..., K, N] as a broadcast Mul and a SumReduce over K."""
    xs, ys = b.shape(x), b.shape(y)
    if len(xs) < 2 or len(ys) < 2:
        raise ValueError("matmul operands must be at least 2-d after promotion")
    batch = tuple(_bcast_dims(xs[:-2], ys[:-2]))
    m, k, n = xs[-2], xs[-1], ys[-1]
    xe = b.expand(b.reshape(x, xs[:-1] + (1, k)), batch + (m, n, k))
    yt = b.permute(y, tuple(range(len(ys) - 2)) + (len(ys) - 1, len(ys) - 2))
    ye = b.expand(b.reshape(yt, ys[:-2] + (1, n, k)), batch + (m, n, k))
    r = b.reduce(Op.SUM_REDUCE, mul(b, xe, ye), len(batch) + 2)
    return b.reshape(r, batch + (m, n))


def _bcast_dims(a, b_):
    from kiln.ir.builder import broadcast_shapes

    return broadcast_shapes(tuple(a), tuple(b_)) if (a or b_) else ()
