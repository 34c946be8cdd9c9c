"""Dynamic shapes: one compiled bundle serves every batch and sequence length in range."""

import re

import numpy as np
import pytest
import torch
from torch.export import Dim

import kiln
from kiln.core.errors import InvalidArgument
from kiln.apps.examples import encoder_example, mlp_example
from helpers import Fn, pairs

pytestmark = pytest.mark.slow(minutes=3)  # its file starts first under make test


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
    from kiln.v1 import ir_pb2

    memory = local_pipeline.store.get_message(bundle, ir_pb2.Bundle).memory
    assert memory.arena_bytes == 0 and memory.slots  # symbolic sizes: slots, each sized per run


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


def test_a_dims_size_used_as_a_value(local_pipeline):
    """A symbolic dim's size used in arithmetic (x + len(x), positions counted from it) is the
    size bound at run time, not a constant of the example's."""
    from helpers import Fn

    fn = lambda x: x * x.shape[0] + torch.arange(x.shape[0], dtype=torch.float32)[:, None]  # noqa: E731
    compiled = kiln.compile(Fn(fn), (torch.randn(5, 3),), pipeline=local_pipeline,
                            dynamic_shapes={"xs": ({0: Dim("n", min=2, max=64)},)})
    for n in (2, 5, 17, 64):
        x = torch.randn(n, 3)
        assert torch.allclose(compiled(x), fn(x), rtol=1e-6, atol=1e-5), n


def test_llama_decode_step_with_a_symbolic_past(local_pipeline):
    """One decode step of a tiny Llama over a KV cache whose length is a symbolic dim: the cache
    comes in as inputs, the step appends the new token's keys and values, and one bundle serves
    every past length, matching transformers (logits and the grown cache)."""
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2)).eval()

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, ids, pos, kv):
            cache = DynamicCache()
            for i in range(2):
                cache.update(kv[2 * i], kv[2 * i + 1], i)
            out = self.m(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            grown = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
            return (out.logits, *grown)

    step = Decode().eval()
    kv = tuple(torch.randn(1, 2, 5, 32) for _ in range(4))
    ids, pos = torch.tensor([[7]]), torch.tensor([[5]])
    compiled = kiln.compile(step, (ids, pos, kv), pipeline=local_pipeline,
                            dynamic_shapes=(None, None, tuple({2: Dim.AUTO(min=2, max=256)} for _ in kv)))
    bundle = compiled.result.bundle
    with torch.no_grad():
        for past in (2, 9, 40, 256):
            kv = tuple(torch.randn(1, 2, past, 32) for _ in range(4))
            ids, pos = torch.randint(0, 1000, (1, 1)), torch.tensor([[past]])
            got, want = compiled(ids, pos, kv), step(ids, pos, kv)
            assert [g.shape for g in got] == [w.shape for w in want], past
            for g, w in pairs(got, want):
                assert torch.allclose(g, w, rtol=1e-4, atol=1e-5), (past, (g - w).abs().max())
    assert compiled.result.bundle == bundle


def test_comparisons_and_min_of_dims_decided_for_every_binding():
    """Dims compared (export's run-time asserts) or taken min/max of (a causal mask's length)
    lower to what holds for every binding, symbols being never negative; what depends on the
    binding is None for a comparison and an error for a min."""
    from importer_svc.lowerings import _dim_compare, lower_dim_min
    from kiln.core.errors import FailedPrecondition
    from kiln.ir.shape import Sym

    p = Sym.named("past")
    table = {("le", 32 + 32 * p, 64 + 64 * p): True, ("gt", 32 + 32 * p, 64 + 64 * p): False,
             ("eq", p + 1, p + 1): True, ("ne", p + 1, p): True, ("lt", p, p + 1): True,
             ("ge", p, 3): None, ("eq", p, 3): None, ("lt", 2, 3): True}
    for (op, x, y), want in table.items():
        assert _dim_compare(op, x, y) is want, (op, x, y)
    assert lower_dim_min(None, None, 64 + 64 * p, 32 + 32 * p) == 32 + 32 * p
    with pytest.raises(FailedPrecondition, match="depends on their values"):
        lower_dim_min(None, None, p, 3)


def test_a_gqa_attention_and_a_few_rows_gemm_over_symbolic_dims(local_pipeline):
    """Keys and values of 2 heads read by 4 query heads (broadcast, merged, transposed views over
    a cache of symbolic length) are packed in the source's own loops, with no index unravelled;
    a GEMM with at most 8 rows (a decode step's batch) shares its columns across the pool.
    Both match torch for every length and batch."""
    w = torch.randn(512, 64)

    def fn(q, k, v, x):
        k4 = k[:, :, None].expand(-1, -1, 2, -1, -1).reshape(k.shape[0], 4, k.shape[2], 16)
        v4 = v[:, :, None].expand(-1, -1, 2, -1, -1).reshape(v.shape[0], 4, v.shape[2], 16)
        att = torch.softmax(q @ k4.transpose(-1, -2) * 0.25, dim=-1) @ v4
        return att, torch.relu(x @ w.t())

    past, batch = Dim("past", min=2, max=64), Dim("batch", min=1, max=8)
    args = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, 9, 16), torch.randn(1, 2, 9, 16), torch.randn(3, 64))
    compiled = kiln.compile(Fn(fn), args, pipeline=local_pipeline,
                            dynamic_shapes={"xs": (None, {2: past}, {2: past}, {0: batch})})
    from kiln.v1 import ir_pb2

    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    sources = "\n".join(k.source for k in bundle.kernels)
    # the keys' and values' two heads (q1), each read twice (q2), in the source's loops
    assert re.search(r"for q1 in p?range\(2\):\n\s+for q2 in range\(2\):", sources), sources
    assert "np.dot(A[0], B[0][n0:n1].T, cb)" in sources, sources
    for n, b in ((2, 1), (9, 3), (64, 8)):
        args = (torch.randn(1, 4, 1, 16), torch.randn(1, 2, n, 16), torch.randn(1, 2, n, 16), torch.randn(b, 64))
        for got, want in pairs(compiled(*args), fn(*args)):
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (n, b, (got - want).abs().max())
