"""The action cache: ac/<sha256 of (stage, version, input digests, canonical options)> -> results."""

from __future__ import annotations

import json
from typing import Mapping, Optional

from kiln.digest import Digest, digest_bytes
from kiln.store import BlobStore
from kiln.telemetry import current_span
from kiln.v1 import ir_pb2


def action_key(stage: str, version: str, inputs: Mapping[str, Digest], options: Mapping[str, object]) -> str:
    canon = json.dumps({"stage": stage, "version": version, "inputs": {k: str(v) for k, v in sorted(inputs.items())},
                        "options": dict(sorted(options.items()))}, sort_keys=True, separators=(",", ":"))
    return digest_bytes(canon.encode()).hash


def lookup(store: BlobStore, key: str) -> Optional[dict[str, Digest]]:
    d = store.get_action(key)
    if d is None:
        current_span().set_attribute("kiln.action_cache", "miss")
        return None
    rec = store.get_message(d, ir_pb2.ActionResult)
    outs = {k: Digest.from_pb(v) for k, v in rec.outputs.items()}
    if not all(store.exists(v) for v in outs.values()):
        return None
    current_span().set_attribute("kiln.action_cache", "hit")
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
