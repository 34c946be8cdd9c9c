"""Dynamic shapes: one compiled bundle serves every batch and sequence length in range."""

import numpy as np
import pytest
import torch
from torch.export import Dim

import kiln
from kiln.errors import InvalidArgument
from kiln.examples import encoder_example, mlp_example


def test_encoder_with_symbolic_batch_and_seq(local_pipeline):
    model, (x,) = encoder_example()
    compiled = kiln.compile(model, (x,), pipeline=local_pipeline,
                            dynamic_shapes={"x": {0: Dim("batch", max=8), 1: Dim("seq", max=32)}})
    bundle = compiled.result.bundle
    for b, t in [(1, 1), (3, 5), (2, 16), (8, 32), (1, 31)]:
        xx = torch.randn(b, t, 64)
        with torch.no_grad():
            ref = model(xx)
        out = compiled(xx)
        assert out.shape == ref.shape
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5), ((b, t), (out - ref).abs().max())
    assert compiled.result.bundle == bundle  # no recompilation


def test_out_of_range_and_inconsistent_shapes_are_invalid_argument(local_pipeline):
    model, (x,) = mlp_example()
    compiled = kiln.compile(model, (x,), pipeline=local_pipeline, dynamic_shapes={"x": {0: Dim("batch", max=64)}})
    for n in (1, 7, 64):
        xx = torch.randn(n, 64)
        assert torch.allclose(compiled(xx), model(xx), rtol=1e-4, atol=1e-5)
    with pytest.raises(InvalidArgument, match=r"outside the range"):
        compiled(torch.randn(65, 64))
    with pytest.raises(InvalidArgument, match=r"expected shape"):
        local_pipeline.run(compiled.session, [("x", np.zeros((4, 63), np.float32))])
