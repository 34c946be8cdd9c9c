"""Compile a program's kernels in worker processes before their first call.

numba compiles one function at a time in a process (its compiler lock), and a cold compile
spends most of its time there: timing a real model's 8 candidates compiled about 85 distinct
kernels one after another (a MiniLM-shaped encoder: 160 s of a 226 s compile, 145 s of it in the
42 kernels with parallel loops). The kernels are independent, so they are compiled in
KILN_COMPILE_WORKERS processes at once (default: the CPUs this process may use). Each worker
imports the kernel's module from the kernel cache, where the executor wrote it, and compiles it
for the argument types the program passes it; numba saves the machine code beside the module,
and the first call in this process loads it from there instead of compiling.

The argument types come from a dry run of the entry's Python function with every kernel
replaced by a recorder: the entry only allocates buffers and slices views between kernel calls,
so the run costs microseconds and the types are those of the real calls. A worker that fails
costs nothing but time: the kernel is then compiled on its first call here, as without workers.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Callable, Sequence

from kiln.core import progress as live
from kiln.core.errors import InvalidArgument
from kiln.core.telemetry import current_span

log = logging.getLogger(__name__)

# below this much estimated compile work, starting workers (about a second each: a new
# interpreter importing numba) costs more than it saves
MIN_WORK_S = 6.0
# a kernel's compile time here: about 0.45 s, and 1.6 s more per parallel loop (a MiniLM-shaped
# encoder's 44 kernels: 23 serial ones 0.45 s each, 18 with one prange 1.6 s, attention with four 8 s)
SERIAL_KERNEL_S = 0.45
PARALLEL_LOOP_S = 1.6
JOB_TIMEOUT_S = 900.0  # a kernel a worker has not compiled by then is compiled here instead


def compile_workers() -> int:
    """KILN_COMPILE_WORKERS: processes that compile kernels at once (1: compile on first call,
    in this process). Default: the CPUs this process may run on."""
    v = os.environ.get("KILN_COMPILE_WORKERS", "")
    if not v:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise InvalidArgument(f"KILN_COMPILE_WORKERS must be a whole number of processes, at least 1, got {v!r}")
    return n


def with_kernels(host: Callable, wrap: Callable[[str, Callable], Callable]) -> Callable:
    """The entry's Python function with each kernel it calls (its globals named k_...) replaced
    by wrap(name, kernel)."""
    scope = dict(host.__globals__)
    for name, f in host.__globals__.items():
        if name.startswith("k_"):
            scope[name] = wrap(name, f)
    return types.FunctionType(host.__code__, scope, host.__name__, host.__defaults__, host.__closure__)


def kernel_signatures(host: Callable, args: Sequence) -> dict[str, tuple[Callable, set]]:
    """Per kernel the entry calls: its dispatcher and the numba argument types of its calls, from
    a dry run of the entry with the kernels not run."""
    from numba import typeof

    calls: dict[str, tuple[Callable, set]] = {}

    def record(name, kernel):
        def call(*a):
            calls.setdefault(name, (kernel, set()))[1].add(tuple(typeof(x) for x in a))
        return call

    with_kernels(host, record)(*args)
    return calls


def _cached(kernel) -> bool:
    """Whether numba's disk cache holds machine code for this kernel already (an index file
    beside its module); a wrong guess only misjudges whether workers are worth starting."""
    py = kernel.py_func
    path = Path(sys.modules[py.__module__].__file__)
    return any((path.parent / "__pycache__").glob(f"{py.__module__}.{py.__qualname__}-*.nbi"))


def estimated_seconds(kernel) -> float:
    """About how long numba takes to compile the kernel, by its parallel loops: the jobs go out
    longest first, so that no long kernel is left to one worker at the end while the others idle."""
    if not kernel.targetoptions.get("parallel"):
        return SERIAL_KERNEL_S
    try:
        loops = Path(sys.modules[kernel.py_func.__module__].__file__).read_text().count("prange(")
    except (KeyError, AttributeError, TypeError, OSError):
        loops = 1
    return SERIAL_KERNEL_S + PARALLEL_LOOP_S * max(1, loops)


def precompile(kernels: dict[str, tuple[Callable, set]], workers: int = 0) -> int:
    """Compile the kernels (name -> dispatcher, argument types) that are neither compiled in this
    process nor in numba's disk cache, in worker processes; returns how many were compiled
    there. Nothing is done when there is too little work to be worth the workers."""
    workers = workers or compile_workers()
    todo = [(estimated_seconds(k), k, sigs) for k, sigs in kernels.values()
            if not all(tuple(s) in k.overloads for s in sigs) and not _cached(k)]
    if workers < 2 or len(todo) < 2 or sum(est for est, _, _ in todo) < MIN_WORK_S:
        return 0
    # the longest first: a parallel kernel late in the queue would leave one worker finishing alone
    todo.sort(key=lambda job: -job[0])
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for _, k, sigs in todo:
        module = k.py_func.__module__
        jobs.put(base64.b64encode(pickle.dumps((module, sys.modules[module].__file__, k.py_func.__name__,
                                                 sorted(sigs, key=str)))) + b"\n")
    done, failed, peak_rss = [], [], [0]
    seconds: list[tuple[float, str]] = []  # each job's compile time in its worker, and its kernel
    t0 = time.monotonic()
    live.count("kernels compiled", 0, len(todo))
    threads = [threading.Thread(target=_feed, args=(jobs, done, failed, len(todo), peak_rss, seconds), daemon=True)
               for _ in range(min(workers, len(todo)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for error in failed[:3]:
        log.warning("a compile worker failed (%s); its kernel compiles on its first call instead", error)
    log.info("compiled %d of %d kernels in %d worker processes in %.1f s", len(done), len(todo), len(threads),
             time.monotonic() - t0)
    current_span().set_attribute("kiln.worker_peak_rss_mb", peak_rss[0] / 2**20)
    # the workers' compile time in all, and the longest kernel's (the least the wall time can be)
    current_span().set_attribute("kiln.worker_compile_s", sum(s for s, _ in seconds))
    current_span().set_attribute("kiln.longest_kernel_s", max((s for s, _ in seconds), default=0.0))
    # the slowest kernels by name, what to look at first when a compile is slow
    slowest = sorted(seconds, reverse=True)[:5]
    current_span().set_attribute("kiln.slowest_kernels", ", ".join(f"{name} {s:.1f}s" for s, name in slowest))
    return len(done)


def _feed(jobs: queue.SimpleQueue, done: list, failed: list, total: int, peak_rss: list, seconds: list) -> None:
    """One worker process: sends it jobs from the queue one at a time until the queue is empty.
    A worker started by a new interpreter (never forked: this process may hold thread pools, and
    never through multiprocessing, which would run the caller's script again in it)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen([sys.executable, "-c", "from executor_svc.precompile import serve; serve()"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env)
        except OSError as e:
            failed.append(f"cannot start a worker: {e}")
            return
        try:
            while True:
                try:
                    job = jobs.get_nowait()
                except queue.Empty:
                    break
                # a worker that hangs is killed, never waited on forever; its kernel then compiles here
                watchdog = threading.Timer(JOB_TIMEOUT_S, proc.kill)
                watchdog.start()
                try:
                    proc.stdin.write(job)
                    proc.stdin.flush()
                    line = proc.stdout.readline()
                except OSError:  # the worker died before it read the job
                    line = b""
                finally:
                    watchdog.cancel()
                if not line:
                    err.seek(0)
                    failed.append(f"worker exited with {proc.wait()}: {err.read()[-2000:].decode(errors='replace')}")
                    return
                reply = json.loads(line)
                peak_rss[0] = max(peak_rss[0], reply["peak_rss"])
                seconds.append((reply["seconds"], reply["kernel"]))
                (failed if reply["error"] else done).append(reply["error"])
                live.count("kernels compiled", len(done), total)
        finally:
            try:
                proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


def serve() -> None:
    """A worker's loop: a job per line on stdin; per line on stdout its error (or ""), how long
    it took and the worker's peak resident memory so far."""
    for line in sys.stdin.buffer:
        module, path, symbol, signatures = pickle.loads(base64.b64decode(line))
        t0 = time.perf_counter()
        error = _compile(module, path, symbol, signatures)
        sys.stdout.write(json.dumps({"error": error, "seconds": time.perf_counter() - t0, "kernel": symbol,
                                     "peak_rss": _peak_rss()}) + "\n")
        sys.stdout.flush()


def _peak_rss() -> int:
    """This process's peak resident bytes. From its address space's high-water mark where Linux
    gives it: getrusage's figure of a process started by vfork and exec includes its parent's."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _compile(module: str, path: str, symbol: str, signatures: list) -> str:
    """In a worker: import the kernel's module from its file under its own name (numba's cache
    is keyed by both) and compile the kernel for each signature, which numba saves to its cache.
    Returns an error message, or "" when done."""
    import importlib.util

    try:
        if module not in sys.modules:
            spec = importlib.util.spec_from_file_location(module, path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[module] = mod
            spec.loader.exec_module(mod)
        kernel = getattr(sys.modules[module], symbol)
        for sig in signatures:
            kernel.compile(sig)
        return ""
    except Exception as e:  # noqa: BLE001 - reported to the parent, which compiles it itself
        return f"{symbol}: {type(e).__name__}: {e}"
