"""What a machine keeps for itself beside the shared store: compiled kernels and traces.

Both live under KILN_CACHE_DIR: by default beside the store (the directory of a `file://` store in
KILN_STORE), else ~/.cache/kiln. KILN_KERNEL_CACHE and KILN_TRACE_FILE still name either one
elsewhere. Each has a size cap, and the oldest goes first when it is over:

- the kernel cache (KILN_KERNEL_CACHE_MB, default 4096): a generated module and the machine code
  numba cached for it are one unit; a unit's age is when it was last imported (its file is
  touched on every import), and units go oldest first until the cache is under 90% of the cap;
- the trace file (KILN_TRACE_MAX_MB, default 256): its oldest export lines go, down to half the
  cap, whole lines only, under a lock that every appending process takes too.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kiln.core.limits import positive_setting

KERNEL_CACHE_MB = 4096
TRACE_MAX_MB = 256


def cache_dir() -> Path:
    d = os.environ.get("KILN_CACHE_DIR")
    if d:
        return Path(d).expanduser()
    store = os.environ.get("KILN_STORE", "")
    if store.startswith("file://"):
        return Path(store[len("file://"):]).expanduser()
    return Path("~/.cache/kiln").expanduser()


def kernel_cache_dir() -> Path:
    return Path(os.environ.get("KILN_KERNEL_CACHE") or cache_dir() / "kernels").expanduser()


def trace_file() -> Path:
    return Path(os.environ.get("KILN_TRACE_FILE") or cache_dir() / "traces.jsonl").expanduser()


def _megabytes(variable: str, default: float) -> int:
    return int(positive_setting(variable, default, "MiB") * (1 << 20))


def kernel_cache_cap() -> int:
    return _megabytes("KILN_KERNEL_CACHE_MB", KERNEL_CACHE_MB)


def trace_cap() -> int:
    return _megabytes("KILN_TRACE_MAX_MB", TRACE_MAX_MB)


def evict_kernels(root: Path, keep: set[str], cap: int) -> int:
    """Delete the least recently imported modules under root (each `NAME.py` in a subfolder
    with numba's `__pycache__/NAME.*` files) until the whole is under 90% of cap, when it is
    over cap; never a module named in `keep` (imported by this process). Returns bytes freed."""
    units: dict[Path, list] = {}  # module file -> [last use, bytes, its files]
    total = 0
    for sub in (p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
        cached = sub / "__pycache__"
        files = {f.name: f for f in cached.iterdir()} if cached.is_dir() else {}
        for py in sub.glob("*.py"):
            try:
                st = py.stat()
            except FileNotFoundError:
                continue
            mine = [py] + [f for n, f in files.items() if n.startswith(py.stem + ".")]
            size = 0
            for f in mine:
                try:
                    size += f.stat().st_size
                except FileNotFoundError:
                    pass
            units[py] = [st.st_mtime, size, mine]
            total += size
    if total <= cap:
        return 0
    freed = 0
    for py, (_, size, files) in sorted(units.items(), key=lambda kv: kv[1][0]):
        if total - freed <= 0.9 * cap:
            break
        if py.stem in keep:
            continue
        for f in files:
            try:
                f.unlink()
            except FileNotFoundError:
                pass
        freed += size
    return freed


def append_line(path: Path, line: str, cap: int) -> None:
    """Append one line to path under an exclusive lock; when the file is then over cap, keep
    only its newest whole lines, up to half the cap."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(line)
            f.flush()
            if f.tell() > cap:
                _keep_newest(path, cap // 2)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _keep_newest(path: Path, budget: int) -> None:
    """Rewrite path in place (the same file, whose lock the caller holds) with its newest whole
    lines that fit in budget bytes."""
    with open(path, "r+b") as g:
        data = g.read()
        start = len(data) - budget
        cut = data.find(b"\n", start - 1) + 1 if start > 0 else 0  # the first whole line inside the budget
        g.seek(0)
        g.write(data[cut:])
        g.truncate()
