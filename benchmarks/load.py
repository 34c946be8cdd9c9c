"""Load on loopback: 32 concurrent clients on the executor's Run for 60 s (errors, p50/p99 latency,
server memory over the run), then 8 models compiled at once through the importer and optimizer.

    .venv/bin/python benchmarks/load.py [--clients 32] [--seconds 60] [--compiles 8] [--json FILE]

Starts its own `kiln serve all` process over a temporary file store."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kiln
from kiln.apps.examples import Encoder
from kiln.apps.loadtest import concurrent_compiles, distinct_mlps, run_load

STAGES = ("importer", "optimizer", "codegen", "executor")


def start_server(store_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "all", "--port", "0"],
                            env={**os.environ, "KILN_STORE": f"file://{store_dir}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = proc.stdout.readline()
    if " serving on " not in line:
        raise SystemExit(f"server did not start: {line}{proc.stdout.read()}")
    return proc, line.split(" serving on ")[1].split()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--compiles", type=int, default=8)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiln-load-") as d:
        proc, addr = start_server(Path(d) / "store")
        try:
            addresses = {s: addr for s in STAGES}
            store = f"file://{Path(d) / 'store'}"
            torch.manual_seed(0)
            model, x = Encoder().eval(), torch.randn(2, 16, 64)
            compiled = kiln.compile(model, (x,), pipeline=kiln.Pipeline(store, addresses))
            with torch.no_grad():
                expected = model(x).numpy()
            r = run_load(addr, compiled.session, [("x", x.numpy())], [expected], clients=args.clients,
                         seconds=args.seconds, server_pid=proc.pid)
            print("Run load:", r.summary())
            models = distinct_mlps(args.compiles, first_width=48)
            t0 = time.perf_counter()
            compiles = concurrent_compiles(addresses, store, models)
            wall = time.perf_counter() - t0
            print(f"{args.compiles} concurrent compiles: all correct, {wall:.1f} s wall, each "
                  + ", ".join(f"{s:.1f} s (err {e:.1e})" for s, e in compiles))
            if args.json:
                Path(args.json).write_text(json.dumps({
                    "clients": r.clients, "seconds": r.seconds, "calls": r.calls, "errors": r.errors,
                    "wrong_outputs": r.wrong_outputs, "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "max_ms": r.max_ms,
                    "rss_mb": r.rss_mb, "rss_growth": r.rss_growth, "compiles_s": [s for s, _ in compiles],
                    "compiles_wall_s": wall}, indent=2))
            return 0 if not r.errors and not r.wrong_outputs and r.rss_growth < 0.05 else 1
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
