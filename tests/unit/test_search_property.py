"""Property test of the whole optimizer: random primitive graphs, optimized vs unoptimized.

Hypothesis builds graphs from every op family (unary, binary, select, both reductions, views
that permute, reshape, broadcast and pad, casts, constants) and from the importer's forms of
matmuls, softmax, RMS norm and layer norm (what the matmul, norms and attention rules
recognise: a softmax followed by a matmul is attention) over two 4x4 inputs, saturates
them with every ruleset, and checks that the reference evaluator gives the same outputs for
the extracted program as for the original. Tolerance: rtol 1e-4 / atol 1e-5 with NaN where
NaN, since rewrites may reassociate float arithmetic (a few ulp per reassociation).
Comparisons and Mod read only inputs and constants, so a reassociated rounding can never
flip a branch and turn a few ulp into a wrong-looking answer.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kiln.ir import compose as C
from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.evaluate import evaluate
from kiln.ir.ops import Op
from optimizer_svc.saturate import SearchLimits, saturate

pytestmark = pytest.mark.slow(minutes=7)  # its file starts first under make test

N = 4
SHAPE = (N, N)
CONSTS = (0.0, 1.0, -1.0, 2.0, 0.5, 3.0)
UNARY = (Op.EXP2, Op.LOG2, Op.SIN, Op.SQRT, Op.RECIP)
STEPS = ("unary", "add", "mul", "const_add", "const_mul", "where", "sum", "max", "permute", "reshape",
         "pad", "cast", "mod", "neg", "matmul", "softmax", "rms_norm", "layer_norm")


def build(steps):
    """A graph from a list of (step, a, b, k) choices; a and b pick earlier float values."""
    b = GraphBuilder()
    x = b.input("x", SHAPE, DType.F32)
    y = b.input("y", SHAPE, DType.F32)
    vals = [x, y]
    conds = [b.binary(Op.LESS_THAN, x, y)]
    for step, i, j, k in steps:
        u, v = vals[i % len(vals)], vals[j % len(vals)]
        c = b.const(CONSTS[k % len(CONSTS)], DType.F32, SHAPE)
        if step == "unary":
            r = b.unary(UNARY[k % len(UNARY)], u)
        elif step in ("add", "mul"):
            r = b.binary(Op.ADD if step == "add" else Op.MUL, u, v)
        elif step == "const_add":
            r = b.binary(Op.ADD, u, c) if k % 2 else b.binary(Op.ADD, c, u)
        elif step == "const_mul":
            r = b.binary(Op.MUL, u, c) if k % 2 else b.binary(Op.MUL, c, u)
        elif step == "neg":
            r = b.binary(Op.MUL, u, b.const(-1.0, DType.F32, SHAPE))
        elif step == "where":
            if k % 3 == 0:
                conds.append(b.binary(Op.LESS_THAN, vals[0], b.const(CONSTS[k % len(CONSTS)], DType.F32, SHAPE)))
            r = b.where(conds[k % len(conds)], u, v)
        elif step in ("sum", "max"):
            axis = k % 2
            op = Op.SUM_REDUCE if step == "sum" else Op.MAX_REDUCE
            red = b.reduce(op, u, axis)
            if k % 3 == 2:  # over both axes: the reductions rules merge them
                red = b.reduce(op, red, 1 - axis)
            r = b.expand(red, SHAPE)
        elif step == "permute":
            r = b.permute(u, (1, 0))
        elif step == "reshape":
            r = b.reshape(b.reshape(b.reshape(u, (N * N,)), (2, N * N // 2)), SHAPE)
        elif step == "pad":  # drop the last column and pad it back with zeros
            from kiln.ir import view as views

            sl = b.view(u, views.slice_(SHAPE, 1, 0, N - 1, 1))
            r = b.view(sl, views.pad((N, N - 1), ((0, 0), (0, 1))))
        elif step == "cast":
            r = b.cast(b.cast(u, DType.I32), DType.F32) if k % 2 else b.cast(b.binary(Op.LESS_THAN, y, u), DType.F32)
        elif step == "mod":
            r = b.binary(Op.MOD, vals[k % 2], b.const(CONSTS[3 + k % 3], DType.F32, SHAPE))
        elif step == "matmul":  # u @ v or u @ v.T
            r = C.matmul(b, u, v if k % 2 else b.permute(v, (1, 0)))
        elif step == "softmax":
            r = C.softmax(b, u, k % 2)
        elif step in ("rms_norm", "layer_norm"):
            axis = k % 2
            t = C.sub(b, u, C.mean(b, u, [axis], True)) if step == "layer_norm" else u
            var = C.mean(b, C.mul(b, t, t), [axis], True)
            r = C.mul(b, t, b.unary(Op.RECIP, b.unary(Op.SQRT, C.add(b, var, C.scalar(b, var, 1e-5)))))
        vals.append(r)
    outs = [vals[-1]] if len(vals) < 4 else [vals[-1], vals[len(vals) // 2]]
    return b.build(outs)


# random graphs per run: `make test` (and CI) 500; `make test-unit`, the fast loop, sets fewer
EXAMPLES = int(os.environ.get("KILN_PROPERTY_EXAMPLES", "500"))
step = st.tuples(st.sampled_from(STEPS), st.integers(0, 30), st.integers(0, 30), st.integers(0, 30))


def _close(a, b) -> bool:
    return np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)


def _well_conditioned(g, inputs, before, rng) -> bool:
    """Whether the original graph's outputs stay within the tolerance when each input element
    moves by a few ulp. Where they do not (log2 of a sum of layer-normed values, which is zero
    but for rounding: -22 from one order of the sum, NaN from another), a rewrite's
    reassociation cannot be told from a wrong rewrite at this tolerance, and the example is
    not used."""
    for _ in range(3):
        nudged = {k: v + v * rng.uniform(-4, 4, v.shape).astype(np.float32) * np.float32(2.0 ** -23)
                  for k, v in inputs.items()}
        if not all(_close(n0, b0) for b0, n0 in zip(before, evaluate(g, nudged, {}))):
            return False
    return True


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=1, max_size=12), seed=st.integers(0, 2**16))
# found by CI runs: log2 of a sum that is zero but for rounding (ill-conditioned, not used)
@example(steps=[("layer_norm", 0, 0, 0), ("unary", 0, 0, 0), ("sum", 2, 0, 26), ("unary", 0, 0, 0),
                ("unary", 0, 0, 0), ("unary", 18, 0, 1)], seed=0)
@example(steps=[("layer_norm", 0, 0, 3), ("unary", 0, 0, 0), ("sum", 10, 0, 26), ("unary", 0, 0, 0),
                ("unary", 0, 0, 0), ("unary", 18, 0, 11)] + [("unary", 0, 0, 0)] * 6, seed=192)
def test_optimized_graph_matches_unoptimized(steps, seed):
    g = build(steps)
    opt, report = saturate(g, SearchLimits(max_iterations=12, max_enodes=20_000, time_budget_s=10.0))
    rng = np.random.default_rng(seed)
    inputs = {"x": rng.uniform(-3, 3, SHAPE).astype(np.float32), "y": rng.uniform(-3, 3, SHAPE).astype(np.float32)}
    before, after = evaluate(g, inputs, {}), evaluate(opt, inputs, {})
    assume(_well_conditioned(g, inputs, before, rng))
    assert len(before) == len(after)
    for b0, a0 in zip(before, after):
        assert a0.shape == b0.shape and a0.dtype == b0.dtype
        np.testing.assert_allclose(a0, b0, rtol=1e-4, atol=1e-5, equal_nan=True,
                                   err_msg=f"{report.stop_reason}; rules {sorted(k for k, v in report.rules.items() if v)}")
