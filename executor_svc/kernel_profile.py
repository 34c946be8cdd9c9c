"""Time each kernel of a loaded bundle: where a run's time goes (`kiln profile`).

The compiled entry calls its kernels with no Python between them, so it cannot be timed
piecewise. Instead its Python form (numba keeps it as `py_func`) runs with each kernel wrapped
in a timer; the kernels themselves are the same compiled functions. The i-th call of a run is
the i-th call line of the entry's source, which names the kernel graph's kernel it runs (a
kernel module shared by several kernels, such as every layer's, is one bundle entry). Each
time includes one dispatch from Python into numba (a few microseconds), which the compiled
entry does not pay; the report gives the compiled entry's own time beside the sum.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from executor_svc.executor import Session, check_inputs, pool_threads, random_inputs
from executor_svc.precompile import with_kernels
from kiln.core.errors import InvalidArgument


@dataclass(frozen=True)
class KernelTime:
    name: str
    kind: str
    symbol: str
    seconds: float  # median over the repeats


def kernel_times(session: Session, bundle, repeats: int = 20, symbols: Optional[Mapping[str, int]] = None
                 ) -> tuple[list[KernelTime], float]:
    """Per-kernel median times, and the compiled entry's median time on the same inputs."""
    if not 1 <= repeats <= 10_000:
        raise InvalidArgument(f"repeats must be in 1..10000, got {repeats}")
    env = {name: int((symbols or {}).get(name, hi)) for name, _, hi in session.symbols}
    args, env = check_inputs(session.inputs, random_inputs(session.inputs, env), session.symbols)
    call_args = [*args, *session.weights, *[np.int64(env[name]) for name, _, _ in session.symbols], pool_threads()]
    calls: list[float] = []

    def timed(kernel):
        def run(*a):
            t = time.perf_counter()
            kernel(*a)
            calls.append(time.perf_counter() - t)
        return run

    kinds = {k.symbol: k.kind for k in bundle.kernels}
    order = [(name, symbol) for symbol, name in _CALL.findall(bundle.module_source)]
    stepped = with_kernels(session.entry.py_func, lambda _, kernel: timed(kernel))
    with session.lock:
        session.entry(*call_args)  # warm: nothing left to compile
        stepped(*call_args)
        per: list[list[float]] = [[] for _ in order]
        whole = []
        for _ in range(repeats):
            calls.clear()
            stepped(*call_args)
            if len(calls) != len(order):
                raise RuntimeError(f"the entry made {len(calls)} kernel calls, its source has {len(order)}")
            for i, dt in enumerate(calls):
                per[i].append(dt)
            t = time.perf_counter()
            session.entry(*call_args)
            whole.append(time.perf_counter() - t)
    return ([KernelTime(name, kinds[symbol], symbol, statistics.median(ts)) for (name, symbol), ts in zip(order, per)],
            statistics.median(whole))


_CALL = re.compile(r"^\s+(k_[0-9a-f]+)\(.*\)  # (\S+)$", re.M)  # a kernel call in the entry, and its name
