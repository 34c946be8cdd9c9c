"""CPU codegen: every kernel kind compiled with numba and compared with torch eager."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from codegen_svc.targets.cpu.rows import ONLINE_SOFTMAX_MIN_ROW
from kiln.v1 import ir_pb2
from helpers import Fn, pairs

pytestmark = pytest.mark.slow(minutes=7)  # its file starts first under make test



def _kinds(pipeline, compiled):
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.v1 import ir_pb2

    kg = kernel_graph_from_pb(pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
    return [k.kind for k in kg.kernels]


def test_all_kernel_kinds_in_one_program(local_pipeline):
    """gather (embedding), gemm, reduce (softmax, max with NaN), masked views (cat, pad), iota."""

    def fn(ids, table, w, x):
        e = F.embedding(ids, table)                        # gather
        h = e @ w                                          # gemm
        s = torch.softmax(h, -1)                           # reduce + elementwise
        c = torch.cat([s, F.pad(x, (1, 1))], dim=-1)       # masked views
        r = torch.arange(c.shape[-1], dtype=torch.float32)  # iota
        return c * r, torch.amax(x, dim=-1)

    ids = torch.tensor([[1, 4, 0], [2, 2, 3]])
    table, w = torch.randn(5, 8), torch.randn(8, 6)
    x = torch.randn(2, 3, 4)
    x[1, 2, 1] = float("nan")
    # one candidate: the default schedule (a timed one may pick a generated loop for this tiny GEMM)
    compiled = kiln.compile(Fn(fn), (ids, table, w, x), pipeline=local_pipeline, candidates=1)
    kinds = set(_kinds(local_pipeline, compiled))
    assert {"gather", "gemm", "reduce", "elementwise"} <= kinds
    out, mx = compiled(ids, table, w, x)
    ref, rmx = fn(ids, table, w, x)
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert torch.allclose(mx, rmx, equal_nan=True) and torch.isnan(mx[1, 2])


def test_nan_and_inf_propagate_as_torch(local_pipeline):
    def fn(x):
        return torch.relu(x) + torch.sigmoid(x) * 0.5, torch.exp(x)

    x = torch.tensor([0.0, -0.0, 1.0, float("inf"), -float("inf"), float("nan"), 100.0, -100.0])
    compiled = kiln.compile(Fn(fn), (x,), pipeline=local_pipeline)
    for got, want in pairs(compiled(x), fn(x)):
        assert torch.allclose(got, want, equal_nan=True, rtol=1e-5, atol=1e-6), (got, want)


def test_out_of_range_index_is_invalid_argument_not_a_bad_read(local_pipeline):
    from kiln.core.errors import InvalidArgument

    table = torch.randn(10, 4)
    compiled = kiln.compile(Fn(lambda i: F.embedding(i, table)), (torch.tensor([1, 2]),), pipeline=local_pipeline)
    assert torch.equal(compiled(torch.tensor([9, 0])), table[[9, 0]])
    for bad in ([3, 10], [-1, 2]):  # torch raises IndexError for both
        with pytest.raises(InvalidArgument, match="out-of-range index"):
            compiled(torch.tensor(bad))


def _kernel_graph(pipeline, compiled):
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.v1 import ir_pb2

    return kernel_graph_from_pb(pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))


def test_gemm_through_views_that_do_not_compose(local_pipeline):
    """Attention's output projection reads a transposed-then-reshaped tensor, and GQA's V a
    broadcast-then-reshaped one: neither view chain composes, both are still GEMMs (the
    operand packed through its views), and match torch."""

    def fn(p, v, w):
        o = p @ v.repeat_interleave(2, dim=1)                    # [1, 4, 8, 16], v broadcast over heads
        o = o.transpose(1, 2).reshape(1, 8, 64)                   # does not compose with the GEMM's view
        return o @ w

    p, v, w = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 16), torch.randn(64, 32)
    compiled = kiln.compile(Fn(fn), (p, v, w), pipeline=local_pipeline, candidates=1)
    kinds = _kinds(local_pipeline, compiled)
    assert kinds.count("gemm") == 2 and "reduce" not in kinds, kinds
    assert torch.allclose(compiled(p, v, w), fn(p, v, w), rtol=1e-4, atol=1e-5)


def test_parallel_gemm_splits_rows_and_matches(local_pipeline):
    """A parallel GEMM splits M into blocks of rows, one per thread; its epilogue runs on each
    block as soon as BLAS wrote it (while it is in cache), in place in the output's rows (no C is
    allocated), except when the epilogue reads C out of its row order (here a transpose), which
    waits for all of C in a buffer of its own. 600 rows on two threads: two blocks of 300, each in
    sub-blocks of 64 rows and a last of 44 (B is small: C's blocks are kept small, but never
    under GEMM_MIN_ROWS rows)."""
    x, w, b = torch.randn(600, 96), torch.randn(96, 80), torch.randn(80)
    fns = {"rows": lambda x: torch.relu(x @ w + b),
           "transposed": lambda x: (x @ w).t() * 2 + b[:, None] * 0 + 1}
    for name, fn in fns.items():
        compiled = kiln.compile(Fn(fn), (x,), pipeline=local_pipeline, candidates=1)
        gemms = [k for k in _kernel_graph(local_pipeline, compiled).kernels if k.kind == "gemm"]
        assert len(gemms) == 1 and gemms[0].parallel, name
        bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
        src = [k.source for k in bundle.kernels if k.kind == "gemm"][0]
        assert "prange" in src
        if name == "rows":
            assert "C = out[0:48000]" in src and "for s0 in range(lo, hi, 64)" in src, src
            assert "np.empty" not in src, src
        else:
            assert "C = np.empty((1, 600, 80)" in src, src
        assert torch.allclose(compiled(x), fn(x), rtol=1e-4, atol=1e-4), name


def _compile_for(pipeline, fn, args, threads: int, vector_rates: dict[int, float] | None = None):
    """Compile fn for a target whose profile says `threads` threads (a fixed profile, so the
    search's schedule choices do not depend on this machine) and, if given, these in-cache
    rates per vector width (bits -> Gelem/s; 0: LLVM's own width), one candidate; the compiled
    module and its kernel graph."""
    from kiln.ir.serialize import kernel_graph_from_pb
    from kiln.v1 import services_pb2

    profile = services_pb2.TargetProfile(target="cpu", threads=threads, elementwise_gelems=threads * 1.4,
                                         cached_gelems=threads * 12.0,
                                         bandwidth_gbs=30.0, kernel_overhead_us=2.0, serial_overhead_us=0.25)
    profile.gemm.add(shape_class="square", m=512, n=512, k=512, gflops=150.0)
    for bits, rate in (vector_rates or {}).items():
        profile.vector_rates.add(bits=bits, gelems=rate)
    ep = torch.export.export(fn if isinstance(fn, torch.nn.Module) else Fn(fn), args)
    result = pipeline.compile_program(pipeline.upload_program(ep), target_profile=pipeline.store.put_message(profile),
                                      candidates=1)
    session = pipeline.load(result.bundle, result.manifest)
    kg = kernel_graph_from_pb(pipeline.store.get_message(result.kernel_graph, ir_pb2.KernelGraph))
    return kiln.pipeline.CompiledModule(pipeline, result, session, ep.call_spec.in_spec), kg


def test_searched_gemm_tile_blocks_match(local_pipeline):
    """The search's tile of rows per BLAS call reaches the GEMM: 1500 rows on a 2-thread target
    (750 per thread) and 1024 columns take 512-row tiles (a block of C stays in cache for the
    bias and ReLU after it, in place in the output), so each thread computes a block of 512 rows
    and one of 238. With A transposed (a block of its rows is no matrix BLAS takes) the tile's
    rows of A are packed first. Both match torch."""
    w, bias = torch.randn(64, 1024), torch.randn(1024)
    for name, fn, x in (("rows", lambda x: torch.relu(x @ w + bias), torch.randn(1500, 64)),
                        ("transposed", lambda x: torch.relu(x.t() @ w + bias), torch.randn(64, 1500))):
        compiled, kg = _compile_for(local_pipeline, fn, (x,), threads=2)
        (gemm,) = [k for k in kg.kernels if k.kind == "gemm"]
        assert gemm.tile == 512 and gemm.parallel, (name, gemm)
        bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
        (src,) = [k.source for k in bundle.kernels if k.kind == "gemm"]
        assert "C = out[0:1536000]" in src and "for s0 in range(lo, hi, 512)" in src, src
        assert "np.dot(" in src and "C[0][s0:s1])" in src, src  # BLAS writes the output's rows
        assert ("at = np.empty((512, 64)" in src) == (name == "transposed"), src
        assert torch.allclose(compiled(x), fn(x), rtol=1e-4, atol=1e-4), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reduction_in_axis_outer_order_matches(local_pipeline, dtype):
    """The search gives reductions over a middle axis (48 floats after it) the axis-outer loop
    order: the kernel keeps a row of accumulators (f32 for f16 data) and reads the input in
    memory order. Sums and maxima (a NaN stays sticky) match torch."""
    x = torch.randn(64, 96, 48).to(dtype)
    x[3, 7, 5] = float("nan")
    fn = lambda x: (x.sum(1), torch.amax(x * 2, 1))  # noqa: E731
    compiled, kg = _compile_for(local_pipeline, fn, (x,), threads=2)
    reduces = [k for k in kg.kernels if k.kind == "reduce"]
    assert len(reduces) == 2 and all(k.order == "axis-outer" for k in reduces), reduces
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert all("acc = np.empty(48, dtype=np.float32)" in k.source for k in bundle.kernels if k.kind == "reduce")
    tol = 1e-5 if dtype is torch.float32 else 1e-2
    for got, want in pairs(compiled(x), fn(x)):
        assert got.dtype == want.dtype
        assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol, equal_nan=True)
        assert torch.isnan(got[3, 5]) and torch.isnan(got).sum() == 1


def test_collapsed_parallel_loops_match(local_pipeline):
    """Under an 8-thread target profile the search collapses the outer loops of a softmax and of
    a reduction whose first loop is short (2) into one pool loop; the kernels unravel it and
    match torch (the pool here may be smaller: a schedule never changes what is computed)."""
    x = torch.randn(2, 48, 256)
    fn = lambda x: (torch.softmax(x, -1), x.sum(-1))  # noqa: E731
    compiled, kg = _compile_for(local_pipeline, fn, (x,), threads=8)
    collapsed = [k.kind for k in kg.kernels if k.collapse]
    assert sorted(collapsed) == ["reduce", "row"], [(k.kind, k.parallel, k.collapse) for k in kg.kernels]
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert all("for fi in prange(96)" in k.source for k in bundle.kernels if k.kind in ("row", "reduce"))
    for got, want in pairs(compiled(x), fn(x)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_merge_packs_in_the_source_loops_and_matches(local_pipeline, dtype):
    """A transformer's head merge before its output projection: [b, h, s, d] permuted to
    [b, s, h, d] and reshaped to [b·s, h·d] is no strided view BLAS takes, so the GEMM packs A's
    rows; each row is h runs of d contiguous elements of the source, packed in the source's own
    loops (no flat index unravelled per element). f32 and f16 match torch."""
    w, bias = torch.randn(64, 80).to(dtype), torch.randn(80).to(dtype)
    fn = lambda o: o.permute(0, 2, 1, 3).reshape(2 * 48, 64) @ w + bias  # noqa: E731
    o = torch.randn(2, 4, 48, 16).to(dtype)
    compiled = kiln.compile(Fn(fn), (o,), pipeline=local_pipeline, candidates=1)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    (src,) = [k.source for k in bundle.kernels if k.kind == "gemm"]
    assert "for q2 in range(4):" in src and "for q3 in range(16):" in src, src
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    got, want = compiled(o), fn(o)
    assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def test_convolution_packs_its_rows_in_small_blocks_and_matches(local_pipeline):
    """A convolution's GEMM reads A through an im2col view: each sub-block of rows is packed
    just before BLAS reads it. Its B (72 x 8) is small, so the sub-blocks are short (64 rows,
    the fewest a block has; the epilogue writes NCHW, out of C's row order, so C is whole); 968 rows on two
    threads end in partial sub-blocks."""
    conv = torch.nn.Conv2d(8, 8, 3).eval()
    x = torch.randn(2, 8, 24, 24)
    fn = lambda x: torch.relu(conv(x))  # noqa: E731
    compiled = kiln.compile(Fn(fn), (x,), pipeline=local_pipeline, candidates=1)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    src = [k.source for k in bundle.kernels if k.kind == "gemm"][0]
    assert "at = np.empty((64, 72)" in src, src  # 16 KB of packed A would be 56 rows: 64 at least
    with torch.no_grad():
        assert torch.allclose(compiled(x), fn(x), rtol=1e-4, atol=1e-4)


def test_long_view_chain_with_search_off_compiles_and_matches(local_pipeline):
    """With the search off no view is composed: twelve transposes and reshapes that never
    compose are walked level by level (the generated index stays linear in the chain)."""

    def fn(x):
        for _ in range(6):
            x = x.transpose(0, 1).reshape(6, 10).transpose(0, 1).reshape(12, 5)
        return x + 1

    x = torch.randn(12, 5)
    compiled = kiln.compile(Fn(fn), (x,), search=False, pipeline=local_pipeline)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert max(len(k.source) for k in bundle.kernels) < 20_000
    assert torch.equal(compiled(x), fn(x))


def test_kernels_are_content_addressed_and_checked(local_pipeline):
    """Two models sharing a kernel share its module (compiled once per machine); a bundle whose
    kernel is not named by its source's hash is refused before anything is written."""
    from kiln.core.errors import InvalidArgument

    x = torch.randn(4, 8)
    a = kiln.compile(Fn(lambda x: torch.sigmoid(x) * 3.0), (x,), pipeline=local_pipeline)
    b = kiln.compile(Fn(lambda x: (torch.sigmoid(x) * 3.0, x.sum(-1))), (x,), pipeline=local_pipeline)
    get = lambda c: local_pipeline.store.get_message(c.result.bundle, ir_pb2.Bundle)  # noqa: E731
    ka, kb = get(a), get(b)
    assert {k.symbol for k in ka.kernels} < {k.symbol for k in kb.kernels}
    bad = ir_pb2.Bundle()
    bad.CopyFrom(ka)
    bad.kernels[0].source = bad.kernels[0].source.replace("3.0", "4.0")
    d = local_pipeline.store.put_message(bad)
    with pytest.raises(InvalidArgument, match="not named by its source's hash"):
        local_pipeline.load(d, a.result.manifest)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_epilogue_bias_activation_residual_in_one_kernel(local_pipeline, dtype):
    """x @ w + b, GELU and a residual add run as the GEMM kernel's epilogue (the bias and the
    activation's repeated reads of their input are computed once per element)."""
    torch.manual_seed(0)
    x, r = torch.randn(40, 24).to(dtype), torch.randn(40, 32).to(dtype)
    w, b = torch.randn(24, 32).to(dtype), torch.randn(32).to(dtype)
    fn = lambda x, r: F.gelu(x @ w + b) + r  # noqa: E731
    compiled = kiln.compile(Fn(fn), (x, r), pipeline=local_pipeline, candidates=1)
    assert _kinds(local_pipeline, compiled) == ["gemm"]
    got = compiled(x, r).float()
    ref = F.gelu(x.float() @ w.float() + b.float()) + r.float()
    tol = 1e-4 if dtype is torch.float32 else 3e-2  # bf16: one rounding of the output (8 bits)
    assert torch.allclose(got, ref, rtol=tol, atol=tol), (got - ref).abs().max()


class _Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(24)
        self.w = torch.nn.Parameter(torch.randn(24))

    def forward(self, x, y, mask):
        s = torch.softmax(x + mask, -1)                                     # masked softmax
        r = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w  # RMS norm
        return s, self.ln(y), r


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(2))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(24) for _ in range(2))

    def forward(self, x, mask):
        for lin, ln in zip(self.linears, self.norms):
            x = ln(torch.softmax(lin(x) + mask, -1) * x)
        return x


def test_identical_layers_share_their_kernels(local_pipeline):
    """Two layers of one shape emit the same kernel text, so the bundle names (and numba
    compiles) each of their kernels once: a kernel's locals are numbered within it, never by
    the graph's node ids, which differ from layer to layer."""
    torch.manual_seed(0)
    m = _TwoLayers()
    with torch.no_grad():
        for ln in m.norms:
            ln.weight.normal_()
    x, mask = torch.randn(3, 5, 24), torch.zeros(3, 5, 24)
    mask[0, :, 10:] = float("-inf")
    compiled = kiln.compile(m, (x, mask), pipeline=local_pipeline, candidates=1)
    kernels = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle).kernels
    symbols = [k.symbol for k in kernels]
    assert len(symbols) >= 2 and len(set(symbols)) * 2 == len(symbols), [(k.kind, k.symbol) for k in kernels]
    with torch.no_grad():
        ref = m(x, mask)
    assert torch.allclose(compiled(x, mask), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_and_norms_are_one_row_kernel_each(local_pipeline, dtype):
    """Softmax, layer norm and RMS norm: their reductions and the elementwise work reading them
    back run as one kernel per row (the reductions' loops, then the row written), matching torch;
    -inf mask entries stay exact and a fully masked row is NaN as in torch."""
    torch.manual_seed(0)
    m = _Norms().to(dtype)
    x, y = torch.randn(3, 5, 24).to(dtype), torch.randn(3, 5, 24).to(dtype)
    mask = torch.zeros(3, 5, 24, dtype=dtype)
    mask[0, :, 10:] = float("-inf")
    mask[1, 2, :] = float("-inf")
    compiled = kiln.compile(m, (x, y, mask), pipeline=local_pipeline, candidates=1)
    assert _kinds(local_pipeline, compiled) == ["row", "row", "row"]
    # reduction loops per row: softmax's max and sum of exponentials two (rows this short stay
    # in cache: two vectorized loops beat one online loop), layer norm's mean and variance two,
    # RMS norm's sum of squares one
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    loops = sorted(k.source.count("for ra in range") for k in bundle.kernels)
    assert loops == [1, 2, 2], loops
    tol = 1e-5 if dtype is torch.float32 else 2e-2  # bf16: output rounding (8 bits)
    with torch.no_grad():
        for got, ref in pairs(compiled(x, y, mask), m(x, y, mask)):
            assert torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol, equal_nan=True)
    s = compiled(x, y, mask)[0]
    assert torch.isnan(s[1, 2]).all() and (s[0, :, 10:] == 0).all()


def test_searched_vector_width_compiles_and_matches(local_pipeline):
    """On a target whose in-cache loops ran fastest with 512-bit vectors, the search gives the
    row kernels that width: their sources compile through the pipeline that asks LLVM for it,
    and the program matches torch. With rates that favour no width, no kernel asks for one."""
    torch.manual_seed(0)
    m = _Norms()
    args = (torch.randn(64, 8, 24), torch.randn(64, 8, 24), torch.zeros(64, 8, 24))
    wide = {0: 24.0, 128: 12.0, 256: 24.0, 512: 48.0}
    compiled, kg = _compile_for(local_pipeline, m, args, threads=2, vector_rates=wide)
    rows = [k for k in kg.kernels if k.kind == "row"]
    assert len(rows) == 3 and all(k.vector == 512 for k in rows), [(k.kind, k.vector) for k in kg.kernels]
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    sources = [k.source for k in bundle.kernels if k.kind == "row"]
    assert all("pipeline_class=_kernel_pipeline(512)" in src for src in sources)
    with torch.no_grad():
        for got, ref in pairs(compiled(*args), m(*args)):
            assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    flat = {0: 24.0, 128: 12.0, 256: 24.0, 512: 20.0}
    _, kg = _compile_for(local_pipeline, m, args, threads=2, vector_rates=flat)
    assert not any(k.vector for k in kg.kernels)


def test_row_fusion_is_a_schedule_choice():
    from importer_svc.importer import lower_program
    from optimizer_svc.partition import Schedule, partition
    from optimizer_svc.saturate import SearchLimits, saturate

    x, y, mask = torch.randn(3, 5, 24), torch.randn(3, 5, 24), torch.zeros(3, 5, 24)
    g, _ = saturate(lower_program(torch.export.export(_Norms(), (x, y, mask)))[0], SearchLimits())
    on, off = partition(g), partition(g, schedule=Schedule(rows=False))
    assert [k.kind for k in on.kernels] == ["row"] * 3
    assert len(off.kernels) > 6 and "row" not in {k.kind for k in off.kernels}


def test_row_value_read_through_a_transpose_is_not_fused_with_the_wrong_row(local_pipeline):
    """An RMS norm whose result is read transposed: the kernel's rows are not the norm's rows,
    so the norm's reduction must not become a per-row local of that kernel. The partition of
    the searched graph (the search names the RMS norm a row kernel) is emitted and run as is,
    and checked against torch."""
    from importer_svc.importer import lower_program
    from kiln.ir.serialize import kernel_graph_to_pb
    from optimizer_svc.partition import partition
    from optimizer_svc.saturate import SearchLimits, saturate

    class M(torch.nn.Module):
        def forward(self, x, y):
            t = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return t.transpose(-1, -2) + y

    x, y = torch.randn(2, 6, 6), torch.randn(2, 6, 6)
    g, _ = saturate(lower_program(torch.export.export(M(), (x, y)))[0], SearchLimits())
    assert [n.kernel for n in g.nodes if n.kernel] == ["row"]
    kg = partition(g)
    store = local_pipeline.store
    bundle, _, _ = local_pipeline.emit(store.put_message(kernel_graph_to_pb(kg)))
    sid = local_pipeline.load(bundle, store.put_message(ir_pb2.WeightManifest()))
    (_, out), = local_pipeline.run(sid, [("x", x.numpy()), ("y", y.numpy())])
    np.testing.assert_allclose(out, M()(x, y).numpy(), rtol=1e-5, atol=1e-5)


def test_softmax_added_to_its_own_transpose_is_not_one_row_kernel(local_pipeline):
    """g + g.t() after a softmax reads the probabilities of other rows: a row kernel holds only
    its own row's sum, so the softmax may not be taken into that kernel as a row kernel (it
    was, and the result was 0.11 off torch's)."""
    w = torch.randn(32, 16)

    def fn(x):
        g = torch.softmax(torch.tanh(x @ w) * 2.0, -1)
        return g + g.t()

    x = torch.randn(16, 32)
    compiled = kiln.compile(Fn(fn), (x,), pipeline=local_pipeline, candidates=1)
    assert torch.allclose(compiled(x), fn(x), rtol=1e-5, atol=1e-6), (compiled(x) - fn(x)).abs().max()


def _attention(q, k, v, mask, causal, gqa):
    if gqa:  # grouped-query attention: K and V shared by pairs of heads
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["plain", "bool mask", "additive mask", "causal", "gqa causal"])
def test_attention_is_one_kernel(local_pipeline, dtype, case):
    """softmax(Q·Kᵀ·s + mask)·V in primitive form (scaled_dot_product_attention decomposed by
    the importer) becomes one attention kernel: scores, softmax and P·V a tile of query rows
    at a time. 70 query rows span two tiles; a fully masked row comes out as torch's."""
    torch.manual_seed(1)
    gqa = case.startswith("gqa")
    hk = 2 if gqa else 4
    sq, sk = (70, 70) if "causal" in case else (70, 50)
    q, k, v = torch.randn(2, 4, sq, 16), torch.randn(2, hk, sk, 16), torch.randn(2, hk, sk, 8)
    mask = None
    if case == "bool mask":
        mask = torch.rand(sq, sk) > 0.3
        mask[5] = False  # a fully masked row
    elif case == "additive mask":
        mask = torch.randn(2, 1, sq, sk)
    args = [t.to(dtype) for t in (q, k, v)] + ([mask if mask.dtype is torch.bool else mask.to(dtype)]
                                              if mask is not None else [])
    fn = lambda q, k, v, *m: _attention(q, k, v, m[0] if m else None, "causal" in case, gqa)  # noqa: E731
    compiled = kiln.compile(Fn(fn), tuple(args), pipeline=local_pipeline, candidates=1)
    assert _kinds(local_pipeline, compiled).count("attention") == 1
    assert "row" not in _kinds(local_pipeline, compiled)
    if case == "plain" and dtype is torch.float32:
        # Q·s is computed as the kernel packs Q (no kernel of its own; the output's reshape is
        # written in place), and each score's exponential once: kept for the row while its sum
        # is taken
        kernels = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle).kernels
        assert [k.kind for k in kernels] == ["attention"], [k.kind for k in kernels]
        body = kernels[0].source[kernels[0].source.index("def k_"):]
        assert body.count("_exp2(") == 1, body
    got, ref = compiled(*args).float(), fn(*args).float()
    tol = 1e-5 if dtype is torch.float32 else 3e-2  # bf16: P and the output rounded to 8 bits
    assert torch.allclose(got, ref, rtol=tol, atol=tol, equal_nan=True), (got - ref).abs().max()
    if case == "bool mask":  # torch's attention gives a fully masked row zeros, and so does kiln
        assert (ref[:, :, 5] == 0).all() and (got[:, :, 5] == 0).all()


def test_attention_fusion_is_a_schedule_choice(local_pipeline):
    from kiln.ir.serialize import kernel_graph_from_pb
    from optimizer_svc.partition import Schedule, partition

    q, k, v = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    compiled = kiln.compile(Fn(F.scaled_dot_product_attention), (q, k, v), pipeline=local_pipeline, candidates=1)
    kg = kernel_graph_from_pb(local_pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
    on, off = partition(kg.graph), partition(kg.graph, schedule=Schedule(attention=False))
    assert "attention" in [k.kind for k in on.kernels]
    assert [k.kind for k in off.kernels].count("gemm") == 2 and "row" in [k.kind for k in off.kernels]


@pytest.mark.parametrize("width,loops", [(9, 2), (ONLINE_SOFTMAX_MIN_ROW + 9, 1)])
def test_softmax_matches_torch_on_special_values(local_pipeline, width, loops):
    """Softmax against torch on the rows that break a careless one: -inf before finite values,
    all -inf, +inf, NaN, a large spread. Short rows take two branch-free loops (a select max
    with a NaN flag, then the sum of exponentials); rows too long for cache take one (online
    softmax: running max, the sum rescaled when the max rises)."""
    x = torch.randn(6, width)
    x[0, :4] = float("-inf")  # the running max starts at -inf and stays there a while
    x[1, :] = float("-inf")
    x[2, 3] = float("inf")
    x[3, 5] = float("nan")
    x[4] = torch.linspace(-300, 300, width)  # every new element raises the max: each rescales the sum
    compiled = kiln.compile(Fn(lambda x: torch.softmax(x, -1)), (x,), pipeline=local_pipeline, candidates=1)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert [k.source.count("for ra in range") for k in bundle.kernels] == [loops]
    got, ref = compiled(x), torch.softmax(x, -1)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6, equal_nan=True), (got, ref)
    assert torch.equal(got.isnan(), ref.isnan())


def test_exp2_is_a_vectorizable_polynomial_within_3e_7(local_pipeline):
    """Generated exp2 (exponent bits times a polynomial, no libm call) against torch: relative
    error under 3e-7 for results from 2**-125.5 up, 0 below, inf above 128, NaN kept."""
    x = torch.cat([torch.linspace(-125.5, 127.9, 200_001),
                   torch.tensor([float("inf"), float("-inf"), float("nan"), 128.5, -126.0, -300.0])])
    compiled = kiln.compile(Fn(lambda x: torch.exp2(x)), (x,), pipeline=local_pipeline, candidates=1)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert any("_exp2(" in k.source for k in bundle.kernels)
    got, ref = compiled(x).double(), torch.exp2(x.double())
    rel = ((got[:200_001] - ref[:200_001]).abs() / ref[:200_001]).max().item()
    assert rel < 3e-7, rel
    tail = got[200_001:].tolist()
    assert tail[0] == float("inf") and tail[1] == 0.0 and tail[2] != tail[2] and tail[3] == float("inf")
    assert tail[4] < 1.2e-38 and tail[5] == 0.0


def test_output_reshaping_an_intermediate_is_written_in_place(local_pipeline):
    """An output that only reshapes an intermediate (a model's final `view`) is no copy: its
    producer writes into the output's buffer. A second output reshaping the same intermediate
    still gets its own copy, and both match torch."""
    x, w = torch.randn(6, 20), torch.randn(20, 40)

    def fn(x):
        y = torch.relu(x @ w)
        return y.reshape(6, 5, 8), y.reshape(3, 80) * 1.0

    compiled = kiln.compile(Fn(fn), (x,), pipeline=local_pipeline, candidates=1)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    kinds = [k.kind for k in bundle.kernels]
    assert kinds.count("gemm") == 1 and kinds.count("elementwise") == 1, kinds  # one copy left, not two
    calls = [line.strip() for line in bundle.module_source.splitlines() if "_gemm" in line and "(" in line]
    assert calls and calls[0].split("(")[1].startswith("o"), calls  # the GEMM writes an output buffer
    for got, ref in pairs(compiled(x), fn(x)):
        assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_intermediates_share_one_arena_by_liveness(local_pipeline):
    """With static shapes the memory plan is one arena: buffers of any dtype at byte offsets,
    overlapping only buffers never live at the same kernel, so the arena is smaller than the
    buffers laid end to end. Every kernel's live buffers (its inputs and output included) are
    disjoint, except an elementwise or row kernel's output written over an input that dies
    there and that it reads only where it writes (in_place). `g + g.t()` reads its dying input
    transposed as well: that kernel must not write over it (it did, and was 0.16 off). The
    program matches torch."""
    from codegen_svc.memory import ALIGN, in_place, output_aliases, plan_memory
    from kiln.ir.shape import numel

    w1, w2, w3 = torch.randn(32, 64), torch.randn(64, 16), torch.randn(16, 32)

    def fn(x):
        h = torch.relu(x @ w1)
        keep = h.sum(-1, keepdim=True) > 0  # a bool buffer between float ones
        g = torch.exp(torch.softmax(torch.tanh(h @ w2) * 2.0, -1)) * 0.5
        g = g + g.t()
        return torch.where(keep, torch.sigmoid(g @ w3) + x, x)

    x = torch.randn(16, 32)
    compiled = kiln.compile(Fn(fn), (x,), pipeline=local_pipeline, candidates=1)
    assert torch.allclose(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
    kg = _kernel_graph(local_pipeline, compiled)
    g = kg.graph
    plan = plan_memory(kg)
    bundle = local_pipeline.store.get_message(compiled.result.bundle, ir_pb2.Bundle)
    assert bundle.memory.arena_bytes == plan.arena_bytes > 0
    assert "arena = np.empty(" in bundle.module_source
    span = {s.slot: (s.offset, s.offset + s.elements * s.dtype.itemsize) for s in plan.slots}
    assert all(lo % ALIGN == 0 and hi <= plan.arena_bytes for lo, hi in span.values())
    assert plan.arena_bytes < sum(hi - lo for lo, hi in span.values())  # something was shared
    skipped = output_aliases(kg)
    first = {k.output: t for t, k in enumerate(kg.kernels)}
    last = {}
    for t, k in enumerate(kg.kernels):
        for j in k.reads if t not in skipped else ():
            last[j] = t
    over = in_place(kg, set(plan.node_slot), last)
    assert over and all(plan.node_slot[o] == plan.node_slot[j] for o, j in over.items())
    # the transposed read: an input that dies in its reader, of the same size, not written over
    refused = [(k.output, j) for t, k in enumerate(kg.kernels) for j in k.reads
               if k.kind == "elementwise" and j in plan.node_slot and last.get(j) == t
               and numel(g.nodes[j].shape) == numel(g.nodes[k.output].shape) and over.get(k.output) != j]
    assert refused, over
    for t in range(len(kg.kernels)):
        nodes = [o for o in plan.node_slot if first[o] <= t <= last.get(o, first[o])]
        slots = {plan.node_slot[o] for o in nodes}  # one slot twice: only an output and the input it overwrites
        assert len(nodes) - len(slots) == sum(1 for o in nodes if over.get(o) in nodes), (t, nodes)
        live = sorted(span[i] for i in slots)
        assert all(a[1] <= b[0] for a, b in zip(live, live[1:])), (t, live)
