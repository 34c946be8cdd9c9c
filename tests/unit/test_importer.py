"""Importer: each lowering against torch eager (through the reference evaluator), weights, errors."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from importer_svc.importer import import_program, lower_program
from importer_svc.lowerings import LOWERINGS
from kiln.core.errors import FailedPrecondition
from kiln.ir.evaluate import evaluate
from kiln.pipeline import Pipeline
from kiln.v1 import ir_pb2
from helpers import Fn, pairs

aten = torch.ops.aten



def _check(fn, *inputs, rtol=1e-5, atol=1e-6):
    ep = torch.export.export(Fn(fn), inputs)
    graph, weights = lower_program(ep)
    names = [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    outs = evaluate(graph, {n: x.numpy() for n, x in zip(names, inputs)},
                    {k: v.detach().numpy() for k, v in weights.items()})
    ref = fn(*inputs)
    ref = ref if isinstance(ref, tuple) else (ref,)
    for o, r in pairs(outs, ref):
        np.testing.assert_allclose(o, r.detach().numpy(), rtol=rtol, atol=atol, equal_nan=True)
    return graph


torch.manual_seed(0)  # the cases' inputs are the same in every run (an unseeded conv2d case once missed its tolerance)
x34 = torch.randn(3, 4)
y34 = torch.randn(3, 4)
edge = torch.tensor([[0.0, -0.0, 1.5, -2.5], [float("inf"), -float("inf"), float("nan"), 40.0]])

CASES = {
    "linear": (lambda x, w, b: F.linear(x, w, b), (torch.randn(2, 5, 4), torch.randn(6, 4), torch.randn(6))),
    "addmm": (lambda b, x, w: torch.addmm(b, x, w), (torch.randn(6), torch.randn(3, 4), torch.randn(4, 6))),
    "mm": (lambda x, w: x @ w, (torch.randn(3, 4), torch.randn(4, 5))),
    "bmm": (torch.bmm, (torch.randn(2, 3, 4), torch.randn(2, 4, 5))),
    "relu": (torch.relu, (edge,)),
    "gelu": (F.gelu, (torch.linspace(-6, 6, 97),)),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), (torch.linspace(-6, 6, 97),)),
    "tanh": (torch.tanh, (torch.linspace(-20, 20, 101),)),
    "sigmoid": (torch.sigmoid, (torch.linspace(-100, 100, 101),)),
    "softmax": (lambda x: torch.softmax(x, -1), (torch.randn(3, 7) * 10,)),
    "softmax_dim0": (lambda x: torch.softmax(x, 0), (torch.randn(3, 7),)),
    "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), (torch.randn(2, 3, 4), torch.randn(4),
                                                                 torch.randn(4))),
    "add": (lambda x, y: x + y, (x34, y34)),
    "add_broadcast": (lambda x, y: x + y, (x34, torch.randn(4))),
    "add_alpha": (lambda x, y: torch.add(x, y, alpha=2.5), (x34, y34)),
    "sub": (lambda x, y: x - y, (x34, torch.randn(3, 1))),
    "rsub": (lambda x: 1.0 - x, (x34,)),
    "mul": (lambda x, y: x * y, (x34, y34)),
    "mul_scalar": (lambda x: x * 3.0, (edge,)),
    "div": (lambda x, y: x / y, (x34, y34)),
    "div_scalar": (lambda x: x / 7.0, (x34,)),
    "view": (lambda x: x.view(2, 6) * 2, (x34,)),
    "reshape_noncontig": (lambda x: x.t().reshape(12) + 1, (x34,)),
    "permute": (lambda x: x.permute(2, 0, 1) + 1, (torch.randn(2, 3, 4),)),
    "transpose": (lambda x: x.transpose(-1, -2) + 1, (torch.randn(2, 3, 4),)),
    "expand": (lambda x: x.expand(3, 2, 4) + 1, (torch.randn(2, 1),)),
    "unsqueeze": (lambda x: x.unsqueeze(-2) + 1, (x34,)),
    "slice": (lambda x: x[:, 1:3] + x[:, ::2][:, :2], (x34,)),
    "select": (lambda x: x[1] + x[:, 2:3].squeeze(-1).sum(), (x34,)),
    "chunk": (lambda x: x.chunk(2, -1)[1] * 2, (x34,)),
    "cat": (lambda x, y: torch.cat([x, y * 2], dim=1) + 0, (x34, y34)),
    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
             (torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8))),
    "sdpa_causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    (torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4))),
    "sdpa_mask_scale": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3),
                        (torch.randn(2, 2, 4, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8),
                         torch.tensor([[True, True, False, True, False]] * 4))),
    "sdpa_fully_masked_row": (lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m),
                              (torch.randn(1, 1, 2, 4), torch.tensor([[False, False], [True, False]]))),
    "sdpa_float_mask": (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
                        (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4),
                         torch.randn(3, 3))),
    "sdpa_gqa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                 (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))),
    "exp_log": (lambda x: torch.log(torch.exp(x) + 1.0), (x34,)),
    "sqrt_rsqrt": (lambda x: torch.sqrt(x.abs()) + torch.rsqrt(x.abs() + 1), (x34,)),
    "pow": (lambda x: x.pow(2) + x.pow(3) + x.pow(0), (x34,)),
    "pow_negative_base": (lambda x: x.pow(10) + x.pow(-2) + x.pow(2.5) + x.pow(-3.0), (edge,)),
    "pow_tensor": (lambda x, y: torch.pow(x, y), (torch.tensor([-2.0, -2.0, -0.5, 0.0, 0.0, 0.0, 1.0, -1.0, 3.0,
                                                                float("nan"), float("nan"), -float("inf")]),
                                                  torch.tensor([3.0, 0.5, 4.0, 2.0, 0.0, -1.0, float("nan"),
                                                                float("inf"), -2.0, 0.0, 2.0, 3.0]))),
    "pow_scalar_base": (lambda y: torch.pow(2.0, y) + torch.pow(-8.0, (y * 4).to(torch.int64).to(torch.float32)), (x34,)),
    "mean_sum": (lambda x: x.mean(-1, keepdim=True) + x.sum(0), (x34,)),
    "amax": (lambda x: torch.amax(x, dim=1), (x34,)),
    "where_cmp": (lambda x, y: torch.where(x > y, x, y * 2) + (x <= 0).float() + (x == y).float(), (x34, y34)),
    "compare_nan": (lambda x: torch.stack([(x < 1).float(), (x >= 1).float(), (x != x).float()]).sum(0) + 0,
                    (edge,)),
    "embedding": (lambda w, i: F.embedding(i, w), (torch.randn(10, 4), torch.tensor([[1, 9, 0], [3, 3, 2]]))),
    "gather": (lambda x, i: torch.gather(x, 1, i), (torch.randn(3, 5), torch.tensor([[0, 4], [2, 2], [1, 3]]))),
    "to_dtype": (lambda x: (x * 3).to(torch.int64).to(torch.float32), (x34,)),
    "cumsum": (lambda x: torch.cumsum(x, 1) + torch.cumsum(x, 0), (x34,)),
    "cumsum_bool": (lambda m: torch.cumsum(m, -1), (torch.tensor([[True, False, True], [False, True, True]]),)),
    "index_skipped_dims": (lambda x, i, j: (x[:, i] * 2, x[:, :, j] * 2, x[i[:, :1], :, j] * 2),
                           (torch.randn(4, 5, 3), torch.tensor([[0], [3], [-1]]), torch.tensor([[1, 2]]))),
    "index": (lambda x, i, j: x[i, j], (torch.randn(4, 5, 3), torch.tensor([[0], [3], [-1]]), torch.tensor([[1, 4]]))),
    "bool_ops": (lambda x, y: ((x > 0) & (y > 0)).float() + ((x > 0) | (y < 0)).float() + (~(x > y)).float(),
                 (x34, y34)),
    "conv2d": (lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), (torch.randn(2, 4, 9, 9),
                                                                          torch.randn(6, 4, 3, 3), torch.randn(6))),
    "conv2d_groups_dilation": (lambda x, w: F.conv2d(x, w, stride=1, padding=2, dilation=2, groups=2),
                               (torch.randn(1, 4, 7, 7), torch.randn(6, 2, 3, 3))),
    "conv1d": (lambda x, w: F.conv1d(x, w, padding=1), (torch.randn(2, 3, 10), torch.randn(5, 3, 3))),
    "max_pool2d": (lambda x: F.max_pool2d(x, 3, stride=2, padding=1), (torch.randn(2, 3, 9, 9) - 5,)),
    "batch_norm_eval": (lambda x, m, v, w, b: F.batch_norm(x, m, v, w, b, training=False, eps=1e-3),
                        (torch.randn(2, 3, 4, 4), torch.randn(3), torch.rand(3) + 0.5, torch.randn(3),
                         torch.randn(3))),
    "adaptive_avg_pool": (lambda x: F.adaptive_avg_pool2d(x, 1) + F.adaptive_avg_pool2d(x, (2, 2)).sum(),
                          (torch.randn(2, 3, 4, 4),)),
    "maximum": (lambda x, y: torch.maximum(x, y) + torch.minimum(x, y), (edge, edge.flip(0))),
    "linear_no_bias": (lambda x, w: F.linear(x, w), (torch.randn(3, 4), torch.randn(6, 4))),
    "linear_vector_input": (lambda x, w, b: F.linear(x, w, b), (torch.randn(4), torch.randn(6, 4), torch.randn(6))),
    "linear_vector_weight": (lambda x, w: F.linear(x, w), (torch.randn(2, 3, 4), torch.randn(4))),
    "to_half_and_back": (lambda x: x.to(torch.float16).to(torch.float32) * 2, (x34,)),
    "and_or_bool": (lambda x, y: (((x > 0) & (y > 0)) | (x > 1)).to(torch.float32), (x34, y34)),
    "new_ones": (lambda x: x + x.new_ones(3, 4), (x34,)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lowering_matches_torch(name):
    fn, inputs = CASES[name]
    _check(fn, *inputs)


def test_erf_approximation_error_below_1e6():
    x = torch.linspace(-6, 6, 20001)
    graph = _check(torch.erf, x, atol=1e-6, rtol=0)
    out = evaluate(graph, {graph.inputs[0].name: x.numpy()}, {})[0].astype(np.float64)
    ref = np.array([math.erf(v) for v in x.double().numpy()])
    assert np.abs(out - ref).max() <= 1e-6


def test_registry_covers_issue_ops():
    needed = [aten.addmm.default, aten.mm.default, aten.bmm.default, aten.relu.default, aten.gelu.default,
              aten.tanh.default, aten.sigmoid.default, aten._softmax.default, aten.native_layer_norm.default,
              aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.view.default,
              aten.permute.default, aten.expand.default, aten.unsqueeze.default, aten.slice.Tensor]
    assert all(op in LOWERINGS for op in needed)


def test_unsupported_op_names_op_and_line():
    class UsesSort(torch.nn.Module):
        def forward(self, x):
            return torch.sort(x, dim=0)[0]

    with pytest.raises(FailedPrecondition) as e:
        lower_program(torch.export.export(UsesSort(), (x34,)))
    msg = str(e.value)
    assert "aten.sort" in msg and "test_importer.py" in msg and "torch.sort(x, dim=0)[0]" in msg


def test_weights_are_one_blob_per_tensor(file_store):
    from kiln.apps.examples import mlp_example

    model, inputs = mlp_example()
    p = Pipeline(file_store)
    program = p.upload_program(torch.export.export(model, inputs))
    r = import_program(file_store, program)
    manifest = file_store.get_message(r.manifest, ir_pb2.WeightManifest)
    assert sorted(w.name for w in manifest.weights) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    state = model.state_dict()
    for w in manifest.weights:
        from kiln.cas.digest import Digest

        data = np.frombuffer(file_store.get(Digest.from_pb(w.digest)), np.float32).reshape(tuple(w.shape))
        np.testing.assert_array_equal(data, state[w.name].numpy())
    # a second import is an action-cache hit with identical digests
    again = import_program(file_store, program)
    assert (again.graph, again.manifest) == (r.graph, r.manifest)


def test_a_program_whose_ops_all_have_lowerings_is_not_decomposed():
    """Decomposition traces the whole program again (an 8-layer Llama's prefill: 14 s); a program
    whose every op has a lowering as exported (a Llama's: linear, to, new_ones, ...) is lowered
    as it is, and computes what eager does. One with a composite op still decomposes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from importer_svc.importer import lowered_whole

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=64, vocab_size=97, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()

    class Logits(torch.nn.Module):
        def forward(self, ids):
            return model(input_ids=ids).logits

    ids = torch.randint(0, 97, (2, 7))
    ep = torch.export.export(Logits(), (ids,))
    assert lowered_whole(ep)
    graph, weights = lower_program(ep)
    (out,) = evaluate(graph, {graph.inputs[0].name: ids.numpy()}, {k: v.detach().numpy() for k, v in weights.items()})
    with torch.no_grad():
        np.testing.assert_allclose(out, model(input_ids=ids).logits.numpy(), rtol=1e-4, atol=1e-5)
    assert not lowered_whole(torch.export.export(Fn(lambda x: F.layer_norm(x, (4,))), (x34,)))
