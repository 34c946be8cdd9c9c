"""PyTorch's OpInfo samples for every op kiln claims, through the reference evaluator and through
the generated CPU kernels; docs/ops.md is their output."""

from collections import Counter
from pathlib import Path

import pytest

from opsuite import render, run_suite

pytestmark = pytest.mark.slow(minutes=12)  # its file starts first under make test


def test_opinfo_samples_give_no_wrong_answers_and_docs_are_generated():
    results = run_suite()
    bad = [r for r in results if r.status in ("mismatch", "error") or r.kernels in ("mismatch", "error")]
    assert not bad, bad[:5]
    counts = Counter(r.status for r in results)
    assert counts["pass"] >= 150
    # every sample the evaluator passes also compiles and runs right on the CPU target
    assert all(r.kernels == "pass" for r in results if r.status == "pass"), \
        [r for r in results if r.status == "pass" and r.kernels != "pass"][:5]
    # the supported-ops page is exactly what the registry and this run produce
    docs = Path(__file__).resolve().parents[2] / "docs" / "ops.md"
    assert docs.read_text() == render(results), "docs/ops.md is stale: run python tests/opsuite.py --write docs/ops.md"
