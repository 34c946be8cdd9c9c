"""Structural dedup: regions by module index, one saturation per distinct structure, the
action cache across compiles, and a fallback when regions feed each other both ways."""

import numpy as np

from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.evaluate import evaluate
from kiln.ir.ops import Op
from optimizer_svc.optimizer import saturate_regions
from optimizer_svc.regions import assemble, canonical, split
from optimizer_svc.saturate import SearchLimits

SHAPE = (4, 8)


def _stack(layers: int):
    """A residual stack: each layer computes x + w_i * sin(x * 1.0 * 2.0) under its own module."""
    b = GraphBuilder()
    x = b.input("x", SHAPE, DType.F32)
    b.source = "aten.mul at model.py:3 in module 'model.embed'"
    h = b.binary(Op.MUL, x, b.const(0.5, DType.F32, SHAPE))
    for i in range(layers):
        b.source = f"aten.sin at model.py:9 in module 'model.layers.{i}.mlp'"
        w = b.weight(f"model.layers.{i}.w", SHAPE, DType.F32)
        t = b.binary(Op.MUL, b.binary(Op.MUL, h, b.const(1.0, DType.F32, SHAPE)), b.const(2.0, DType.F32, SHAPE))
        h = b.binary(Op.ADD, h, b.binary(Op.MUL, w, b.unary(Op.SIN, t)))
    b.source = "aten.sqrt at model.py:12 in module 'model.norm'"
    out = b.unary(Op.SQRT, b.binary(Op.MUL, h, h))
    return b.build([out])


def _inputs(g):
    rng = np.random.default_rng(0)
    ins = {"x": rng.standard_normal(SHAPE).astype(np.float32)}
    ws = {t.name: rng.standard_normal(SHAPE).astype(np.float32) for t in g.weights}
    return ins, ws


def test_split_and_assemble_reproduce_the_graph():
    g = _stack(3)
    regions = split(g)
    names = sorted(r.name for r in regions)
    assert [n for n in names if n.startswith("model.layers.")] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    canon = {r.name: canonical(g, r) for r in regions}
    layer_graphs = [canon[f"model.layers.{i}"] for i in range(3)]
    assert layer_graphs[0] == layer_graphs[1] == layer_graphs[2]  # one structure, weights as placeholders
    rebuilt = assemble(g, regions, canon)
    ins, ws = _inputs(g)
    np.testing.assert_array_equal(evaluate(rebuilt, ins, ws)[0], evaluate(g, ins, ws)[0])
    assert rebuilt.inputs == g.inputs and rebuilt.weights == g.weights


def test_each_structure_is_saturated_once_and_cached(file_store):
    g = _stack(6)
    opt, report, stats = saturate_regions(file_store, g, SearchLimits())
    assert stats.regions == 8 and stats.distinct == 3 and stats.cache_hits == 0  # embed, layer, norm
    assert report.stop_reason == "saturated"
    assert any("Term.mul(Term.mul(x" in k for k in report.rules)  # the scalar chain folded inside layers
    ins, ws = _inputs(g)
    np.testing.assert_allclose(evaluate(opt, ins, ws)[0], evaluate(g, ins, ws)[0], rtol=1e-6, atol=1e-6)
    assert len(opt.nodes) < len(g.nodes)
    again, report2, stats2 = saturate_regions(file_store, _stack(6), SearchLimits())
    assert stats2.cache_hits == 3 and not report2.iterations  # nothing saturated the second time
    assert again == opt


def test_regions_feeding_each_other_fall_back_to_one_saturation(file_store):
    b = GraphBuilder()
    x = b.input("x", SHAPE, DType.F32)
    b.source = "s in module 'model.layers.0'"
    a = b.unary(Op.SIN, x)
    b.source = "m in module 'model.head'"
    m = b.binary(Op.MUL, a, b.const(2.0, DType.F32, SHAPE))
    b.source = "s in module 'model.layers.0'"
    out = b.binary(Op.ADD, m, a)
    g = b.build([out])
    opt, report, stats = saturate_regions(file_store, g, SearchLimits())
    assert stats.regions == 1 and report.stop_reason == "saturated"
    ins, _ = _inputs(g)
    np.testing.assert_allclose(evaluate(opt, ins, {})[0], evaluate(g, ins, {})[0], rtol=1e-6)
