"""Torch in the same process as kiln keeps its speed: kiln's first parallel run starts numba's
OpenMP pool, and numba's start resizes the OpenMP runtime's pool on the calling thread, which in a
process with torch is torch's own (executor.start_pool). Run in a new interpreter, so that torch's
pool and numba's start from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.serial  # it times torch: beside the other test process, a block may be slowed

SCRIPT = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(2)
import numba
import kiln
from kiln.ir.serialize import kernel_graph_from_pb
from kiln.pipeline import Pipeline
from kiln.v1 import ir_pb2

torch.manual_seed(0)
torch_model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512)).eval()
xt = torch.randn(128, 512)
big = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).eval()
xb = torch.randn(256, 512)

def fastest_median_ms(f, blocks=7, runs=30):  # load makes it noisier, not slower-looking
    meds = []
    for _ in range(blocks):
        ts = []
        for _ in range(runs):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        meds.append(statistics.median(ts))
    return min(meds) * 1e3

with torch.no_grad():
    threads_before = torch.get_num_threads()
    before = fastest_median_ms(lambda: torch_model(xt))
    pipeline = Pipeline("file://" + sys.argv[1])
    compiled = kiln.compile(big, (xb,), pipeline=pipeline, candidates=1)
    err = max(float((compiled(xb) - big(xb)).abs().max()) for _ in range(3))
    pipeline.local_executor().wait_compiled()  # its compiled entry is built in the background
    kg = kernel_graph_from_pb(pipeline.store.get_message(compiled.result.kernel_graph, ir_pb2.KernelGraph))
    threads_after = torch.get_num_threads()
    after = fastest_median_ms(lambda: torch_model(xt))
print(json.dumps({"threads_before": threads_before, "threads_after": threads_after, "before_ms": before,
                  "after_ms": after, "err": err, "parallel_kernels": sum(k.parallel for k in kg.kernels),
                  "numba_threads": numba.get_num_threads()}))
"""


def test_a_two_thread_torch_model_keeps_its_speed_after_kiln_runs_a_parallel_program(tmp_path):
    """torch at 2 threads, kiln's pool at 1 (NUMBA_NUM_THREADS, as a deployment that splits the
    cores would set it): before the fix torch fell to numba's 1 thread."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NUMBA_NUM_THREADS="1", PYTHONPATH=str(root))
    env.pop("OMP_WAIT_POLICY", None)  # the runtimes' own defaults, as a user's process has them
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "store")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(got)
    assert got["parallel_kernels"] > 0 and got["numba_threads"] == 1  # kiln did start its pool
    assert got["err"] < 1e-3
    assert got["threads_before"] == 2 and got["threads_after"] == 2
    assert got["after_ms"] <= 1.5 * got["before_ms"], got
