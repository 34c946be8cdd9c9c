"""The IR: op set, symbolic dims, views and their composition, serialization, digests."""

import subprocess
import sys

import numpy as np
import pytest

from kiln.ir import view as views
from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.evaluate import apply_view
from kiln.ir.graph import Graph, Node, validate
from kiln.ir.ops import GroupOp, Op
from kiln.ir.serialize import graph_from_pb, graph_to_pb
from kiln.ir.shape import Sym, contiguous_strides, numel


def test_sixteen_primitives_in_groups():
    assert len(GroupOp.Primitive) == 16
    assert GroupOp.Unary | GroupOp.Binary | GroupOp.Select | GroupOp.Reduce | GroupOp.Data == GroupOp.Primitive
    assert {o.value for o in GroupOp.Primitive} == {
        "Exp2", "Log2", "Sin", "Sqrt", "Recip", "Add", "Mul", "Mod", "LessThan", "Where", "SumReduce",
        "MaxReduce", "Iota", "Gather", "Scatter", "Cast"}


def test_symbolic_dims():
    b, s = Sym.named("batch"), Sym.named("seq")
    d = b * s * 4
    assert d.evaluate({"batch": 2, "seq": 3}) == 24
    assert str(b * s + b * s) == "2*batch*seq"
    assert (b + 1) - 1 == b
    assert numel((b, s, 8)).evaluate({"batch": 5, "seq": 7}) == 280
    assert contiguous_strides((b, s, 8))[0].evaluate({"seq": 3}) == 24


def _random_chain(rng, shape):
    """A random list of movement ops on `shape`, as (spec, new shape) pairs."""
    out = []
    for _ in range(3):
        kind = rng.choice(["permute", "reshape", "slice", "expand", "pad"])
        if kind == "permute":
            perm = tuple(rng.permutation(len(shape)))
            v = views.permute(shape, perm)
        elif kind == "reshape":
            n = numel(shape)
            divs = [d for d in range(1, n + 1) if n % d == 0]
            a = int(rng.choice(divs))
            v = views.reshape(shape, (a, n // a))
        elif kind == "slice":
            dim = int(rng.integers(len(shape)))
            if shape[dim] < 2:
                continue
            v = views.slice_(shape, dim, 1, shape[dim], int(rng.integers(1, 3)))
        elif kind == "pad":
            v = views.pad(shape, tuple((int(rng.integers(0, 2)), int(rng.integers(0, 2))) for _ in shape))
        else:
            v = views.expand(shape, (2,) + tuple(shape))
        out.append(v)
        shape = v.shape
    return out


def _segments(chain):
    """The chain with each run of views that compose replaced by their one composed view."""
    out = []
    for v in chain:
        c = views.compose(out[-1], v) if out else None
        if c is not None:
            out[-1] = c
        else:
            out.append(v)
    return out


def _seeded_chain(seed):
    rng = np.random.default_rng(seed)
    shape = tuple(int(x) for x in rng.integers(1, 5, size=int(rng.integers(1, 4))))
    x = rng.standard_normal(shape).astype(np.float32)
    return x, _random_chain(rng, shape)


@pytest.mark.parametrize("seed", range(60))
def test_view_composition_matches_chained_views(seed):
    """Every composition compose() makes reads what the views it replaces read, in order: the
    chain with its composable runs composed gives the chain's result (always compared)."""
    x, chain = _seeded_chain(seed)
    expected = x
    for v in chain:
        expected = apply_view(expected, v, {})
    got = x
    for v in _segments(chain):
        got = apply_view(got, v, {})
    np.testing.assert_array_equal(got, expected)


def _strided_as_gathered(seed) -> int:
    """Checks each view of the seed's chain; returns how many were masked."""
    from kiln.ir.evaluate import _gathered

    x, chain = _seeded_chain(seed)
    masked = 0
    for v in chain:
        shape = tuple(int(d) for d in v.shape)
        want = _gathered(np.ascontiguousarray(x).reshape(-1), shape, v, {})
        got = apply_view(x, v, {})
        assert got.dtype == want.dtype and got.flags.c_contiguous
        np.testing.assert_array_equal(got, want)
        masked += v.mask is not None
        x = got
    return masked


@pytest.mark.parametrize("seed", range(40))
def test_a_view_is_copied_strided_as_gathered(seed):
    """apply_view copies a view through its strides, a masked one's unmasked box into zeros
    (prepare at Load transposes and concatenates weights); it gives what the element-by-element
    gather gives."""
    _strided_as_gathered(seed)


def test_the_view_chains_above_hold_masked_and_unmasked_views():
    masked = [_strided_as_gathered(seed) for seed in range(40)]
    assert sum(m > 0 for m in masked) >= 5 and sum(m == 0 for m in masked) >= 5, masked


def test_random_view_chains_do_compose():
    """The seeds above exercise compose(): most of their adjacent views compose (a compose that
    refused everything would pass the comparison vacuously)."""
    pairs_total = composed = 0
    for seed in range(60):
        _, chain = _seeded_chain(seed)
        pairs_total += max(len(chain) - 1, 0)
        composed += len(chain) - len(_segments(chain))
    assert composed >= pairs_total // 2, (composed, pairs_total)


def test_view_composition_composes_common_cases():
    # transpose then unsqueeze then expand: what matmul lowering produces
    t = views.permute((6, 4), (1, 0))
    r = views.reshape((4, 6), (1, 4, 6))
    e = views.expand((1, 4, 6), (3, 4, 6))
    c = views.compose(views.compose(t, r), e)
    assert c is not None and c.strides == (0, 1, 4)


def _symbolic_chain(rng):
    """A source shape whose first dim is the symbol s and a random chain of permutes,
    broadcasts and pads over it: the views a sequence of any length goes through (a Conv1D
    weight broadcast over it, an attention's keys transposed and read per head)."""
    s = Sym.named("s")
    src = shape = (s,) + tuple(int(x) for x in rng.integers(2, 4, size=int(rng.integers(1, 3))))
    chain = []
    for _ in range(4):
        kind = rng.choice(["permute", "expand", "pad"])
        if kind == "permute":
            v = views.permute(shape, tuple(int(p) for p in rng.permutation(len(shape))))
        elif kind == "expand":
            v = views.expand(shape, (2,) + tuple(shape))
        else:
            v = views.pad(shape, tuple((int(rng.integers(0, 2)), int(rng.integers(0, 2)))
                                       if isinstance(d, int) else (0, 0) for d in shape))
        chain.append(v)
        shape = v.shape
    return src, chain


@pytest.mark.parametrize("seed", range(40))
def test_symbolic_view_composition_matches_chained_views(seed):
    """compose() over symbolic sizes (axis by axis: permutes, broadcasts, pads) reads what the
    chain reads, at several lengths (always compared)."""
    rng = np.random.default_rng(seed)
    src, chain = _symbolic_chain(rng)
    for n in (1, 2, 5):
        env = {"s": n}
        x = rng.standard_normal(tuple(n if isinstance(d, Sym) else d for d in src)).astype(np.float32)
        expected = x
        for v in chain:
            expected = apply_view(expected, v, env)
        got = x
        for v in _segments(chain):
            got = apply_view(got, v, env)
        np.testing.assert_array_equal(got, expected)


def test_symbolic_views_compose():
    """A Conv1D's [K, N] weight transposed, unsqueezed and broadcast over a sequence of any
    length is one strided view (its GEMM reads the weight in place); most of the seeded
    symbolic chains compose (so the comparison above is not vacuous); a padded axis read by a
    broadcast is left as two views."""
    s = Sym.named("s")
    c = views.compose(views.compose(views.permute((4, 6), (1, 0)), views.reshape((6, 4), (1, 6, 4))),
                      views.expand((1, 6, 4), (s, 6, 4)))
    assert c is not None and c.strides == (0, 1, 6) and c.shape == (s, 6, 4)
    pairs = composed = 0
    for seed in range(40):
        _, chain = _symbolic_chain(np.random.default_rng(seed))
        pairs += len(chain) - 1
        composed += len(chain) - len(_segments(chain))
    assert composed >= pairs // 2, (composed, pairs)
    padded = views.pad((s, 1), ((0, 0), (1, 0)))
    assert views.compose(padded, views.ViewSpec((s, 3), (2, 0))) is None


def _small_graph():
    b = GraphBuilder()
    x = b.input("x", (2, 3), DType.F32)
    w = b.weight("w", (3,), DType.F32)
    y = b.binary(Op.MUL, x, b.expand(w, (2, 3)))
    z = b.reduce(Op.SUM_REDUCE, b.unary(Op.EXP2, y), 1)
    return b.build([z], ["out"])


def test_proto_roundtrip():
    g = _small_graph()
    assert graph_from_pb(graph_to_pb(g)) == g


def test_facts_kept_with_a_graph_are_not_part_of_it():
    """A graph's memo (node facts the optimizer asks for per candidate) changes neither its
    value nor its serialization, and a rebuilt graph starts without it."""
    from kiln.ir.kernel import largest_elements

    g = _small_graph()
    before = graph_to_pb(g).SerializeToString(deterministic=True)
    assert [largest_elements(g, i) for i in range(len(g.nodes))] == [numel(n.shape) for n in g.nodes]
    assert g.__dict__["_facts"]["largest_elements"] and g == _small_graph() and hash(g) == hash(_small_graph())
    assert graph_to_pb(g).SerializeToString(deterministic=True) == before
    assert "_facts" not in graph_from_pb(graph_to_pb(g)).__dict__


def test_kernel_marks_roundtrip_and_are_checked():
    """The search's kernel choice on a node survives serialization; a mark on an op that kernel
    cannot compute, or an unknown mark, is a malformed graph."""
    import dataclasses

    g = _small_graph()
    nodes = list(g.nodes)
    nodes[-1] = dataclasses.replace(nodes[-1], kernel="gemm")
    marked = Graph(tuple(nodes), g.inputs, g.weights, g.outputs, g.output_names)
    assert graph_from_pb(graph_to_pb(marked)).nodes[-1].kernel == "gemm"
    for i, mark in ((len(nodes) - 2, "gemm"), (len(nodes) - 1, "row"), (len(nodes) - 1, "flash")):
        bad = list(g.nodes)
        bad[i] = dataclasses.replace(bad[i], kernel=mark)
        with pytest.raises(ValueError, match="cannot be computed as"):
            graph_from_pb(graph_to_pb(Graph(tuple(bad), g.inputs, g.weights, g.outputs)))


def test_schedule_marks_roundtrip_and_are_checked():
    """The search's schedule on a kernel root survives serialization; on a node that roots no
    kernel of its own, or an unknown schedule, the graph is malformed."""
    import dataclasses

    g = _small_graph()
    nodes = list(g.nodes)
    nodes[-1] = dataclasses.replace(nodes[-1], schedule="parallel")  # the graph's SumReduce
    marked = Graph(tuple(nodes), g.inputs, g.weights, g.outputs, g.output_names)
    assert graph_from_pb(graph_to_pb(marked)).nodes[-1].schedule == "parallel"
    cases = ((len(nodes) - 2, "serial", "no kernel root"), (len(nodes) - 1, "vectorized", "unknown"),
             (len(nodes) - 1, "parallel/tile=48", "unknown"), (len(nodes) - 1, "serial/tile=64", "for a plain kernel"),
             (len(nodes) - 1, "serial/axis-outer/axis-outer", "unknown"))
    for i, mark, why in cases:
        bad = list(g.nodes)
        bad[i] = dataclasses.replace(bad[i], schedule=mark)
        with pytest.raises(ValueError, match=why):
            graph_from_pb(graph_to_pb(Graph(tuple(bad), g.inputs, g.weights, g.outputs)))
    # a GEMM's tile is its rows of C per BLAS call, of the GEMM sizes only (16 is attention's)
    nodes[-1] = dataclasses.replace(nodes[-1], kernel="gemm", schedule="parallel/tile=512")
    gemm = Graph(tuple(nodes), g.inputs, g.weights, g.outputs, g.output_names)
    assert graph_from_pb(graph_to_pb(gemm)).nodes[-1].schedule == "parallel/tile=512"
    nodes[-1] = dataclasses.replace(nodes[-1], schedule="serial/tile=16")
    with pytest.raises(ValueError, match="tile of 16 rows for a gemm kernel"):
        graph_from_pb(graph_to_pb(Graph(tuple(nodes), g.inputs, g.weights, g.outputs)))


def test_kernel_loop_order_and_tile_roundtrip_and_are_checked():
    """A reduce kernel's loop order survives serialization; a loop order on another kind of
    kernel, an unknown one, or a tile on anything but attention (or of no offered size) is a
    malformed kernel graph."""
    import dataclasses

    from kiln.ir.kernel import KernelGraph
    from kiln.ir.serialize import kernel_graph_from_pb, kernel_graph_to_pb
    from optimizer_svc.partition import partition

    kg = partition(_small_graph())
    (red,) = [k for k in kg.kernels if k.kind == "reduce"]
    ordered = KernelGraph(kg.graph, tuple(dataclasses.replace(k, order="axis-outer") if k is red else k
                                          for k in kg.kernels))
    assert kernel_graph_from_pb(kernel_graph_to_pb(ordered)) == ordered
    for change, why in (({"order": "k-outer"}, "loop order"), ({"kind": "elementwise", "order": "axis-outer"},
                                                                 "loop order"),
                        ({"tile": 64}, "tile"), ({"tile": 48}, "tile")):
        bad = KernelGraph(kg.graph, tuple(dataclasses.replace(k, **change) if k is red else k for k in kg.kernels))
        with pytest.raises(ValueError, match=why):
            kernel_graph_from_pb(kernel_graph_to_pb(bad))


def test_validate_rejects_cycles_and_dangling_refs():
    g = _small_graph()
    bad = list(g.nodes)
    n = bad[2]
    bad[2] = Node(n.op, (5,), n.shape, n.dtype, view=n.view)  # forward reference: a cycle
    with pytest.raises(ValueError, match="not an earlier node"):
        validate(Graph(tuple(bad), g.inputs, g.weights, g.outputs))
    with pytest.raises(ValueError, match="does not exist"):
        validate(Graph(g.nodes, g.inputs, g.weights, (99,)))


_DIGEST_SCRIPT = """
import torch, io
from kiln.apps.examples import encoder_example
from importer_svc.importer import lower_program
from kiln.cas.digest import digest_message
from kiln.ir.serialize import graph_to_pb
model, inputs = encoder_example()
graph, _ = lower_program(torch.export.export(model, inputs))
print(digest_message(graph_to_pb(graph)))
"""


def test_graph_digest_is_deterministic_across_processes():
    runs = [subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": "/usr/bin:/bin"}).stdout.strip().splitlines()[-1]
            for seed in (1, 2)]
    assert runs[0] == runs[1]
    assert len(runs[0].split("/")[0]) == 64
