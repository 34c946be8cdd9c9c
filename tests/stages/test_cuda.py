"""The cuda target under numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by conftest.py unless
the environment says otherwise): every kernel kind, the MLP, tiny Llama and a BERT-shaped encoder,
small shapes, against torch eager with the CPU target's tolerances."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.cas.digest import Digest
from kiln.core.errors import FailedPrecondition, InvalidArgument
from kiln.apps.examples import Encoder, mlp_example
from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.serialize import graph_to_pb
from kiln.v1 import ir_pb2
from helpers import Fn, pairs

pytestmark = pytest.mark.slow(minutes=5)  # its file starts first under make test

TOL = dict(rtol=1e-4, atol=1e-5)  # the CPU target's


def _kinds(pipeline, compiled) -> list[str]:
    bundle = pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert bundle.target == "cuda"
    return [k.kind for k in bundle.kernels]


def _cuda(module, args, pipeline):
    return kiln.compile(module, args, target="cuda", pipeline=pipeline, candidates=1)


def _small(seed: int):
    """A two-kernel model with weights, for tests about sessions and transport rather than
    kernels (the simulator runs every GPU thread in Python: the MLP's take seconds)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval(), (torch.randn(3, 8),)


def test_elementwise_gather_gemm_reduce_kernels(local_pipeline):
    def fn(ids, table, w, x):
        e = F.embedding(ids, table)                         # gather
        h = F.gelu(e @ w)                                   # gemm with an epilogue
        s = torch.softmax(h, -1)                            # reductions
        c = torch.cat([s, F.pad(x, (1, 1))], dim=-1)        # masked views, elementwise
        return c * torch.arange(c.shape[-1], dtype=torch.float32), torch.amax(x, dim=1)  # iota, reduce

    ids = torch.tensor([[1, 4, 0], [2, 2, 3]])
    table, w, x = torch.randn(5, 8), torch.randn(8, 6), torch.randn(2, 3, 4)
    x[1, 2, 1] = float("nan")
    compiled = _cuda(Fn(fn), (ids, table, w, x), local_pipeline)
    assert {"gather", "gemm", "elementwise", "reduce"} <= set(_kinds(local_pipeline, compiled))
    for got, want in pairs(compiled(ids, table, w, x), fn(ids, table, w, x)):
        assert torch.allclose(got, want, equal_nan=True, **TOL)


def test_gemm_tiles_cover_ragged_edges_and_batches(local_pipeline):
    """M, N and K not multiples of the 16-wide tile; a batched GEMM; an epilogue reading C through a
    transpose (the second launch) and one reading its own element (the same thread)."""
    def fn(a, b, c, bias):
        return torch.relu(a @ b + bias), (torch.bmm(c, c.transpose(1, 2)) * 0.5).transpose(1, 2) + 1.0

    a, b, c, bias = torch.randn(19, 37), torch.randn(37, 21), torch.randn(3, 17, 5), torch.randn(21)
    compiled = _cuda(Fn(fn), (a, b, c, bias), local_pipeline)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    gemms = [k.source for k in bundle.kernels if k.kind == "gemm"]
    assert len(gemms) == 2
    # bias + relu finish in the GEMM's thread; the transposed read of C takes a second launch
    assert sorted("C = cuda.device_array" in src for src in gemms) == [False, True]
    for got, want in pairs(compiled(a, b, c, bias), fn(a, b, c, bias)):
        assert torch.allclose(got, want, **TOL)


def test_attention_kernel(local_pipeline):
    def fn(q, k, v, mask):
        s = (q @ k.transpose(-1, -2)) * 0.125 + mask
        return torch.softmax(s, -1) @ v

    q, k, v = torch.randn(2, 3, 9, 8), torch.randn(2, 3, 11, 8), torch.randn(2, 3, 11, 8)
    mask = torch.zeros(9, 11)
    mask[:, 7:] = float("-inf")
    compiled = _cuda(Fn(fn), (q, k, v, mask), local_pipeline)
    assert "attention" in _kinds(local_pipeline, compiled)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    source = next(k.source for k in bundle.kernels if k.kind == "attention")
    assert "Ksh = cuda.shared.array((32, 8)" in source and "Vsh = cuda.shared.array((32, 8)" in source
    assert torch.allclose(compiled(q, k, v, mask), fn(q, k, v, mask), **TOL)
    # 40 keys: more than one tile of K and of V, the last one ragged
    k2, v2, mask2 = torch.randn(2, 3, 40, 8), torch.randn(2, 3, 40, 8), torch.zeros(9, 40)
    mask2[:, 33:] = float("-inf")
    compiled = _cuda(Fn(fn), (q, k2, v2, mask2), local_pipeline)
    assert torch.allclose(compiled(q, k2, v2, mask2), fn(q, k2, v2, mask2), **TOL)


def test_scatter_kernel(local_pipeline):
    """No ATen op lowers to Scatter yet; the kernel is built from the IR."""
    b = GraphBuilder()
    dst = b.input("dst", (4, 6), DType.F32)
    index = b.input("index", (4, 3), DType.I64)
    src = b.input("src", (4, 3), DType.F32)
    g = b.build([b.scatter(dst, index, src, axis=1)], ["out"])
    p = local_pipeline
    graph = p.store.put_message(graph_to_pb(g))
    manifest = p.store.put_message(ir_pb2.WeightManifest())
    kg, _ = p.optimize(graph, search=False)
    bundle, kernels, _ = p.emit(kg, "cuda")
    session = p.load(bundle, manifest)
    d, s = np.random.default_rng(0).standard_normal((2, 4, 6)).astype(np.float32)[0], \
        np.arange(12, dtype=np.float32).reshape(4, 3)
    idx = np.array([[0, 2, 5], [1, 1 + 2, 4], [5, 0, 3], [2, 4, 1]], dtype=np.int64)
    out = p.run(session, [("dst", d), ("index", idx), ("src", s)])[0][1]
    want = torch.tensor(d).scatter(1, torch.tensor(idx), torch.tensor(s)).numpy()
    assert np.array_equal(out, want)
    with pytest.raises(InvalidArgument, match="out-of-range index"):
        p.run(session, [("dst", d), ("index", idx + 6), ("src", s)])


def test_out_of_range_gather_is_invalid_argument(local_pipeline):
    table = torch.randn(10, 4)
    compiled = _cuda(Fn(lambda i: F.embedding(i, table)), (torch.tensor([1, 2]),), local_pipeline)
    assert torch.equal(compiled(torch.tensor([9, 0])), table[[9, 0]])
    with pytest.raises(InvalidArgument, match="out-of-range index"):
        compiled(torch.tensor([3, 10]))


def test_mlp(local_pipeline):
    model, inputs = mlp_example(seed=2)
    compiled = _cuda(model, inputs, local_pipeline)
    with torch.no_grad():
        assert torch.allclose(compiled(*inputs), model(*inputs), **TOL)


def test_bert_shaped_encoder(local_pipeline):
    torch.manual_seed(0)
    model, x = Encoder(d=32, heads=2, ff=64, layers=2).eval(), torch.randn(2, 8, 32)
    compiled = _cuda(model, (x,), local_pipeline)
    assert {"attention", "row", "gemm"} <= set(_kinds(local_pipeline, compiled))  # norms are row kernels
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x), **TOL)


def test_tiny_llama(local_pipeline):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lm = LlamaForCausalLM(cfg).eval()
    wrapped = Fn(lambda ids: lm(input_ids=ids, use_cache=False).logits)
    ids = torch.randint(0, 100, (1, 7))
    compiled = _cuda(wrapped, (ids,), local_pipeline)
    assert {"attention", "gather", "gemm", "row"} <= set(_kinds(local_pipeline, compiled))
    with torch.no_grad():
        assert torch.allclose(compiled(ids), wrapped(ids), **TOL)


def test_weights_are_uploaded_once_per_session(local_pipeline):
    model, inputs = _small(seed=3)
    compiled = _cuda(model, inputs, local_pipeline)
    session = local_pipeline.local_executor().session(compiled.session)
    # device arrays (the simulator's too) copy back to the host; numpy arrays do not
    assert session.device is not None and all(hasattr(w, "copy_to_host") for w in session.weights)
    before = [id(w) for w in session.weights]
    compiled(*inputs)
    assert [id(w) for w in session.weights] == before


def test_launch_shapes_are_timed_candidates_and_the_fastest_is_kept(local_pipeline):
    """On cuda, a timed compile also times the best predicted program under other launch shapes
    (threads per block, GEMM tile) and keeps the fastest of all; the bundle is emitted with it."""
    w = torch.randn(8, 4)
    model, inputs = Fn(lambda x: torch.softmax(torch.relu(x @ w), -1)), (torch.randn(3, 8),)
    local_pipeline.choose_repeats = 3  # the simulator's timings mean nothing: the choice is what is tested
    compiled = kiln.compile(model, inputs, target="cuda", pipeline=local_pipeline, candidates=2)
    cands = compiled.result.report.candidates
    shapes = {(c.block, c.tile) for c in cands}
    assert {(0, 0), (256, 16), (64, 8), (128, 32)} <= shapes and all(c.measured_s > 0 for c in cands)
    chosen = next(c for c in cands if c.chosen)
    assert (chosen.relative, chosen.measured_s) == min((c.relative, c.measured_s) for c in cands)
    emitted = local_pipeline.emit(Digest.from_pb(chosen.kernel_graph), "cuda", chosen.block, chosen.tile)[0]
    assert compiled.result.bundle == emitted
    with torch.no_grad():
        assert torch.allclose(compiled(*inputs), model(*inputs), **TOL)
    with pytest.raises(InvalidArgument, match="block is one of"):
        local_pipeline.emit(compiled.result.kernel_graph, "cuda", 100, 16)
    with pytest.raises(InvalidArgument, match="for the cuda target"):
        local_pipeline.emit(compiled.result.kernel_graph, "cpu", 128, 16)


def test_cuda_over_grpc_and_half_precision_refused(remote_pipeline):
    model, inputs = _small(seed=4)
    compiled = _cuda(model, inputs, remote_pipeline)
    with torch.no_grad():
        assert torch.allclose(compiled(*inputs), model(*inputs), **TOL)
    half = torch.nn.Linear(4, 3).to(torch.float16)
    with pytest.raises(FailedPrecondition, match="16-bit"):
        _cuda(half, (torch.randn(2, 4, dtype=torch.float16),), remote_pipeline)


def test_calibrate_and_profile_run_on_the_device(local_pipeline):
    """Calibrate measures the cuda target with the kernels it emits, under its own fingerprint;
    Profile times cuda bundles on the device (a compile's candidates are timed this way; under the
    simulator a timed compile takes minutes, so the test times two schedules of one program)."""
    from executor_svc.calibrate import GEMM_CLASSES, fingerprint

    _, profile = local_pipeline.calibrate("cuda")
    assert profile.target == "cuda" and profile.fingerprint == fingerprint("cuda") != fingerprint("cpu")
    assert [g.shape_class for g in profile.gemm] == [c[0] for c in GEMM_CLASSES]
    assert all(g.gflops > 0 for g in profile.gemm)
    assert profile.bandwidth_gbs > 0 and profile.kernel_overhead_us > 0
    w = torch.randn(8, 4)
    model, inputs = Fn(lambda x: torch.softmax(torch.relu(x @ w), -1)), (torch.randn(3, 8),)
    searched = _cuda(model, inputs, local_pipeline)
    plain = kiln.compile(model, inputs, target="cuda", pipeline=local_pipeline, search=False)
    bundles = [searched.result.bundle, plain.result.bundle]
    assert bundles[0] != bundles[1] and searched.result.kernels < plain.result.kernels
    timings = local_pipeline.profile(bundles, searched.result.manifest, repeats=2)
    assert [t[0] for t in timings] == bundles and all(t[1] > 0 and t[2] > 0 for t in timings)
    with torch.no_grad():
        assert torch.allclose(plain(*inputs), model(*inputs), **TOL)
