"""Softmax, RMS norm and layer norm are composed once (kiln/ir/compose.py): the search's rules
recognise each composition as its row kernel, and extraction rebuilds it node for node."""

import numpy as np
import pytest

from kiln.ir import compose
from kiln.ir.builder import GraphBuilder
from kiln.ir.dtypes import DType
from kiln.ir.evaluate import evaluate
from optimizer_svc.saturate import SearchLimits, saturate

ROWS = {
    "softmax": lambda b, x: compose.softmax(b, x, 1),
    "rms_norm": lambda b, x: compose.rms_norm(b, x, [1], 1e-5),
    "layer_norm": lambda b, x: compose.layer_norm(b, x, [1], 1e-5)[0],
}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_each_composition_is_recognised_and_rebuilt_as_it_was(name):
    b = GraphBuilder()
    x = b.input("x", (3, 8), DType.F32)
    g = b.build([ROWS[name](b, x)])
    out, report = saturate(g, SearchLimits())
    assert any(f"Term.{name}(" in rule for rule in report.rules), sorted(report.rules)
    rows = [n for n in out.nodes if n.kernel == "row"]
    assert len(rows) == 1
    # rebuilt by the same composition: the same ops in the same order, now marked as a row kernel
    assert [n.op for n in out.nodes] == [n.op for n in g.nodes]
    xs = {"x": np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)}
    np.testing.assert_allclose(evaluate(out, xs, {})[0], evaluate(g, xs, {})[0], rtol=1e-6, atol=1e-7)
