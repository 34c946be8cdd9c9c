"""Cold and warm start: a fresh process loading a bundle, from Load to its first result.

Compiled machine code is cached on disk (numba's cache of each kernel module, the module named
by its source's hash, see executor.load_module): a cold process compiles every kernel, a warm
one loads them. `measure_start` runs the child below in a new interpreter with a given kernel
cache directory and reads back what it saw: seconds to load the session (import the kernel
modules, bind weights), seconds for the first run (its kernels called from Python), seconds for
the first run of the compiled entry (compiled, or loaded from the cache), the interpreter's own
start (imports), and how many kernel and entry functions numba compiled or loaded from its cache.

Child: python -m executor_svc.start STORE_URL BUNDLE MANIFEST  (prints one JSON line)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

_T0 = time.perf_counter()


def first_request(store_url: str, bundle: str, manifest: str) -> dict:
    """In this process: load the bundle, run it on random inputs until its compiled entry has run
    once (its first runs call the kernels from Python while the HOST_RUNS-th starts building it,
    executor.HOST_RUNS; entry_run_s is the wait for that build plus the run); times, compile counts
    and a summary of the first and the compiled entry's outputs."""
    from executor_svc.executor import HOST_RUNS, Executor, random_inputs
    from kiln.cas.digest import Digest
    from kiln.cas.store import open_store

    imported = time.perf_counter()
    ex = Executor(open_store(store_url))
    t0 = time.perf_counter()
    s = ex.open(Digest.parse(bundle), Digest.parse(manifest))
    t1 = time.perf_counter()
    inputs = random_inputs(s.inputs, {name: hi for name, _, hi in s.symbols})
    outs = ex.run_session(s, inputs)
    t2 = time.perf_counter()
    for _ in range(HOST_RUNS - 1):
        ex.run_session(s, inputs)
    t3 = time.perf_counter()
    if s.build is not None:  # started by the HOST_RUNS-th run, in the background (a cuda entry has none)
        s.build.join()
    if not s.built.is_set():
        raise RuntimeError(f"the compiled entry of bundle {bundle} was not built (the executor's log says why)")
    entry_outs = ex.run_session(s, inputs)
    t4 = time.perf_counter()
    compiled, loaded = _numba_counts()
    return {"imports_s": imported - _T0, "load_s": t1 - t0, "first_run_s": t2 - t1, "start_s": t2 - t0,
            "entry_run_s": t4 - t3, "compiled": compiled, "loaded": loaded,
            "outputs": _summary(outs), "entry_outputs": _summary(entry_outs)}


def _summary(outs) -> list:
    return [[name, str(a.dtype), list(a.shape), float(abs(a.astype("float64")).sum())] for name, a in outs]


def _numba_counts() -> tuple[int, int]:
    """(functions numba compiled, functions it loaded from its disk cache) across kiln's
    kernel and entry modules in this process."""
    from numba.core.registry import CPUDispatcher

    compiled = loaded = 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("kiln_"):
            continue
        for obj in vars(mod).values():
            if isinstance(obj, CPUDispatcher) and obj.__module__ == name:
                st = obj.stats
                compiled += sum(st.cache_misses.values())
                loaded += sum(st.cache_hits.values())
    return compiled, loaded


def measure_start(store_url: str, bundle: str, manifest: str, kernel_cache: str, timeout: float = 600) -> dict:
    """Run the child in a new interpreter over `kernel_cache`; its report plus the process's wall time."""
    env = dict(os.environ, KILN_KERNEL_CACHE=str(kernel_cache))
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "executor_svc.start", store_url, bundle, manifest], env=env,
                       capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        raise RuntimeError(f"start child failed ({r.returncode}): {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process_s"] = wall
    return out


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print("usage: python -m executor_svc.start STORE_URL BUNDLE MANIFEST", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(first_request(*sys.argv[1:])))
