"""CPU codegen: every kernel kind compiled with numba and compared with torch eager."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from modules import Fn



def _kinds(pipeline, compiled):
    from kiln.ir.kernel import kernel_graph_from_pb
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
    compiled = kiln.compile(Fn(fn), (ids, table, w, x), pipeline=local_pipeline)
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
    for got, want in zip(compiled(x), fn(x)):
        assert torch.allclose(got, want, equal_nan=True, rtol=1e-5, atol=1e-6), (got, want)


def test_out_of_range_index_is_invalid_argument_not_a_bad_read(local_pipeline):
    from kiln.errors import InvalidArgument

    table = torch.randn(10, 4)
    compiled = kiln.compile(Fn(lambda i: F.embedding(i, table)), (torch.tensor([1, 2]),), pipeline=local_pipeline)
    assert torch.equal(compiled(torch.tensor([9, 0])), table[[9, 0]])
    for bad in ([3, 10], [-1, 2]):  # torch raises IndexError for both
        with pytest.raises(InvalidArgument, match="out-of-range index"):
            compiled(torch.tensor(bad))
