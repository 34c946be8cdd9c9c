"""PyTorch's OpInfo samples through the importer for every op kiln claims; docs/ops.md is their output."""

from collections import Counter
from pathlib import Path

from kiln.opsuite import render, run_suite


def test_opinfo_samples_give_no_wrong_answers_and_docs_are_generated():
    results = run_suite()
    bad = [r for r in results if r.status in ("mismatch", "error")]
    assert not bad, bad[:5]
    counts = Counter(r.status for r in results)
    assert counts["pass"] >= 150
    # the supported-ops page is exactly what the registry and this run produce
    docs = Path(__file__).parent.parent / "docs" / "ops.md"
    assert docs.read_text() == render(results), "docs/ops.md is stale: run python -m kiln.opsuite --write docs/ops.md"
