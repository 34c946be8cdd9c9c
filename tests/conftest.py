"""Fixtures: the one place tests start servers (SeaweedFS S3, the four gRPC services)."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

_TMP = Path(tempfile.mkdtemp(prefix="kiln-tests-"))
# test runs never touch the user's ~/.cache/kiln; the kernel cache is shared within a run
os.environ.setdefault("KILN_KERNEL_CACHE", str(_TMP / "kernels"))
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
