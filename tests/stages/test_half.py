"""f16 and bf16 models: 16-bit storage, f32 compute inside kernels.

Tolerance, stated and justified. Both torch eager and kiln compute each op in f32 and round
the results they store to the 16-bit type, but at different points: eager after every op,
kiln at kernel boundaries (fused intermediates stay in f32). So an output can differ from
eager's by the roundings of a few stored intermediates, each one unit in the last place (ulp)
at its magnitude. We check two things against a float64 run of the same 16-bit weights:
  - agreement: |kiln - eager| <= 4 ulp of the output's scale (max |reference|);
  - accuracy: kiln's error is at most twice eager's own error plus one ulp, so kiln is never
    meaningfully less accurate than torch in the same dtype.
ulp(x) = 2**(floor(log2 x) - mantissa bits), mantissa bits 10 for f16 and 7 for bf16.
"""

import copy
import math

import numpy as np
import pytest
import torch

import kiln
from kiln.apps.examples import MLP, SmallResNet
from kiln.hf import ModelOutputTensor
from helpers import bert as _bert, llama as _llama

pytestmark = pytest.mark.slow(minutes=5)  # its file starts first under make test

MANTISSA = {torch.float16: 10, torch.bfloat16: 7}


def ulp(x: float, dtype) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - MANTISSA[dtype])


def _mlp():
    return MLP(), (torch.randn(4, 64),), {}


def _cnn():
    return SmallResNet(), (torch.randn(2, 3, 16, 16),), {}


def _hf(build):
    def make():
        model, kwargs = build()
        return ModelOutputTensor(model), (), kwargs
    make.__name__ = build.__name__
    return make


def check_half(model, args, kwargs, dtype, pipeline):
    model = copy.deepcopy(model).eval().to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        eager = model(*args, **kwargs).double()
        ref = copy.deepcopy(model).double()(*(a.double() if a.is_floating_point() else a for a in args), **kwargs)
    out = kiln.compile(model, args, kwargs, pipeline=pipeline)(*args, **kwargs)
    assert out.dtype == dtype and out.shape == ref.shape
    out = out.double()
    u = ulp(ref.abs().max().item(), dtype)
    agree, err, eager_err = (out - eager).abs().max().item(), (out - ref).abs().max().item(), \
        (eager - ref).abs().max().item()
    assert agree <= 4 * u, f"|kiln - eager| = {agree:.3e} > 4 ulp ({4 * u:.3e})"
    assert err <= 2 * eager_err + u, f"kiln error {err:.3e} vs eager's {eager_err:.3e} (ulp {u:.3e})"


CASES = [(_mlp, torch.float16), (_mlp, torch.bfloat16), (_cnn, torch.float16), (_cnn, torch.bfloat16),
         (_hf(_llama), torch.float16), (_hf(_llama), torch.bfloat16), (_hf(_bert), torch.bfloat16)]


@pytest.mark.parametrize("build,dtype", CASES, ids=[f"{b.__name__.strip('_')}-{str(d)[6:]}" for b, d in CASES])
def test_half_model_matches_eager(local_pipeline, build, dtype):
    torch.manual_seed(0)
    model, args, kwargs = build()
    check_half(model, args, kwargs, dtype, local_pipeline)


def test_bf16_tensors_travel_over_grpc(remote_pipeline):
    torch.manual_seed(0)
    model, args, kwargs = _mlp()
    check_half(model, args, kwargs, torch.bfloat16, remote_pipeline)


def test_half_conversions_are_exact():
    """The generated 16-bit <-> f32 conversions agree bit for bit with numpy and ml_dtypes on every
    16-bit word and on a million random f32 values (round to nearest even, inf, NaN, subnormals)."""
    from numba import njit

    from codegen_svc.targets.cpu.target import HALF_HELPERS, HEADER
    from kiln.ir.dtypes import DType

    ns: dict = {}
    exec(HEADER + HALF_HELPERS.replace("cache=True, ", ""), ns)
    h2f, f2h, b2f, f2b = ns["_h2f"], ns["_f2h"], ns["_b2f"], ns["_f2b"]

    @njit
    def convert(words, xs, wh, wb, xh, xb):
        for i in range(words.size):
            wh[i] = h2f(words[i])
            wb[i] = b2f(words[i])
        for i in range(xs.size):
            xh[i] = f2h(xs[i])
            xb[i] = f2b(xs[i])

    words = np.arange(1 << 16, dtype=np.uint16)
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.integers(0, 1 << 32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                         words.view(np.float16).astype(np.float32),
                         np.array([65519.99, 65520, 2.98e-8, 2.9802322e-08, 1e-45, -0.0], np.float32)])
    wh, wb = np.empty(words.size, np.float32), np.empty(words.size, np.float32)
    xh, xb = np.empty(xs.size, np.uint16), np.empty(xs.size, np.uint16)
    convert(words, xs, wh, wb, xh, xb)
    for got, want in ((wh, words.view(np.float16).astype(np.float32)),
                      (wb, words.view(DType.BF16.numpy).astype(np.float32))):
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    nan = np.isnan(xs)
    with np.errstate(over="ignore", invalid="ignore"):
        for got, dt in ((xh, np.float16), (xb, DType.BF16.numpy)):
            want = xs.astype(dt)
            assert np.array_equal(got[~nan], want.view(np.uint16)[~nan])
            assert np.isnan(got[nan].view(dt).astype(np.float32)).all()
