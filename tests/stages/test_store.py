"""One suite for the blob store, run against file:// and a real S3 server (SeaweedFS)."""

import io
import os

import pytest

from kiln.cas.digest import Digest, digest_bytes
from kiln.core.errors import DataLoss, NotFound
from kiln.cas.store import FileStore, S3Store


def test_put_get_exists(store):
    d = store.put(b"kiln blob")
    assert d == digest_bytes(b"kiln blob")
    assert store.exists(d)
    assert store.get(d) == b"kiln blob"
    assert store.put(b"kiln blob") == d  # idempotent


def test_missing_blob_is_not_found(store):
    d = digest_bytes(b"never stored")
    assert not store.exists(d)
    with pytest.raises(NotFound):
        store.get(d)


def _overwrite(store, d: Digest, data: bytes):
    key = store.blob_key(d)
    if isinstance(store, FileStore):
        (store.root / key).write_bytes(data)
    else:
        store.client.put_object(store.bucket, store.prefix + key, io.BytesIO(data), len(data))


def test_get_verifies_hash(store):
    d = store.put(b"original content")
    _overwrite(store, d, b"tampered content")
    with pytest.raises(DataLoss, match="corrupt"):
        store.get(d)


def test_action_cache_roundtrip(store):
    d = store.put(b"result")
    assert store.get_action("k" * 64) is None
    store.put_action("k" * 64, d)
    assert store.get_action("k" * 64) == d


class _Interrupted(Exception):
    pass


def test_interrupted_put_leaves_no_blob(store, monkeypatch):
    data = b"x" * 100_000
    d = digest_bytes(data)
    if isinstance(store, FileStore):
        real_fsync = os.fsync

        def crash(fd):
            raise _Interrupted()

        monkeypatch.setattr(os, "fsync", crash)
        with pytest.raises(_Interrupted):
            store.put(data)
        monkeypatch.setattr(os, "fsync", real_fsync)
        leftovers = [p for p in (store.root / "cas" / "sha256").iterdir()]
        assert leftovers == []
    else:
        class Breaks(io.RawIOBase):
            def __init__(self):
                self.sent = 0

            def readable(self):
                return True

            def readinto(self, b):
                if self.sent > 30_000:
                    raise _Interrupted()
                n = min(len(b), 10_000)
                b[:n] = data[self.sent:self.sent + n]
                self.sent += n
                return n

        with pytest.raises(_Interrupted):
            store.client.put_object(store.bucket, store.prefix + store.blob_key(d), Breaks(), len(data))
    assert not store.exists(d)
    with pytest.raises(NotFound):
        store.get(d)
    assert store.put(data) == d and store.get(d) == data


def test_s3_store_down_is_unavailable():
    from kiln.core.errors import Unavailable

    with pytest.raises(Unavailable):
        S3Store("bucket", "127.0.0.1:9", "a", "b")


def test_exclusive_create_has_one_winner(store):
    assert store.create_lease("l" * 64 + ".0", b"first")
    assert not store.create_lease("l" * 64 + ".0", b"second")
    assert store.read_lease("l" * 64 + ".0") == b"first"
    store.delete_lease("l" * 64 + ".0")
    assert store.read_lease("l" * 64 + ".0") is None


def test_flight_runs_the_work_once_across_threads(store):
    """Eight callers of one action at once: one holds the lease and works, the rest wait for
    its result in the action cache."""
    import threading
    import time

    from kiln.cas import cache

    key = cache.action_key("test", "1", {}, {"case": os.urandom(8).hex()})
    done, results = [], []

    def caller():
        with cache.flight(store, key) as hit:
            if hit is None:
                done.append(1)
                time.sleep(0.5)
                cache.record(store, key, {"out": store.put(b"the result")})
                hit = cache.lookup(store, key)
        results.append(hit["out"])

    threads = [threading.Thread(target=caller) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 1
    assert results == [digest_bytes(b"the result")] * 8


def test_flight_sees_work_finished_before_its_first_lease_try(store, monkeypatch):
    """The race CI once lost: a caller misses the cache, and before its first lease try the
    holder records its result and releases; the caller gets the lease but must see the result,
    not do the work again."""
    from kiln.cas import cache

    key = cache.action_key("test", "1", {}, {"case": os.urandom(8).hex()})
    real_read, finished = store.read_lease, []

    def read_lease(name):
        if not finished:  # between this caller's cache miss and its first lease try
            finished.append(1)
            with cache.flight(store, key) as hit:  # the other caller: works, records, releases
                assert hit is None
                cache.record(store, key, {"out": store.put(b"done once")})
        return real_read(name)

    monkeypatch.setattr(store, "read_lease", read_lease)
    with cache.flight(store, key) as hit:
        assert finished and hit == {"out": digest_bytes(b"done once")}


def test_an_expired_lease_is_taken_over(store, monkeypatch):
    """A holder killed mid-work stops renewing: after the TTL another caller takes over."""
    from kiln.cas import cache

    monkeypatch.setenv("KILN_LEASE_TTL_S", "0.6")
    key = cache.action_key("test", "1", {}, {"case": os.urandom(8).hex()})
    dead = cache.Lease.try_acquire(store, key)
    dead._stop.set()  # the holder dies: no more renewals, no release
    assert cache.Lease.try_acquire(store, key) is None  # still live
    with cache.flight(store, key) as hit:  # waits out the TTL, then works
        assert hit is None
        cache.record(store, key, {"out": store.put(b"x")})
    assert cache.lookup(store, key) == {"out": digest_bytes(b"x")}


def test_waiting_for_a_live_lease_honours_the_deadline(store):
    import time

    from kiln.cas import cache
    from kiln.core.errors import DeadlineExceeded

    key = cache.action_key("test", "1", {}, {"case": os.urandom(8).hex()})
    holder = cache.Lease.try_acquire(store, key)
    try:
        with pytest.raises(DeadlineExceeded, match="another replica"):
            with cache.flight(store, key, deadline=time.monotonic() + 0.5):
                pass
    finally:
        holder.release()


def test_a_seaweedfs_port_taken_after_it_was_chosen_gets_new_ports(tmp_path, monkeypatch):
    """free_port's port is free when chosen, not when weed binds it: a first start whose port
    another process took in between starts again on new ports (and serves), not a failed fixture."""
    import socket

    import kiln.apps.s3local as s3local

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        chosen = iter([taken])
        real = s3local.free_port
        monkeypatch.setattr(s3local, "free_port", lambda: next(chosen, None) or real())
        s3 = s3local.SeaweedS3(tmp_path / "s3")
        assert s3.port == taken
        try:
            s3.start()
            assert s3.port != taken
            blob = S3Store("kept", s3.endpoint, s3.access_key, s3.secret_key).put(b"served")
            assert S3Store("kept", s3.endpoint, s3.access_key, s3.secret_key).get(blob) == b"served"
            assert b"address already in use" in (tmp_path / "s3" / "weed.log").read_bytes()
        finally:
            s3.stop()
