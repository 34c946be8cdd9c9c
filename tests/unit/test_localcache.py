"""The machine's own cache beside the store: where kernels and traces live, and their size caps
with the oldest going first (kiln.core.localcache)."""

import json
import os
import time

import pytest

from kiln.core.errors import InvalidArgument
from kiln.core import localcache


def test_kernels_and_traces_live_beside_a_file_store_unless_told(monkeypatch, tmp_path):
    for v in ("KILN_CACHE_DIR", "KILN_KERNEL_CACHE", "KILN_TRACE_FILE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("KILN_STORE", f"file://{tmp_path / 'store'}")
    assert localcache.kernel_cache_dir() == tmp_path / "store" / "kernels"
    assert localcache.trace_file() == tmp_path / "store" / "traces.jsonl"
    monkeypatch.setenv("KILN_STORE", "s3://bucket/prefix")
    assert localcache.cache_dir() == localcache.Path("~/.cache/kiln").expanduser()
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "mine"))
    assert localcache.kernel_cache_dir() == tmp_path / "mine" / "kernels"
    monkeypatch.setenv("KILN_KERNEL_CACHE", str(tmp_path / "k"))
    assert localcache.kernel_cache_dir() == tmp_path / "k"
    monkeypatch.setenv("KILN_TRACE_MAX_MB", "none")
    with pytest.raises(InvalidArgument, match="KILN_TRACE_MAX_MB"):
        localcache.trace_cap()


def test_the_kernel_cache_keeps_under_its_cap_least_recently_used_first(monkeypatch, tmp_path):
    """Twelve modules of 20 KB written through the executor's loader under a 100 KB cap, a
    second apart: the cache stays under the cap, the oldest go first (each with numba's files
    for it), a module imported again stays; a module this process holds is never deleted."""
    import sys

    from executor_svc import executor

    monkeypatch.setenv("KILN_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("KILN_KERNEL_CACHE_MB", str(100 / 1024))
    root = tmp_path / "kernels"
    names = [f"kiln_test_evict_{i}" for i in range(12)]

    def load(i):
        executor.load_module(names[i], f"X = {i}\n" + "#" * 20_000 + "\n", "k")
        sys.modules.pop(names[i])  # as if another process had imported it

    try:
        for i in range(12):
            load(i)
            (root / "k" / "__pycache__").mkdir(exist_ok=True)
            (root / "k" / "__pycache__" / f"{names[i]}.run-1.py311.nbi").write_bytes(b"0" * 100)
            t = time.time() - 1000 + i
            os.utime(root / "k" / f"{names[i]}.py", (t, t))
            if i == 5:
                load(1)  # imported again: used just now
        left = {p.stem for p in (root / "k").glob("*.py")}
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        assert size <= 100 * 1024, size
        assert {names[1], names[11]} <= left and names[0] not in left and len(left) < 12
        assert not (root / "k" / "__pycache__" / f"{names[0]}.run-1.py311.nbi").exists()
        assert localcache.evict_kernels(root, left, 1) == 0  # every module held: none deleted
        assert {p.stem for p in (root / "k").glob("*.py")} == left
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_the_trace_file_keeps_its_newest_whole_lines_under_its_cap(tmp_path):
    path = tmp_path / "traces.jsonl"
    cap = 10_000
    for i in range(400):
        localcache.append_line(path, json.dumps({"batch": i, "pad": "x" * 80}) + "\n", cap)
        assert path.stat().st_size <= cap
    batches = [json.loads(line)["batch"] for line in path.read_text().splitlines()]  # every line whole
    assert batches == list(range(batches[0], 400)) and len(batches) > 20
