"""Content-addressed blob store and action cache, over a local directory or any S3 server.

One interface: put / get / exists for blobs (get verifies the sha256), get_action / put_action
for the action cache. The store is chosen by one setting (KILN_STORE), never by code.
"""

from __future__ import annotations

import io
import os
import tempfile
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional, Type, TypeVar

from google.protobuf.message import DecodeError, Message

from kiln.cas.digest import Digest, digest_bytes, serialize
from kiln.core.errors import DataLoss, InvalidArgument, NotFound, Unavailable

M = TypeVar("M", bound=Message)


class BlobStore(ABC):
    url: str

    @abstractmethod
    def _write(self, key: str, data: bytes) -> None: ...

    @abstractmethod
    def _read(self, key: str) -> Optional[bytes]: ...

    @abstractmethod
    def _has(self, key: str) -> bool: ...

    @abstractmethod
    def _create(self, key: str, data: bytes) -> bool:
        """Write `key` only if it does not exist, atomically; False if it did."""

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @staticmethod
    def blob_key(d: Digest) -> str:
        return f"cas/sha256/{d.hash}"

    def put(self, data: bytes) -> Digest:
        d = digest_bytes(data)
        key = self.blob_key(d)
        if not self._has(key):
            self._write(key, data)
        return d

    def get(self, d: Digest) -> bytes:
        data = self._read(self.blob_key(d))
        if data is None:
            raise NotFound(f"no blob {d} in store {self.url}")
        actual = digest_bytes(data)
        if actual.hash != d.hash or (d.size_bytes >= 0 and actual.size_bytes != d.size_bytes):
            raise DataLoss(f"blob {d} in store {self.url} is corrupt: its content hashes to {actual}")
        return data

    def exists(self, d: Digest) -> bool:
        return self._has(self.blob_key(d))

    def put_message(self, msg: Message) -> Digest:
        return self.put(serialize(msg))

    def get_message(self, d: Digest, cls: Type[M]) -> M:
        msg = cls()
        try:
            msg.ParseFromString(self.get(d))
        except DecodeError as e:
            raise InvalidArgument(f"blob {d} is not a {cls.DESCRIPTOR.full_name}: {e}") from e
        return msg

    def get_action(self, key: str) -> Optional[Digest]:
        data = self._read(f"ac/{key}")
        if data is None:
            return None
        try:
            d = Digest.parse(data.decode())
        except ValueError:
            return None  # an unreadable entry is a miss, and is overwritten by the next put_action
        return d if self.exists(d) else None

    def put_action(self, key: str, result: Digest) -> None:
        self._write(f"ac/{key}", str(result).encode())

    # leases (kiln.cas.cache.flight): small mutable records under lease/, never blobs
    def create_lease(self, name: str, data: bytes) -> bool:
        return self._create(f"lease/{name}", data)

    def write_lease(self, name: str, data: bytes) -> None:
        self._write(f"lease/{name}", data)

    def read_lease(self, name: str) -> Optional[bytes]:
        return self._read(f"lease/{name}")

    def delete_lease(self, name: str) -> None:
        self._delete(f"lease/{name}")


class FileStore(BlobStore):
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        self.url = f"file://{self.root}"
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / key

    def _staged(self, key: str, data: bytes, place) -> None:
        """Write `data` whole to a temp file beside the key's path, then `place(tmp, path)` it
        there (os.replace: overwrite; os.link: only if absent): readers never see it partial."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            place(tmp, path)
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:  # replaced into place
                pass

    def _write(self, key: str, data: bytes) -> None:
        self._staged(key, data, os.replace)

    def _read(self, key: str) -> Optional[bytes]:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _has(self, key: str) -> bool:
        return self._path(key).exists()

    def _create(self, key: str, data: bytes) -> bool:
        try:
            self._staged(key, data, os.link)  # link fails if the key exists
            return True
        except FileExistsError:
            return False

    def _delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass


class S3Store(BlobStore):
    """Blobs as objects in one bucket, through the minio SDK (MinIO or any S3 server).
    An S3 PUT is atomic: an object appears under its key only once fully uploaded."""

    def __init__(self, bucket: str, endpoint: str, access_key: str, secret_key: str, secure: bool = False,
                 prefix: str = ""):
        import urllib3
        from minio import Minio

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        # maxsize: stages call the store from many threads at once (urllib3's default keeps one
        # connection per host and opens and drops a new one for every other concurrent call)
        http = urllib3.PoolManager(maxsize=32, timeout=urllib3.Timeout(connect=3, read=30),
                                   retries=urllib3.Retry(total=2, backoff_factor=0.2,
                                                         status_forcelist=[500, 502, 503, 504]))
        self.client = Minio(endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=http)
        self._call(self._ensure_bucket)

    def _ensure_bucket(self):
        from minio.error import S3Error

        if not self.client.bucket_exists(self.bucket):
            try:
                self.client.make_bucket(self.bucket)
            except S3Error as e:  # another replica, starting at the same time, made it
                if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

    def _call(self, fn, *args):
        from minio.error import S3Error
        import urllib3

        try:
            return fn(*args)
        except S3Error:
            raise
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(f"S3 store {self.url} is unreachable: {type(e).__name__}: {e}") from e

    def _write(self, key: str, data: bytes) -> None:
        self._call(lambda: self.client.put_object(self.bucket, self.prefix + key, io.BytesIO(data), len(data)))

    def _read(self, key: str) -> Optional[bytes]:
        from minio.error import S3Error

        def read():
            try:
                resp = self.client.get_object(self.bucket, self.prefix + key)
            except S3Error as e:
                if e.code in ("NoSuchKey", "NoSuchObject", "NotFound"):
                    return None
                raise
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._call(read)

    def _has(self, key: str) -> bool:
        from minio.error import S3Error

        def has():
            try:
                self.client.stat_object(self.bucket, self.prefix + key)
                return True
            except S3Error as e:
                if e.code in ("NoSuchKey", "NoSuchObject", "NotFound", "ResourceNotFound"):
                    return False
                raise

        return self._call(has)

    def _create(self, key: str, data: bytes) -> bool:
        from minio.error import S3Error

        def create():
            # a conditional PUT (If-None-Match: *; MinIO, SeaweedFS and AWS S3 honour it). The
            # SDK's public put_object files unknown headers as user metadata, so this goes
            # through its PutObject call with the header as given.
            try:
                self.client._put_object(self.bucket, self.prefix + key, data, headers={"If-None-Match": "*"})
                return True
            except S3Error as e:
                if e.code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return False
                raise

        return self._call(create)

    def _delete(self, key: str) -> None:
        self._call(lambda: self.client.remove_object(self.bucket, self.prefix + key))


def open_store(url: Optional[str] = None) -> BlobStore:
    """`file://DIR` (default ~/.cache/kiln) or `s3://BUCKET[/PREFIX]` with KILN_S3_* settings."""
    url = url or os.environ.get("KILN_STORE") or "file://~/.cache/kiln"
    if url.startswith("file://"):
        return FileStore(url[len("file://"):])
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://"):].partition("/")
        endpoint = os.environ.get("KILN_S3_ENDPOINT")
        if not endpoint:
            raise InvalidArgument("KILN_STORE is s3:// but KILN_S3_ENDPOINT is not set")
        secure = endpoint.startswith("https://")
        endpoint = endpoint.removeprefix("https://").removeprefix("http://")
        return S3Store(bucket, endpoint, os.environ.get("KILN_S3_ACCESS_KEY", ""),
                       os.environ.get("KILN_S3_SECRET_KEY", ""), secure=secure, prefix=prefix)
    raise InvalidArgument(f"unknown store {url!r}: use file://DIR or s3://BUCKET")
