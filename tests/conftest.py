"""Fixtures: the one place tests start servers (SeaweedFS S3, the four gRPC services)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

_TMP = Path(tempfile.mkdtemp(prefix="kiln-tests-"))
# test runs never touch the user's ~/.cache/kiln; the kernel cache is shared within a run, by
# every test process of it (pytest-xdist workers share the run's id)
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("KILN_KERNEL_CACHE", str(Path(tempfile.gettempdir()) / f"kiln-tests-kernels-{_RUN}"
                                              if _RUN else _TMP / "kernels"))
# two test processes on two cores: thread pools wait without spinning, so that one process's
# parallel kernel does not burn the core the other is compiling on
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ["KILN_TRACE_FILE"] = str(_TMP / "traces.jsonl")
# compiles in tests take the cost model's pick: timing 8 schedule candidates (each a compile
# of its kernels) per model would double the suite; tests/test_candidates.py times candidates
os.environ["KILN_CANDIDATES"] = "1"
# the cuda target runs under numba's CUDA simulator unless told otherwise (numba reads this at import)
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
os.environ["KILN_STORE"] = f"file://{_TMP / 'store'}"
for _s in ("IMPORTER", "OPTIMIZER", "CODEGEN", "EXECUTOR"):
    os.environ.pop(f"KILN_{_s}_ADDR", None)

sys.path.insert(0, str(Path(__file__).parent))

from kiln.apps.s3local import SeaweedS3  # noqa: E402


@pytest.fixture(scope="session")
def s3():
    server = SeaweedS3().start()
    yield server
    server.stop()


@pytest.fixture
def s3_store(s3, monkeypatch):
    for k, v in s3.env(f"kiln-tests/{uuid.uuid4().hex[:12]}").items():
        monkeypatch.setenv(k, v)
    from kiln.cas.store import open_store

    return open_store()


@pytest.fixture
def file_store(tmp_path):
    from kiln.cas.store import FileStore

    return FileStore(tmp_path / "store")


@pytest.fixture(params=["file", "s3"])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture(scope="session")
def span_exporter():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kiln.core.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    setup_tracing("kiln-tests", exporter)
    return exporter


@pytest.fixture(scope="session")
def services(s3, span_exporter):
    """The four services as real gRPC servers on loopback, each on its own port, over one S3 bucket."""
    from kiln.apps.serve import serve
    from kiln.cas.store import open_store

    env = s3.env("kiln-tests/services")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    store = open_store()
    servers, addrs = [], {}
    for stage in ("importer", "optimizer", "codegen", "executor"):
        server, port = serve([stage], 0, store)
        servers.append(server)
        addrs[stage] = f"127.0.0.1:{port}"
    for k, v in old.items():
        if v is None:
            os.environ.pop(k)
        else:
            os.environ[k] = v
    yield store, addrs
    for s in servers:
        s.stop(0)


@pytest.fixture
def remote_pipeline(services):
    from kiln.pipeline import Pipeline

    store, addrs = services
    return Pipeline(store, addrs)


@pytest.fixture
def local_pipeline(tmp_path):
    from kiln.pipeline import Pipeline

    return Pipeline(f"file://{tmp_path / 'store'}")


@pytest.fixture(params=["local", "remote"])
def pipeline(request):
    return request.getfixturevalue(f"{request.param}_pipeline")


class ServeProcess:
    """A `kiln serve ...` process started by a fixture below; ready once it printed where it serves."""

    def __init__(self, args, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln", "serve", *args], env={**os.environ, **env},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.first_line = self.proc.stdout.readline()
        if " serving on " not in self.first_line:
            rest = self.proc.stdout.read() if self.proc.poll() is not None else ""
            self.stop()
            raise AssertionError(f"kiln serve {' '.join(args)} did not start: {self.first_line}{rest}")
        self.addr = self.first_line.split(" serving on ")[1].split()[0]
        self.pid = self.proc.pid

    def readline(self) -> str:
        return self.proc.stdout.readline()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _serving():
    """A `serve(*args, env=)` that starts `kiln serve ARGS`, and stops every process it started
    when the generator is closed."""
    started: list[ServeProcess] = []

    def serve(*args: str, env: dict | None = None) -> ServeProcess:
        started.append(ServeProcess(args, env or {}))
        return started[-1]

    yield serve
    for p in started:
        p.stop()


@pytest.fixture
def kiln_serve():
    """Start `kiln serve ARGS` processes (stopped after the test): kiln_serve("all", "--port", "0")."""
    yield from _serving()


@pytest.fixture(scope="module")
def kiln_serve_module():
    """kiln_serve for a module's worth of tests."""
    yield from _serving()


@pytest.fixture(scope="module")
def farm(s3, tmp_path_factory):
    """`kiln farm up` on loopback: 1 importer, 3 optimizers, 2 codegens, 2 executors over the
    session's SeaweedFS, traces to the farm's own file; down (every replica gone) afterwards."""
    from helpers import FARM_LEASE_TTL_S
    from kiln.apps import farm as farm_mod

    d = tmp_path_factory.mktemp("farm")
    env = dict(os.environ)
    env.update(s3.env(f"kiln-farm-{uuid.uuid4().hex[:8]}"))
    env.update({"KILN_LEASE_TTL_S": str(FARM_LEASE_TTL_S), "OTEL_BSP_SCHEDULE_DELAY": "100",
                "KILN_TRACE_FILE": str(d / "traces.jsonl")})
    f = farm_mod.up({"importer": 1, "optimizer": 3, "codegen": 2, "executor": 2}, d, env)
    yield f
    farm_mod.down(d)
    assert not any(farm_mod._alive(r.pid) for r in f.replicas)


@pytest.fixture(scope="module")
def executor_server(store_dir):
    """A real Executor gRPC server on loopback over the requesting module's `store_dir`, and its servicer."""
    from executor_svc.server import ExecutorServicer
    from kiln.cas.store import FileStore
    from kiln.rpc.server import build_server

    servicer = ExecutorServicer(FileStore(store_dir))
    server, port = build_server([(servicer.add_to_server, servicer.SERVICE_NAME)], 0)
    yield f"127.0.0.1:{port}", servicer
    server.stop(0)


def pytest_collection_modifyitems(config, items):
    """Files with a test marked `slow(minutes=N)` run first, longest first: two test processes
    share the files (make test: pytest-xdist, a file at a time, in this order with
    --no-loadscope-reorder), and a long file started last finishes alone."""
    minutes: dict = {}
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            minutes[item.path] = max(minutes.get(item.path, 0), mark.kwargs.get("minutes", 1))
    items.sort(key=lambda item: -minutes.get(item.path, 0))  # stable: otherwise in collection order
