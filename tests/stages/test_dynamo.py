"""torch.compile(model, backend="kiln") through the torch_dynamo_backends entry point."""

import pytest
import torch

from kiln.apps.examples import mlp_example


def test_backend_is_registered_by_entry_point():
    from torch._dynamo import list_backends

    assert "kiln" in list_backends(exclude_tags=())


def test_torch_compile_with_kiln_matches_eager():
    torch._dynamo.reset()
    model, inputs = mlp_example(seed=5)
    compiled = torch.compile(model, backend="kiln", dynamic=False)
    with torch.no_grad():
        out = compiled(*inputs)
        ref = model(*inputs)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_unlowerable_graph_raises_clearly():
    torch._dynamo.reset()

    def f(x):
        return torch.sort(x, dim=0)[0]

    with pytest.raises(Exception, match=r"aten\.sort"):
        torch.compile(f, backend="kiln", dynamic=False)(torch.randn(4, 3))


@pytest.mark.parametrize("which", ["llama", "cnn"])
def test_torch_compile_with_kiln_on_llama_and_cnn(which):
    from kiln.apps.examples import SmallResNet
    from kiln.hf import ModelOutputTensor
    from helpers import llama as _llama

    torch._dynamo.reset()
    torch.manual_seed(0)
    if which == "llama":
        model, kwargs = _llama()
        model = ModelOutputTensor(model.eval())
        args = ()
    else:
        model, args, kwargs = SmallResNet().eval(), (torch.randn(2, 3, 16, 16),), {}
    compiled = torch.compile(model, backend="kiln", dynamic=False)
    with torch.no_grad():
        out = compiled(*args, **kwargs)
        ref = model(*args, **kwargs)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), (out - ref).abs().max()
