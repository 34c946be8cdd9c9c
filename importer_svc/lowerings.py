"""One lowering per ATen op, registered by decorator: the importer's whole op coverage.

A lowering receives the GraphBuilder, the FX node (for its output meta) and the op's
arguments with tensors replaced by node ids, and returns a node id (or a tuple of them).
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch

from kiln.ir import compose as C
from kiln.ir import view as views
from kiln.ir.builder import GraphBuilder, NodeId
from kiln.ir.dtypes import DType
from kiln.ir.ops import Op
from kiln.core.errors import FailedPrecondition
from kiln.ir.shape import Sym, numel

aten = torch.ops.aten

LOWERINGS: dict[object, Callable] = {}


def register_lowering(*targets):
    def deco(fn):
        for t in targets:
            LOWERINGS[t] = fn
        return fn

    return deco


def out_dtype(node) -> DType:
    val = node.meta["val"]
    if isinstance(val, (tuple, list)):
        val = val[0]
    return DType.from_torch(val.dtype)


def is_scalar(x) -> bool:
    return not isinstance(x, NodeId)


def _to(b: GraphBuilder, x, dtype: DType, like=None) -> int:
    """A tensor id of `dtype`; Python scalars become broadcast constants shaped like `like`, and
    a symbolic integer (a dynamic dim's size used as a value) its value (sym_value)."""
    if isinstance(x, Sym):
        v = sym_value(b, x, dtype)
        return b.expand(v, b.shape(like)) if like is not None and b.shape(like) else v
    if is_scalar(x):
        return b.const(x, dtype, b.shape(like) if like is not None else ())
    return b.cast(x, dtype)


def sym_value(b: GraphBuilder, s: Sym, dtype: DType) -> int:
    """A symbolic integer's value as a scalar tensor of `dtype`: the IR has constants only of
    known value, so it counts, summing s ones along a dim of size s (bound at run time; s >= 0,
    as every dim)."""
    total = b.reduce(Op.SUM_REDUCE, b.const(1, dtype, (s,)), 0)
    return b.reshape(total, ())


def _binary_args(b, node, x, y):
    dt = out_dtype(node)
    if node.target in _COMPARISONS:
        dt = _promote_for_compare(b, x, y)
    xt = _to(b, x, dt, y if is_scalar(x) else None)
    yt = _to(b, y, dt, xt)
    return b.broadcast(xt, yt)


def _promote_for_compare(b, x, y) -> DType:
    dts = [b.dtype(v) for v in (x, y) if not is_scalar(v)]
    floats = [d for d in dts if d.is_float]
    if floats:
        return floats[0]
    if any(isinstance(v, float) for v in (x, y)):
        return DType.F32
    return DType.I64 if DType.I64 in dts else dts[0]


# ---- elementwise arithmetic ----


@register_lowering(aten.add.Tensor, aten.add.Scalar)
def lower_add(b, node, x, y, alpha=1):
    x, y = _binary_args(b, node, x, y)
    if alpha != 1:
        y = C.mul(b, y, C.scalar(b, y, alpha))
    return C.add(b, x, y)


@register_lowering(aten.sub.Tensor, aten.sub.Scalar)
def lower_sub(b, node, x, y, alpha=1):
    x, y = _binary_args(b, node, x, y)
    if alpha != 1:
        y = C.mul(b, y, C.scalar(b, y, alpha))
    return C.sub(b, x, y)


@register_lowering(aten.rsub.Scalar, aten.rsub.Tensor)
def lower_rsub(b, node, x, y, alpha=1):
    return lower_sub(b, node, y, x, alpha)


@register_lowering(aten.mul.Tensor, aten.mul.Scalar)
def lower_mul(b, node, x, y):
    x, y = _binary_args(b, node, x, y)
    if b.dtype(x) is DType.BOOL:
        return C.logical_and(b, x, y)
    return C.mul(b, x, y)


@register_lowering(aten.div.Tensor, aten.div.Scalar)
def lower_div(b, node, x, y):
    x, y = _binary_args(b, node, x, y)
    return C.div(b, x, y)


@register_lowering(aten.neg.default)
def lower_neg(b, node, x):
    return C.neg(b, x)


@register_lowering(aten.exp.default)
def lower_exp(b, node, x):
    return C.exp(b, _to(b, x, out_dtype(node)))


@register_lowering(aten.exp2.default)
def lower_exp2(b, node, x):
    return b.unary(Op.EXP2, _to(b, x, out_dtype(node)))


@register_lowering(aten.log.default)
def lower_log(b, node, x):
    return C.log(b, _to(b, x, out_dtype(node)))


@register_lowering(aten.sqrt.default)
def lower_sqrt(b, node, x):
    return b.unary(Op.SQRT, _to(b, x, out_dtype(node)))


@register_lowering(aten.rsqrt.default)
def lower_rsqrt(b, node, x):
    return b.unary(Op.RECIP, b.unary(Op.SQRT, _to(b, x, out_dtype(node))))


@register_lowering(aten.reciprocal.default)
def lower_reciprocal(b, node, x):
    return b.unary(Op.RECIP, _to(b, x, out_dtype(node)))


@register_lowering(aten.sin.default)
def lower_sin(b, node, x):
    return b.unary(Op.SIN, _to(b, x, out_dtype(node)))


@register_lowering(aten.cos.default)
def lower_cos(b, node, x):
    x = _to(b, x, out_dtype(node))
    return b.unary(Op.SIN, C.add(b, x, C.scalar(b, x, math.pi / 2)))


@register_lowering(aten.abs.default)
def lower_abs(b, node, x):
    return C.abs_(b, x)


@register_lowering(aten.pow.Tensor_Scalar)
def lower_pow(b, node, x, e):
    dt = out_dtype(node)
    x = _to(b, x, dt)
    if float(e).is_integer() and 0 <= e <= 8:  # exact repeated products, for ints too
        if e == 0:
            return b.const(1, dt, b.shape(x))
        r = x
        for _ in range(int(e) - 1):
            r = C.mul(b, r, x)
        return r
    if e == 0.5:
        return b.unary(Op.SQRT, x)
    if e == -1:
        return b.unary(Op.RECIP, x)
    if not dt.is_float:
        raise NotImplementedError(f"integer pow with exponent {e}")
    return C.pow_(b, x, C.scalar(b, x, float(e)))


@register_lowering(aten.pow.Tensor_Tensor)
def lower_pow_tensor(b, node, x, y):
    if not out_dtype(node).is_float:
        raise NotImplementedError("integer pow of two tensors")
    return C.pow_(b, *_binary_args(b, node, x, y))


@register_lowering(aten.pow.Scalar)
def lower_pow_scalar_base(b, node, base, y):
    if not out_dtype(node).is_float:
        raise NotImplementedError("integer pow of a scalar base")
    return C.pow_(b, *_binary_args(b, node, base, y))


@register_lowering(aten.maximum.default)
def lower_maximum(b, node, x, y):
    return C.maximum(b, *_binary_args(b, node, x, y))


@register_lowering(aten.minimum.default)
def lower_minimum(b, node, x, y):
    return C.minimum(b, *_binary_args(b, node, x, y))


# ---- activations ----


@register_lowering(aten.relu.default)
def lower_relu(b, node, x):
    return C.relu(b, x)


@register_lowering(aten.gelu.default)
def lower_gelu(b, node, x, approximate="none"):
    return C.gelu_tanh(b, x) if approximate == "tanh" else C.gelu(b, x)


@register_lowering(aten.tanh.default)
def lower_tanh(b, node, x):
    return C.tanh(b, _to(b, x, out_dtype(node)))


@register_lowering(aten.sigmoid.default)
def lower_sigmoid(b, node, x):
    return C.sigmoid(b, _to(b, x, out_dtype(node)))


@register_lowering(aten.silu.default)
def lower_silu(b, node, x):
    return C.mul(b, x, C.sigmoid(b, x))


@register_lowering(aten.erf.default)
def lower_erf(b, node, x):
    return C.erf(b, _to(b, x, out_dtype(node)))


# ---- comparisons and logic ----

_COMPARISONS = {aten.eq.Scalar, aten.eq.Tensor, aten.ne.Scalar, aten.ne.Tensor, aten.lt.Scalar, aten.lt.Tensor,
                aten.gt.Scalar, aten.gt.Tensor, aten.le.Scalar, aten.le.Tensor, aten.ge.Scalar, aten.ge.Tensor}


@register_lowering(aten.eq.Scalar, aten.eq.Tensor)
def lower_eq(b, node, x, y):
    return C.eq(b, *_binary_args(b, node, x, y))


@register_lowering(aten.ne.Scalar, aten.ne.Tensor)
def lower_ne(b, node, x, y):
    return C.logical_not(b, C.eq(b, *_binary_args(b, node, x, y)))


@register_lowering(aten.lt.Scalar, aten.lt.Tensor)
def lower_lt(b, node, x, y):
    return C.lt(b, *_binary_args(b, node, x, y))


@register_lowering(aten.gt.Scalar, aten.gt.Tensor)
def lower_gt(b, node, x, y):
    x, y = _binary_args(b, node, x, y)
    return C.lt(b, y, x)


@register_lowering(aten.le.Scalar, aten.le.Tensor)
def lower_le(b, node, x, y):
    x, y = _binary_args(b, node, x, y)
    return C.logical_or(b, C.lt(b, x, y), C.eq(b, x, y))


@register_lowering(aten.ge.Scalar, aten.ge.Tensor)
def lower_ge(b, node, x, y):
    x, y = _binary_args(b, node, x, y)
    return C.logical_or(b, C.lt(b, y, x), C.eq(b, x, y))


@register_lowering(aten.logical_not.default)
def lower_logical_not(b, node, x):
    return C.logical_not(b, _to(b, x, DType.BOOL))


@register_lowering(aten.logical_and.default)
def lower_logical_and(b, node, x, y):
    return C.logical_and(b, _to(b, x, DType.BOOL), _to(b, y, DType.BOOL))


@register_lowering(aten.logical_or.default)
def lower_logical_or(b, node, x, y):
    return C.logical_or(b, _to(b, x, DType.BOOL), _to(b, y, DType.BOOL))


@register_lowering(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def lower_where(b, node, cond, x, y):
    dt = out_dtype(node)
    like = next((v for v in (x, y, cond) if not is_scalar(v)), None)
    xt = _to(b, x, dt, like)
    yt = _to(b, y, dt, like)
    return b.where(_to(b, cond, DType.BOOL), xt, yt)


# ---- reductions ----


@register_lowering(aten.sum.dim_IntList, aten.sum.default)
def lower_sum(b, node, x, dim=None, keepdim=False, dtype=None):
    return C.reduce_axes(b, Op.SUM_REDUCE, _to(b, x, out_dtype(node)), dim, keepdim)


@register_lowering(aten.mean.dim, aten.mean.default)
def lower_mean(b, node, x, dim=None, keepdim=False, dtype=None):
    return C.mean(b, _to(b, x, out_dtype(node)), dim, keepdim)


@register_lowering(aten.amax.default)
def lower_amax(b, node, x, dim=(), keepdim=False):
    return C.reduce_axes(b, Op.MAX_REDUCE, x, dim, keepdim)


@register_lowering(aten.any.dim, aten.any.dims, aten.any.default)
def lower_any(b, node, x, dim=None, keepdim=False):
    dims = [dim] if isinstance(dim, int) else dim
    as_float = b.cast(_to(b, x, DType.BOOL), DType.F32)
    return b.cast(C.reduce_axes(b, Op.MAX_REDUCE, as_float, dims, keepdim), DType.BOOL)


@register_lowering(aten._softmax.default)
def lower_softmax(b, node, x, dim, half_to_float=False):
    return C.softmax(b, _to(b, x, out_dtype(node)), dim)


@register_lowering(aten._log_softmax.default)
def lower_log_softmax(b, node, x, dim, half_to_float=False):
    return C.log_softmax(b, _to(b, x, out_dtype(node)), dim)


@register_lowering(aten.native_layer_norm.default)
def lower_layer_norm(b, node, x, normalized_shape, weight, bias, eps):
    shape = b.shape(x)
    k = len(normalized_shape)
    y, mean, rstd = C.layer_norm(b, x, list(range(len(shape) - k, len(shape))), eps)
    if weight is not None:
        y = C.mul(b, y, weight)
    if bias is not None:
        y = C.add(b, y, bias)
    return y, mean, rstd


# ---- linear algebra ----


@register_lowering(aten.mm.default, aten.bmm.default, aten.matmul.default)
def lower_mm(b, node, x, y):
    return C.matmul(b, x, y)


@register_lowering(aten.addmm.default)
def lower_addmm(b, node, bias, x, y, beta=1, alpha=1):
    r = C.matmul(b, x, y)
    if alpha != 1:
        r = C.mul(b, r, C.scalar(b, r, alpha))
    if beta != 1:
        bias = C.mul(b, bias, C.scalar(b, bias, beta))
    return C.add(b, r, bias)


@register_lowering(aten.linear.default)
def lower_linear(b, node, x, w, bias=None):
    """x · wᵀ + bias as core ATen decomposes it (export leaves linear whole when the program needs no
    decomposition, importer.lower_program): the leading dims flattened into rows, one 2-d GEMM."""
    shape = b.shape(x)
    rows = x if len(shape) == 2 else b.reshape(x, (numel(shape[:-1]), shape[-1]))
    vector = len(b.shape(w)) == 1  # a weight of one output: x · w, the last dim dropped
    r = C.matmul(b, rows, b.reshape(w, (b.shape(w)[0], 1)) if vector else b.permute(w, (1, 0)))
    out = shape[:-1] if vector else (*shape[:-1], b.shape(w)[0])
    if tuple(b.shape(r)) != tuple(out):
        r = b.reshape(r, tuple(out))
    return r if bias is None else C.add(b, r, bias)


@register_lowering(aten.embedding.default)
def lower_embedding(b, node, weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    v, h = b.shape(weight)
    ishape = b.shape(indices)
    n = 1
    for d in ishape:
        n = d * n
    idx = b.expand(b.reshape(b.cast(indices, DType.I64), (n, 1)), (n, h))
    return b.reshape(b.gather(weight, idx, 0), tuple(ishape) + (h,))


# ---- movement ----


def _resolve_shape(old, new):
    new = list(new)
    if -1 in new:
        known = 1
        for d in new:
            if d != -1:
                known = d * known
        total = 1
        for d in old:
            total = d * total
        from kiln.ir.shape import dim_floordiv

        new[new.index(-1)] = dim_floordiv(total, known)
    return tuple(new)


@register_lowering(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def lower_view(b, node, x, shape):
    return b.reshape(x, _resolve_shape(b.shape(x), shape))


@register_lowering(aten.permute.default)
def lower_permute(b, node, x, dims):
    rank = len(b.shape(x))
    return b.permute(x, tuple(d % rank for d in dims))


@register_lowering(aten.transpose.int)
def lower_transpose(b, node, x, d0, d1):
    rank = len(b.shape(x))
    perm = list(range(rank))
    perm[d0 % rank], perm[d1 % rank] = perm[d1 % rank], perm[d0 % rank]
    return b.permute(x, tuple(perm))


@register_lowering(aten.t.default)
def lower_t(b, node, x):
    return b.permute(x, (1, 0)) if len(b.shape(x)) == 2 else x


@register_lowering(aten.expand.default)
def lower_expand(b, node, x, shape):
    src = b.shape(x)
    lead = len(shape) - len(src)
    full = tuple(src[i - lead] if (d == -1 and i >= lead) else d for i, d in enumerate(shape))
    return b.expand(x, full)


@register_lowering(aten.unsqueeze.default)
def lower_unsqueeze(b, node, x, dim):
    shape = list(b.shape(x))
    dim = dim % (len(shape) + 1)
    shape.insert(dim, 1)
    return b.reshape(x, tuple(shape))


@register_lowering(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def lower_squeeze(b, node, x, dim=None):
    shape = b.shape(x)
    dims = range(len(shape)) if dim is None else ([dim] if isinstance(dim, int) else dim)
    drop = {d % len(shape) for d in dims if shape[d % len(shape)] == 1} if shape else set()
    return b.reshape(x, tuple(d for i, d in enumerate(shape) if i not in drop))


@register_lowering(aten.slice.Tensor)
def lower_slice(b, node, x, dim=0, start=None, end=None, step=1):
    shape = b.shape(x)
    dim = dim % len(shape)
    n = shape[dim]
    start = 0 if start is None else start
    end = n if end is None or (isinstance(end, int) and end >= 1 << 62) else end
    if isinstance(n, int) and isinstance(start, int) and isinstance(end, int):
        start = max(0, min(n, start + n if start < 0 else start))
        end = max(start, min(n, end + n if end < 0 else end))
    else:  # symbolic: torch already checked the bounds; only wrap negative literals
        start = start + n if isinstance(start, int) and start < 0 else start
        end = end + n if isinstance(end, int) and end < 0 else end
    return b.view(x, views.slice_(shape, dim, start, end, step))


@register_lowering(aten.select.int)
def lower_select(b, node, x, dim, index):
    shape = b.shape(x)
    dim = dim % len(shape)
    index = index % shape[dim]
    s = b.view(x, views.slice_(shape, dim, index, index + 1, 1))
    return b.reshape(s, tuple(d for i, d in enumerate(shape) if i != dim))


@register_lowering(aten.split_with_sizes.default, aten.split.Tensor)
def lower_split(b, node, x, sizes, dim=0):
    shape = b.shape(x)
    dim = dim % len(shape)
    if isinstance(sizes, int):
        sizes = [min(sizes, shape[dim] - s) for s in range(0, shape[dim], sizes)]
    out, start = [], 0
    for s in sizes:
        out.append(b.view(x, views.slice_(shape, dim, start, start + s, 1)))
        start += s
    return tuple(out)


@register_lowering(aten.cat.default)
def lower_cat(b, node, tensors, dim=0):
    dt = out_dtype(node)
    tensors = [b.cast(t, dt) for t in tensors if 0 not in b.shape(t) or len(b.shape(t)) != 1]
    rank = len(b.shape(tensors[0]))
    dim = dim % rank
    total = sum(b.shape(t)[dim] for t in tensors)
    acc, start = None, 0
    work = DType.I32 if dt is DType.BOOL else dt
    for t in tensors:
        n = b.shape(t)[dim]
        pads = tuple((start, total - start - n) if i == dim else (0, 0) for i in range(rank))
        p = b.view(b.cast(t, work), views.pad(b.shape(t), pads))
        acc = p if acc is None else C.add(b, acc, p)
        start += n
    return b.cast(acc, dt)


@register_lowering(aten.constant_pad_nd.default)
def lower_constant_pad_nd(b, node, x, pad, value=0):
    shape = b.shape(x)
    pads = [(0, 0)] * len(shape)
    for i in range(len(pad) // 2):
        pads[len(shape) - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    if any(p < 0 for pair in pads for p in pair):
        raise NotImplementedError("negative padding")
    padded = b.view(x, views.pad(shape, tuple(pads)))
    if value == 0:
        return padded
    inside = b.view(b.const(True, DType.BOOL, shape), views.pad(shape, tuple(pads)))
    return b.where(inside, padded, C.scalar(b, padded, value))


# ---- copies, casts, constructors ----


@register_lowering(aten.clone.default, aten.alias.default, aten.detach.default, aten.contiguous.default,
                   aten.lift_fresh_copy.default, aten.detach_.default)  # detach_: no value changes
def lower_identity(b, node, x, **_):
    return x


@register_lowering(aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout)
def lower_to_copy(b, node, x, *_, **__):
    try:
        dtype = out_dtype(node)
    except ValueError as e:  # a dtype kiln has not (float64, complex): not supported, not a bug
        raise NotImplementedError(str(e)) from e
    return b.cast(x, dtype)


def _static_shape(node):
    """The node's output shape from its meta, symbolic dims as Dims."""
    from kiln.ir.shape import from_sympy

    return tuple(d if isinstance(d, int) else from_sympy(d.node.expr) for d in node.meta["val"].shape)


@register_lowering(aten.full.default)
def lower_full(b, node, size, value, **_):
    return b.const(value, out_dtype(node), _static_shape(node))


@register_lowering(aten.full_like.default)
def lower_full_like(b, node, x, value, **_):
    return b.const(value, out_dtype(node), b.shape(x))


@register_lowering(aten.zeros_like.default)
def lower_zeros_like(b, node, x, **_):
    return b.const(0, out_dtype(node), b.shape(x))


@register_lowering(aten.new_ones.default)
def lower_new_ones(b, node, x, size, **_):
    return b.const(1, out_dtype(node), _static_shape(node))


@register_lowering(aten.ones_like.default)
def lower_ones_like(b, node, x, **_):
    return b.const(1, out_dtype(node), b.shape(x))


@register_lowering(aten.scalar_tensor.default)
def lower_scalar_tensor(b, node, value, **_):
    return b.const(value, out_dtype(node), ())


@register_lowering(aten.arange.start_step, aten.arange.default, aten.arange.start)
def lower_arange(b, node, *args, **_):
    n = _static_shape(node)[0]
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    dt = out_dtype(node)
    i = b.iota((n,), 0, dt)
    if step != 1:
        i = C.mul(b, i, C.scalar(b, i, step))
    if start != 0:
        i = C.add(b, i, C.scalar(b, i, start))
    return i


@register_lowering(operator.getitem)
def lower_getitem(b, node, seq, i):
    return seq[i]


@register_lowering(aten._assert_tensor_metadata.default, aten._assert_scalar.default,
                   aten.sym_constrain_range_for_size.default)
def lower_assertion(b, node, *args, **kwargs):
    # export's runtime checks of facts the lowering already verified against node meta
    return None


@register_lowering(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.__and__.Tensor)
def lower_bitwise_and(b, node, x, y):
    if out_dtype(node) is not DType.BOOL:
        raise NotImplementedError("bitwise_and on integers")
    return C.logical_and(b, _to(b, x, DType.BOOL, y), _to(b, y, DType.BOOL, x))


@register_lowering(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.__or__.Tensor)
def lower_bitwise_or(b, node, x, y):
    if out_dtype(node) is not DType.BOOL:
        raise NotImplementedError("bitwise_or on integers")
    return C.logical_or(b, _to(b, x, DType.BOOL, y), _to(b, y, DType.BOOL, x))


@register_lowering(aten.bitwise_not.default)
def lower_bitwise_not(b, node, x):
    if out_dtype(node) is not DType.BOOL:
        raise NotImplementedError("bitwise_not on integers")
    return C.logical_not(b, x)


@register_lowering(aten.index.Tensor)
def lower_index(b, node, x, indices):
    """x[..., i, j, ...] with index tensors on some dims (None skips a dim): the indexed dims are
    permuted to the front and gathered at once; as in torch, the broadcast index dims replace
    the indexed dims where those are adjacent, and lead the result where they are not."""
    pos = [m for m, i in enumerate(indices) if i is not None]
    if any(b.dtype(indices[m]) is DType.BOOL for m in pos):
        raise NotImplementedError("boolean mask indices (the result's shape depends on the data)")
    rank = len(b.shape(x))
    perm = pos + [d for d in range(rank) if d not in pos]
    xp = b.permute(x, perm) if perm != list(range(rank)) else x
    out = _index_prefix(b, xp, [indices[m] for m in pos])
    p = pos[0]
    if p == 0 or pos != list(range(p, pos[-1] + 1)):
        return out
    lead = len(b.shape(out)) - (rank - len(pos))
    order = list(range(lead, lead + p)) + list(range(lead)) + list(range(lead + p, len(b.shape(out))))
    return b.permute(out, order)


def _index_prefix(b, x, indices):
    """x[i0, i1, ...] with index tensors for a prefix of x's dims: one Gather over the
    flattened prefix, at the linear index of the (broadcast, wrapped) index tensors."""
    shape = b.shape(x)
    k = len(indices)
    idx = [b.cast(i, DType.I64) for i in indices]
    idx = b.broadcast(*idx) if k > 1 else idx
    lin = None
    stride = 1
    for m in reversed(range(k)):
        i = idx[m]
        wrapped = b.where(C.lt(b, i, C.scalar(b, i, 0)), C.add(b, i, C.dim_scalar(b, i, shape[m])), i)
        term = wrapped if stride == 1 else C.mul(b, wrapped, C.dim_scalar(b, wrapped, stride))
        lin = term if lin is None else C.add(b, lin, term)
        stride = shape[m] * stride
    out_lead = b.shape(lin)
    rest = tuple(shape[k:])
    r = 1
    for d in rest:
        r = d * r
    n = 1
    for d in out_lead:
        n = d * n
    src = b.reshape(x, (stride, r))
    gidx = b.expand(b.reshape(lin, (n, 1)), (n, r))
    return b.reshape(b.gather(src, gidx, 0), tuple(out_lead) + rest)


@register_lowering(aten.cumsum.default)
def lower_cumsum(b, node, x, dim, dtype=None):
    """out[..., i] = sum over j <= i: a masked broadcast and a SumReduce (O(n^2), no scan primitive)."""
    x = _to(b, x, out_dtype(node))
    shape = b.shape(x)
    rank = len(shape)
    if rank == 0:
        return x
    dim = dim % rank
    perm = [d for d in range(rank) if d != dim] + [dim]
    xt = b.permute(x, perm) if dim != rank - 1 else x
    lead, n = b.shape(xt)[:-1], shape[dim]
    full = tuple(lead) + (n, n)
    xe = b.expand(b.reshape(xt, tuple(lead) + (1, n)), full)
    i = b.expand(b.iota((n, n), 0), full)
    j = b.expand(b.iota((n, n), 1), full)
    kept = b.where(C.lt(b, i, j), C.scalar(b, xe, 0), xe)
    s = b.reshape(b.reduce(Op.SUM_REDUCE, kept, rank), tuple(lead) + (n,))
    inverse = [perm.index(d) for d in range(rank)]
    return b.permute(s, inverse) if dim != rank - 1 else s


# ---- convolution and pooling: windows are views, convolution is a GEMM over them ----


def _windows(b, x, kernel, stride, dilation, padding):
    """x[N, C, *S] -> view [N, C, *O, *K] of the zero-padded input (one element per tap)."""
    from kiln.ir.shape import contiguous_strides

    shape = b.shape(x)
    nsp = len(kernel)
    pads = ((0, 0), (0, 0)) + tuple((p, p) for p in padding)
    xp = b.view(x, views.pad(shape, pads)) if any(padding) else x
    ps = b.shape(xp)
    cs = contiguous_strides(ps)
    outs = [(ps[2 + d] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in range(nsp)]
    if any(o <= 0 for o in outs):
        raise NotImplementedError(f"window {list(kernel)} does not fit the padded input {list(ps)}")
    spec = views.ViewSpec(tuple(ps[:2]) + tuple(outs) + tuple(kernel),
                          tuple(cs[:2]) + tuple(cs[2 + d] * stride[d] for d in range(nsp))
                          + tuple(cs[2 + d] * dilation[d] for d in range(nsp)))
    return b.view(xp, spec), outs


@register_lowering(aten.convolution.default)
def lower_convolution(b, node, x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise NotImplementedError("transposed convolution")
    n, c = b.shape(x)[:2]
    oc, cg = b.shape(weight)[:2]
    kernel = tuple(b.shape(weight)[2:])
    nsp = len(kernel)
    win, outs = _windows(b, x, kernel, tuple(stride), tuple(dilation), tuple(padding))
    g = groups
    m = 1
    for o in outs:
        m = o * m
    k = cg
    for kk in kernel:
        k = kk * k
    # [N, G, Cg, *O, *K] -> [N, G, *O, Cg, *K] -> [N, G, M, K]
    win = b.reshape(win, (n, g, cg) + tuple(outs) + kernel)
    perm = (0, 1) + tuple(range(3, 3 + nsp)) + (2,) + tuple(range(3 + nsp, 3 + 2 * nsp))
    a = b.reshape(b.permute(win, perm), (n, g, m, k))
    w = b.permute(b.reshape(weight, (g, oc // g, k)), (0, 2, 1))        # [G, K, Og]
    y = C.matmul(b, a, w)                                               # [N, G, M, Og]
    y = b.reshape(b.permute(y, (0, 1, 3, 2)), (n, oc) + tuple(outs))
    if bias is not None:
        y = C.add(b, y, b.reshape(bias, (oc,) + (1,) * nsp))
    return y


@register_lowering(aten.max_pool2d_with_indices.default)
def lower_max_pool2d(b, node, x, kernel_size, stride=(), padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    if ceil_mode:
        raise NotImplementedError("max_pool2d with ceil_mode=True")
    kernel = tuple(kernel_size) if len(kernel_size) == 2 else tuple(kernel_size) * 2
    stride = tuple(stride) if stride else kernel
    stride = stride if len(stride) == 2 else stride * 2
    padding = tuple(padding) if len(padding) == 2 else tuple(padding) * 2
    dilation = tuple(dilation) if len(dilation) == 2 else tuple(dilation) * 2
    win, outs = _windows(b, x, kernel, stride, dilation, padding)
    if any(padding):  # padded taps must never win the max: -inf there, not 0
        inside, _ = _windows(b, b.const(True, DType.BOOL, b.shape(x)), kernel, stride, dilation, padding)
        win = b.where(inside, win, C.scalar(b, win, -math.inf))
    r = b.reduce(Op.MAX_REDUCE, b.reduce(Op.MAX_REDUCE, win, 4), 5)
    out = b.reshape(r, tuple(b.shape(x)[:2]) + tuple(outs))
    return out, None  # the indices output has no lowering; a program that reads it fails in its consumer


@register_lowering(aten._native_batch_norm_legit_no_training.default)
def lower_batch_norm_eval(b, node, x, weight, bias, running_mean, running_var, momentum, eps):
    rank = len(b.shape(x))
    per_channel = lambda t: b.reshape(t, (b.shape(t)[0],) + (1,) * (rank - 2))  # noqa: E731
    rstd = b.unary(Op.RECIP, b.unary(Op.SQRT, C.add(b, running_var, C.scalar(b, running_var, eps))))
    y = C.mul(b, C.sub(b, x, per_channel(running_mean)), per_channel(rstd))
    if weight is not None:
        y = C.mul(b, y, per_channel(weight))
    if bias is not None:
        y = C.add(b, y, per_channel(bias))
    return y, None, None


@register_lowering(aten._adaptive_avg_pool2d.default)
def lower_adaptive_avg_pool2d(b, node, x, output_size):
    spatial = b.shape(x)[-2:]
    if any(s % o for s, o in zip(spatial, output_size)):
        raise NotImplementedError(f"adaptive_avg_pool2d from {list(spatial)} to {list(output_size)} "
                                  "(only evenly dividing windows)")
    kernel = tuple(s // o for s, o in zip(spatial, output_size))
    lead = tuple(b.shape(x)[:-2])
    x4 = b.reshape(x, (1,) * (2 - len(lead)) + lead + tuple(spatial)) if len(lead) < 2 else x
    win, outs = _windows(b, x4, kernel, kernel, (1, 1), (0, 0))
    return b.reshape(C.mean(b, win, [4, 5], False), lead + tuple(outs))


# scaled_dot_product_attention stays whole through run_decompositions (torch's CPU decomposition
# mis-strides some programs, GPT-2's among them) and is lowered here to its primitive form
KEEP_UNDECOMPOSED = (aten.scaled_dot_product_attention.default,)


@register_lowering(aten.scaled_dot_product_attention.default)
def lower_sdpa(b, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if dropout_p:
        raise NotImplementedError("attention dropout (export the model in eval mode)")
    qs, ks = b.shape(q), b.shape(k)
    if enable_gqa and qs[-3] != ks[-3]:
        rep = qs[-3] // ks[-3]

        def repeat(t):
            s = b.shape(t)
            e = b.expand(b.reshape(t, s[:-2] + (1,) + s[-2:]), s[:-2] + (rep,) + s[-2:])
            return b.reshape(e, s[:-3] + (s[-3] * rep,) + s[-2:])

        k, v = repeat(k), repeat(v)
    scale = 1.0 / math.sqrt(qs[-1]) if scale is None else scale
    kt = b.permute(k, tuple(range(len(ks) - 2)) + (len(ks) - 1, len(ks) - 2))
    scores = C.matmul(b, C.mul(b, q, C.scalar(b, q, scale)), kt)
    ninf = C.scalar(b, scores, -math.inf)
    L, S = b.shape(scores)[-2:]
    if is_causal:
        i, j = b.iota((L, S), 0), b.iota((L, S), 1)
        scores = b.where(C.lt(b, i, j), ninf, scores)
    if attn_mask is not None:
        if b.dtype(attn_mask) is DType.BOOL:
            scores = b.where(attn_mask, scores, ninf)
        else:
            scores = C.add(b, scores, b.cast(attn_mask, b.dtype(scores)))
    p = C.softmax(b, scores, -1)
    # a row with every key masked attends to nothing (0), as torch's CPU kernels give
    m = b.reduce(Op.MAX_REDUCE, scores, len(b.shape(scores)) - 1)
    p = b.where(C.eq(b, m, C.scalar(b, m, -math.inf)), C.scalar(b, p, 0.0), p)
    return C.matmul(b, p, v)


@register_lowering(aten.gather.default)
def lower_gather(b, node, x, dim, index, sparse_grad=False):
    return b.gather(x, b.cast(index, DType.I64), dim % len(b.shape(x)))


# ---- symbolic sizes (dynamic shapes): dims flow between nodes as Python values ----


@register_lowering(aten.sym_size.int)
def lower_sym_size(b, node, x, dim):
    return b.shape(x)[dim]


@register_lowering(operator.mul)
def lower_dim_mul(b, node, x, y):
    return x * y


@register_lowering(operator.add)
def lower_dim_add(b, node, x, y):
    return x + y


@register_lowering(operator.sub)
def lower_dim_sub(b, node, x, y):
    return x - y


@register_lowering(operator.floordiv)
def lower_dim_floordiv(b, node, x, y):
    from kiln.ir.shape import dim_floordiv

    return dim_floordiv(x, y)


def _dim_order(x, y) -> int:
    """-1 when dim x <= y for every binding, 1 when x >= y, else 0. Dims are polynomials over
    symbols that are never negative: x - y with no positive coefficient is never above zero."""
    from kiln.ir.shape import _terms

    coeffs = [c for _, c in _terms(x - y)]
    if all(c <= 0 for c in coeffs):
        return -1
    if all(c >= 0 for c in coeffs):
        return 1
    return 0


@register_lowering(torch.sym_min)
def lower_dim_min(b, node, x, y):
    order = _dim_order(x, y)
    if order == 0:
        raise FailedPrecondition(f"min({x}, {y}) of dynamic dims depends on their values; kiln needs the "
                                 "smaller one known for every binding")
    return x if order < 0 else y


@register_lowering(torch.sym_max)
def lower_dim_max(b, node, x, y):
    order = _dim_order(x, y)
    if order == 0:
        raise FailedPrecondition(f"max({x}, {y}) of dynamic dims depends on their values; kiln needs the "
                                 "larger one known for every binding")
    return y if order < 0 else x


def _dim_compare(op: str, x, y):
    """A comparison of dims, as a Python bool where it holds or fails for every binding, else
    None (only run-time asserts, which the executor's shape checks stand in for, take such a
    value). With symbols never negative, x - y = c + (terms all of one sign) is bounded by c."""
    from kiln.ir.shape import _terms

    diff = x - y
    terms = _terms(diff)
    c = next((v for m, v in terms if m == ()), 0)
    rest = [v for m, v in terms if m != ()]
    lo = c if all(v >= 0 for v in rest) else None   # diff >= lo everywhere
    hi = c if all(v <= 0 for v in rest) else None   # diff <= hi everywhere
    always = {"le": hi is not None and hi <= 0, "lt": hi is not None and hi < 0,
              "ge": lo is not None and lo >= 0, "gt": lo is not None and lo > 0}
    never = {"le": lo is not None and lo > 0, "lt": lo is not None and lo >= 0,
             "ge": hi is not None and hi < 0, "gt": hi is not None and hi <= 0}
    if op in always:
        return True if always[op] else False if never[op] else None
    if not terms:
        return op == "eq"
    if (lo is not None and lo > 0) or (hi is not None and hi < 0):
        return op == "ne"
    return None


for _name in ("eq", "ne", "le", "ge", "lt", "gt"):
    register_lowering(getattr(operator, _name))(
        lambda b, node, x, y, _op=_name: _dim_compare(_op, x, y))
