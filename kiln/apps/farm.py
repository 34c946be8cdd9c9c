"""A local compile farm: real server processes on loopback over one S3 store.

`kiln farm up --optimizer 3 --codegen 2 --executor 2` starts SeaweedFS's S3 gateway (unless
KILN_STORE already names an s3:// store) and that many replicas of each stage, each its own
`kiln serve STAGE` process; optimizers know their peers (KILN_OPTIMIZER_PEERS) for fan-out.
It waits until every replica reports SERVING on grpc.health.v1 and prints the settings that
point a client at the farm. `kiln farm down` stops every process it started and keeps the
store's data (DIR/s3, and the credentials in DIR/s3-secret, so the next `up` serves the same
blobs to the same settings); `down --purge` deletes them. What is running is written to
DIR/farm.json (default ~/.cache/kiln/farm), so `down` works from any shell.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from kiln.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kiln.apps.s3local import SeaweedS3, free_port

STAGES = ("importer", "optimizer", "codegen", "executor")
DEFAULT_DIR = "~/.cache/kiln/farm"
READY_TIMEOUT_S = 120.0


@dataclass
class Replica:
    stage: str
    index: int
    port: int
    pid: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class Farm:
    dir: Path
    replicas: list[Replica] = field(default_factory=list)
    s3_pid: int = 0
    env: dict[str, str] = field(default_factory=dict)  # store settings the servers and clients share

    def addresses(self, stage: str) -> str:
        return ",".join(r.address for r in self.replicas if r.stage == stage)

    def client_env(self) -> dict[str, str]:
        """What a client sets to use the farm: the store and every stage's replica list."""
        out = dict(self.env)
        for s in STAGES:
            if self.addresses(s):
                out[f"KILN_{s.upper()}_ADDR"] = self.addresses(s)
        return out

    def save(self) -> None:
        state = {"replicas": [r.__dict__ for r in self.replicas], "s3_pid": self.s3_pid, "env": self.env}
        path = self.dir / "farm.json"
        tmp = path.with_suffix(".tmp")
        # the S3 secret is in here: readable by its owner only
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> Optional["Farm"]:
        d = Path(directory).expanduser()
        try:
            state = json.loads((d / "farm.json").read_text())
        except FileNotFoundError:
            return None
        return cls(d, [Replica(**r) for r in state["replicas"]], state.get("s3_pid", 0), state.get("env", {}))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _wait_serving(address: str, proc: subprocess.Popen, log: Path, deadline: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kiln.rpc.client import channel

    with channel(address) as ch:  # the farm's own TLS settings, if any
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise Unavailable(f"replica at {address} exited with {proc.returncode}: "
                                  f"{log.read_text()[-2000:] if log.exists() else ''}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise Unavailable(f"replica at {address} did not report SERVING in {READY_TIMEOUT_S:.0f} s; "
                                  f"see {log}")
            time.sleep(0.2)


def up(counts: Mapping[str, int], directory: str | os.PathLike = DEFAULT_DIR,
       env: Optional[Mapping[str, str]] = None) -> Farm:
    """Start the farm; returns it once every replica is SERVING. On any failure everything
    started so far is stopped again."""
    env = dict(os.environ if env is None else env)
    for stage, n in counts.items():
        if stage not in STAGES:
            raise InvalidArgument(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
        if not 0 <= n <= 64:
            raise InvalidArgument(f"--{stage} must be 0..64 replicas, got {n}")
    d = Path(directory).expanduser()
    running = Farm.load(d)
    if running is not None and any(_alive(r.pid) for r in running.replicas):
        raise FailedPrecondition(f"a farm is already up in {d}; `kiln farm down` first")
    d.mkdir(parents=True, exist_ok=True)
    (d / "logs").mkdir(exist_ok=True)
    farm = Farm(d)
    try:
        if env.get("KILN_STORE", "").startswith("s3://"):
            farm.env = {k: env[k] for k in ("KILN_STORE", "KILN_S3_ENDPOINT", "KILN_S3_ACCESS_KEY",
                                            "KILN_S3_SECRET_KEY") if k in env}
        else:  # a store of its own: SeaweedFS with fresh credentials
            s3 = SeaweedS3(d / "s3", access_key="kiln-farm", secret_key=_secret(d))
            s3.start()
            farm.s3_pid = s3.proc.pid
            farm.env = s3.env("kiln-farm")
        farm.save()
        ports = {s: [free_port() for _ in range(counts.get(s, 0))] for s in STAGES}
        peers = ",".join(f"127.0.0.1:{p}" for p in ports["optimizer"])
        procs = []
        for stage in STAGES:
            for i, port in enumerate(ports[stage]):
                child = dict(env)
                child.update(farm.env)
                for s in STAGES:
                    child.pop(f"KILN_{s.upper()}_ADDR", None)
                child["KILN_OPTIMIZER_PEERS"] = peers if stage == "optimizer" and len(ports["optimizer"]) > 1 else ""
                child.setdefault("KILN_TRACE_FILE", str(d / "traces.jsonl"))
                log = d / "logs" / f"{stage}-{i}.log"
                with open(log, "ab") as out:
                    proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", stage, "--port", str(port)],
                                            env=child, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
                farm.replicas.append(Replica(stage, i, port, proc.pid))
                procs.append((proc, log))
                farm.save()
        deadline = time.monotonic() + READY_TIMEOUT_S
        for r, (proc, log) in zip(farm.replicas, procs):
            _wait_serving(r.address, proc, log, deadline)
        return farm
    except BaseException:
        down(d)
        raise


def _stop(pid: int, grace: float = 10.0) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child: poll whether it is gone
            if not _alive(pid):
                return
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _secret(d: Path) -> str:
    """The farm's S3 secret key, made once per directory and kept with its data."""
    path = d / "s3-secret"
    if path.exists():
        return path.read_text().strip()
    secret = secrets.token_hex(16)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    return secret


def down(directory: str | os.PathLike = DEFAULT_DIR, purge: bool = False) -> int:
    """Stop every process of the farm in `directory`; returns how many were running. The
    store's data and credentials stay unless `purge`."""
    d = Path(directory).expanduser()
    farm = Farm.load(d)
    alive = []
    if farm is not None:
        pids = [r.pid for r in farm.replicas] + ([farm.s3_pid] if farm.s3_pid else [])
        alive = [p for p in pids if _alive(p)]
        for pid in alive:
            _stop(pid)
        (d / "farm.json").unlink(missing_ok=True)
    if purge:
        import shutil

        shutil.rmtree(d / "s3", ignore_errors=True)
        (d / "s3-secret").unlink(missing_ok=True)
    return len(alive)
