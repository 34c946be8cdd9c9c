"""Warm start: a second process loading a compiled bundle finds its machine code in the kernel
cache (numba compiles nothing), also after two cold processes filled the cache at once."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

import kiln
from executor_svc.start import measure_start
from kiln.apps.examples import mlp_example
from kiln.pipeline import Pipeline


def test_second_process_compiles_nothing_and_concurrent_writers_are_safe(tmp_path):
    p = Pipeline()
    m, args = mlp_example()
    compiled = kiln.compile(m, args, pipeline=p, candidates=1)
    bundle, manifest = str(compiled.result.bundle), str(compiled.result.manifest)
    url = os.environ["KILN_STORE"]
    cache = tmp_path / "kernels"
    # two cold processes at once on an empty cache: both compile, both give the same outputs
    with ThreadPoolExecutor(2) as pool:
        cold = list(pool.map(lambda _: measure_start(url, bundle, manifest, cache), range(2)))
    assert all(c["compiled"] > 0 for c in cold), cold
    assert cold[0]["outputs"] == cold[1]["outputs"]
    # the first run (kernels called from Python) and the compiled entry's agree (the entry's
    # module optimizes the kernels again with their fast-math flags: the last bits may differ)
    for c in cold:
        assert [o[:3] for o in c["outputs"]] == [o[:3] for o in c["entry_outputs"]]
        assert [o[3] for o in c["outputs"]] == pytest.approx([o[3] for o in c["entry_outputs"]], rel=1e-6)
    # a third process loads the kernels and the entry from the cache the two wrote (the entry's
    # machine code holds the kernels it calls) and compiles nothing
    warm = measure_start(url, bundle, manifest, cache)
    assert warm["compiled"] == 0 and warm["loaded"] >= 1, (warm, cold)
    assert warm["outputs"] == cold[0]["outputs"]
    assert not list(cache.rglob(".tmp-*")), "a writer left a temporary file behind"
