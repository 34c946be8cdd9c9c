"""The action cache: ac/<sha256 of (stage, version, input digests, canonical options)> -> results,
and single-flight leases, so two replicas asked for the same work at once do it once."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from typing import Iterator, Mapping, Optional

from kiln.cas.digest import Digest, digest_bytes
from kiln.cas.store import BlobStore
from kiln.core.errors import DeadlineExceeded, KilnError
from kiln.core.metrics import count_cache_lookup
from kiln.core.telemetry import current_span
from kiln.v1 import ir_pb2


class ActionKey(str):
    """An action's key (hex), knowing its stage for the hit-ratio metric."""

    stage: str = "unknown"


def action_key(stage: str, version: str, inputs: Mapping[str, Digest], options: Mapping[str, object]) -> ActionKey:
    canon = json.dumps({"stage": stage, "version": version, "inputs": {k: str(v) for k, v in sorted(inputs.items())},
                        "options": dict(sorted(options.items()))}, sort_keys=True, separators=(",", ":"))
    key = ActionKey(digest_bytes(canon.encode()).hash)
    key.stage = stage
    return key


def lookup(store: BlobStore, key: str, count: bool = True) -> Optional[dict[str, Digest]]:
    """The recorded outputs of an action, or None. `count`: this lookup is a request's first (metrics)."""
    outs = _recorded(store, key)
    current_span().set_attribute("kiln.action_cache", "miss" if outs is None else "hit")
    if count:
        count_cache_lookup(getattr(key, "stage", "unknown"), outs is not None)
    return outs


def _recorded(store: BlobStore, key: str) -> Optional[dict[str, Digest]]:
    d = store.get_action(key)
    if d is None:
        return None
    rec = store.get_message(d, ir_pb2.ActionResult)
    outs = {k: Digest.from_pb(v) for k, v in rec.outputs.items()}
    if not all(store.exists(v) for v in outs.values()):
        return None
    return outs


def record(store: BlobStore, key: str, outputs: Mapping[str, Digest]) -> None:
    rec = ir_pb2.ActionResult()
    for k, v in outputs.items():
        rec.outputs[k].CopyFrom(v.to_pb())
    store.put_action(key, store.put_message(rec))


def code_version(*packages: str) -> str:
    """A fingerprint of the source of the packages a stage's result depends on, so a changed
    lowering, rule or emitter never reuses results cached by older code."""
    import hashlib
    import importlib
    from pathlib import Path

    h = hashlib.sha256()
    for name in packages:
        root = Path(importlib.import_module(name).__file__).parent
        for path in sorted(root.rglob("*.py")):
            if "v1" in path.relative_to(root).parts:  # generated protobuf code
                continue
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


LEASE_TTL_S = 15.0  # a lease not renewed for this long is taken over (its holder died)
WAIT_POLL_MAX_S = 1.0


def lease_ttl() -> float:
    return float(os.environ.get("KILN_LEASE_TTL_S", "") or LEASE_TTL_S)


class Lease:
    """Who is doing the work for one action key. Leases live in the store under
    lease/<key>.<generation>, created by a conditional write (exactly one creator wins) and
    renewed by their holder every third of the TTL; an expired lease (its holder was killed) is
    taken over by creating the next generation. A holder that stalls past its TTL can overlap
    with the one that took over: then the work is done twice, with the same content-addressed
    result, never a wrong one."""

    def __init__(self, store: BlobStore, name: str, ttl: float):
        self.store, self.name, self.ttl = store, name, ttl
        self.owner = f"{os.uname().nodename}/{os.getpid()}/{uuid.uuid4().hex[:8]}"
        self._stop = threading.Event()
        self._writing = threading.Lock()  # a renewal never lands after release's delete
        self._renewer: Optional[threading.Thread] = None

    def _record(self) -> bytes:
        return json.dumps({"owner": self.owner, "expires": time.time() + self.ttl}).encode()

    @classmethod
    def try_acquire(cls, store: BlobStore, key: str, ttl: Optional[float] = None) -> Optional["Lease"]:
        """The lease for `key`, or None while another live holder has it."""
        ttl = lease_ttl() if ttl is None else ttl
        gen = 0
        while True:
            name = f"{key}.{gen}"
            data = store.read_lease(name)
            if data is None:
                lease = cls(store, name, ttl)
                if store.create_lease(name, lease._record()):
                    lease._start()
                    return lease
                continue  # another one created it just now: read it
            try:
                expires = float(json.loads(data)["expires"])
            except (ValueError, KeyError, TypeError):
                expires = 0.0  # unreadable: treat as expired
            if expires > time.time():
                return None
            gen += 1

    def _start(self) -> None:
        def renew():
            while not self._stop.wait(self.ttl / 3):
                with self._writing:
                    if self._stop.is_set():
                        return
                    try:
                        self.store.write_lease(self.name, self._record())
                    except KilnError:
                        pass  # store briefly down: the next renewal may get through

        self._renewer = threading.Thread(target=renew, name=f"lease-{self.name[:12]}", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        with self._writing:
            self._stop.set()
        try:
            self.store.delete_lease(self.name)
        except KilnError:
            pass  # it expires on its own


@contextlib.contextmanager
def flight(store: BlobStore, key: str, deadline: Optional[float] = None) -> Iterator[Optional[dict[str, Digest]]]:
    """Single-flight around one action: yields the cached outputs (done earlier, or by the
    replica that held the lease while this one waited) or None, which means this caller holds
    the lease and does the work (and records it) inside the block. `deadline` is a
    time.monotonic() value; waiting past it is DEADLINE_EXCEEDED."""
    hit = lookup(store, key)
    if hit is not None:
        yield hit
        return
    pause, waited = 0.05, False
    while True:
        lease = Lease.try_acquire(store, key)
        if lease is not None:
            break
        if not waited:
            current_span().add_event("kiln.lease_wait", {"kiln.action": key})
            waited = True
        if deadline is not None and time.monotonic() + pause > deadline:
            raise DeadlineExceeded(f"gave up waiting for another replica doing the same work (action {key[:16]})")
        time.sleep(pause)
        pause = min(pause * 2, WAIT_POLL_MAX_S)
        hit = lookup(store, key, count=False)
        if hit is not None:
            current_span().set_attribute("kiln.single_flight", "waited")
            yield hit
            return
    try:
        # the holder before this one may have finished between this caller's last look at the
        # cache and its lease (also before its first try: a miss, then a slow first acquire)
        yield lookup(store, key, count=False)
    finally:
        lease.release()
