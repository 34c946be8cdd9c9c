"""Reference evaluator: runs a Graph with numpy, one op at a time.

It is the semantics of the IR that rule tests and the optimizer's property test compare
against; it is never used to serve requests.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from kiln.ir.graph import Graph, Node
from kiln.ir.ops import Op
from kiln.ir.shape import evaluate_dim, numel
from kiln.ir.view import ViewSpec


def apply_view(src: np.ndarray, spec: ViewSpec, env: Mapping[str, int]) -> np.ndarray:
    shape = tuple(evaluate_dim(d, env) for d in spec.shape)
    flat = np.ascontiguousarray(src).reshape(-1)
    if all(n > 0 for n in shape):
        # the unmasked elements are a box of the view (a mask is a range per axis), and the box a
        # strided view of the buffer: copied as _gathered computes it, without an index per
        # element (a BERT-base's weights transposed and concatenated at Load: 1.5 s gathered)
        box = [(0, n) for n in shape] if spec.mask is None else \
            [(max(0, evaluate_dim(lo, env)), min(n, evaluate_dim(hi, env))) for n, (lo, hi) in zip(shape, spec.mask)]
        if any(a >= b for a, b in box):
            return np.zeros(shape, dtype=flat.dtype)
        strides = [evaluate_dim(st, env) for st in spec.strides]
        first = evaluate_dim(spec.offset, env) + sum(a * st for (a, _), st in zip(box, strides))
        last = first + sum((b - a - 1) * st for (a, b), st in zip(box, strides))
        if first >= 0 and all(st >= 0 for st in strides) and last < flat.size:
            part = np.lib.stride_tricks.as_strided(flat[first:], [b - a for a, b in box],
                                                   [st * flat.itemsize for st in strides], writeable=False)
            if spec.mask is None:
                return part.copy(order="C")
            out = np.zeros(shape, dtype=flat.dtype)
            out[tuple(slice(a, b) for a, b in box)] = part
            return out
    return _gathered(flat, shape, spec, env)


def _gathered(flat: np.ndarray, shape: tuple, spec: ViewSpec, env: Mapping[str, int]) -> np.ndarray:
    """The view element by element: each one's flat index, masked elements zero."""
    idx = np.full(shape, evaluate_dim(spec.offset, env), dtype=np.int64)
    valid = np.ones(shape, dtype=bool)
    for k, (n, st) in enumerate(zip(shape, spec.strides)):
        ar = np.arange(n, dtype=np.int64).reshape([n if j == k else 1 for j in range(len(shape))])
        idx = idx + ar * evaluate_dim(st, env)
        if spec.mask is not None:
            lo, hi = (evaluate_dim(v, env) for v in spec.mask[k])
            valid = valid & (ar >= lo) & (ar < hi)
    safe = np.where(valid, idx, 0)
    if flat.size == 0:
        return np.zeros(shape, dtype=flat.dtype)
    return np.where(valid, flat[safe], np.zeros((), dtype=flat.dtype)).astype(flat.dtype)


def evaluate(g: Graph, inputs: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray],
             env: Mapping[str, int] | None = None) -> list[np.ndarray]:
    env = dict(env or {})
    vals: list[np.ndarray] = []
    with np.errstate(all="ignore"):
        for n in g.nodes:
            vals.append(_eval_node(n, [vals[j] for j in n.inputs], inputs, weights, env))
    return [vals[o] for o in g.outputs]


def _eval_node(n: Node, a: list[np.ndarray], inputs, weights, env) -> np.ndarray:
    dt = n.dtype.numpy
    op = n.op
    if op is Op.INPUT:
        return np.asarray(inputs[n.name])
    if op is Op.WEIGHT:
        return np.asarray(weights[n.name])
    if op is Op.CONSTANT:
        return np.asarray(n.value, dtype=dt)
    if op is Op.VIEW:
        return apply_view(a[0], n.view, env)
    if op is Op.EXP2:
        return np.exp2(a[0]).astype(dt)
    if op is Op.LOG2:
        return np.log2(a[0]).astype(dt)
    if op is Op.SIN:
        return np.sin(a[0]).astype(dt)
    if op is Op.SQRT:
        return np.sqrt(a[0]).astype(dt)
    if op is Op.RECIP:
        return (np.ones((), dt) / a[0]).astype(dt)
    if op is Op.ADD:
        return (a[0] | a[1]) if dt == np.bool_ else (a[0] + a[1]).astype(dt)
    if op is Op.MUL:
        return (a[0] & a[1]) if dt == np.bool_ else (a[0] * a[1]).astype(dt)
    if op is Op.MOD:
        return np.mod(a[0], a[1]).astype(dt)  # floor mod, the sign of the divisor (torch.remainder)
    if op is Op.LESS_THAN:
        return a[0] < a[1]
    if op is Op.WHERE:
        return np.where(a[0], a[1], a[2]).astype(dt)
    if op is Op.SUM_REDUCE:
        acc = np.float32 if n.dtype.is_half else dt  # 16-bit floats accumulate in f32, as in torch
        return np.sum(a[0], axis=n.axis, keepdims=True, dtype=acc).astype(dt)
    if op is Op.MAX_REDUCE:
        if a[0].shape[n.axis] == 0:
            return np.full(tuple(evaluate_dim(d, env) for d in n.shape), -np.inf, dtype=dt)
        return np.max(a[0], axis=n.axis, keepdims=True)
    if op is Op.CAST:
        return a[0].astype(dt)
    if op is Op.IOTA:
        shape = tuple(evaluate_dim(d, env) for d in n.shape)
        ar = np.arange(shape[n.axis], dtype=dt).reshape([-1 if k == n.axis else 1 for k in range(len(shape))])
        return np.broadcast_to(ar, shape).copy()
    if op is Op.GATHER:
        return np.take_along_axis(a[0], _checked(a[1], a[0].shape[n.axis]), axis=n.axis)
    if op is Op.SCATTER:
        out = a[0].copy()
        np.put_along_axis(out, _checked(a[1], out.shape[n.axis]), a[2], axis=n.axis)
        return out
    raise NotImplementedError(op)


def _checked(index: np.ndarray, size: int) -> np.ndarray:
    """Gather/Scatter indices must lie in [0, size): no wrapping, as in torch.gather."""
    index = index.astype(np.int64)
    if index.size and (index.min() < 0 or index.max() >= size):
        raise IndexError(f"index out of range [0, {size})")
    return index


__all__ = ["evaluate", "apply_view", "numel"]
