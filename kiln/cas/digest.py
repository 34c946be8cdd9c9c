"""The one digest function: sha256 hex + size, over bytes or a deterministically serialized proto."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from google.protobuf.message import Message

_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Digest:
    hash: str
    size_bytes: int

    def __post_init__(self):
        if not _HEX.match(self.hash) or self.size_bytes < -1:  # -1: size unknown (a bare hash typed by a person)
            raise ValueError(f"malformed digest {self.hash!r}/{self.size_bytes}")

    def __str__(self) -> str:
        return f"{self.hash}/{self.size_bytes}"

    @staticmethod
    def parse(text: str) -> "Digest":
        """Accepts `HEX/SIZE`, or a bare HEX (size unknown, -> looked up by hash)."""
        h, _, size = text.strip().partition("/")
        try:
            return Digest(h.lower(), int(size) if size else -1)
        except ValueError as e:
            raise ValueError(f"not a digest: {text!r} (expected 64 hex digits, optionally /SIZE)") from e

    def to_pb(self):
        from kiln.v1 import ir_pb2

        return ir_pb2.Digest(hash=self.hash, size_bytes=self.size_bytes)

    @staticmethod
    def from_pb(p) -> "Digest":
        return Digest(p.hash, p.size_bytes)


def digest_bytes(data: bytes) -> Digest:
    return Digest(hashlib.sha256(data).hexdigest(), len(data))


def serialize(msg: Message) -> bytes:
    return msg.SerializeToString(deterministic=True)


def digest_message(msg: Message) -> Digest:
    return digest_bytes(serialize(msg))
