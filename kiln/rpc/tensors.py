"""Tensors at the edges: numpy arrays <-> kiln.v1.Tensor, inline or by digest."""

from __future__ import annotations

import numpy as np

from kiln.cas.digest import Digest
from kiln.core.errors import InvalidArgument
from kiln.ir.dtypes import DType
from kiln.ir.serialize import dtype_from_pb, dtype_to_pb
from kiln.cas.store import BlobStore
from kiln.v1 import ir_pb2

INLINE_LIMIT = 4 << 20  # larger tensors travel as blobs


def array_to_pb(name: str, a: np.ndarray, store: BlobStore | None = None) -> ir_pb2.Tensor:
    a = np.ascontiguousarray(a)
    dt = DType.from_numpy(a.dtype)
    t = ir_pb2.Tensor(name=name, dtype=dtype_to_pb(dt), shape=list(a.shape))
    data = a.tobytes()
    if store is not None and len(data) > INLINE_LIMIT:
        t.digest.CopyFrom(store.put(data).to_pb())
    else:
        t.data = data
    return t


def array_from_pb(t: ir_pb2.Tensor, store: BlobStore | None = None) -> np.ndarray:
    try:
        dt = dtype_from_pb(t.dtype)
    except ValueError as e:
        raise InvalidArgument(f"tensor {t.name!r}: {e}") from e
    if any(d < 0 for d in t.shape):
        raise InvalidArgument(f"tensor {t.name!r} has a negative dim in {list(t.shape)}")
    count = 1
    for d in t.shape:
        count *= d
        if count > 1 << 34:
            raise InvalidArgument(f"tensor {t.name!r} shape {list(t.shape)} is absurdly large")
    if t.HasField("digest"):
        if store is None:
            raise InvalidArgument(f"tensor {t.name!r} is given by digest but no store is configured")
        data = store.get(Digest.from_pb(t.digest))
    else:
        data = t.data
    if len(data) != count * dt.itemsize:
        raise InvalidArgument(f"tensor {t.name!r}: {len(data)} bytes do not hold {dt.value}{list(t.shape)} "
                              f"({count * dt.itemsize} bytes)")
    return np.frombuffer(data, dtype=dt.numpy).reshape(tuple(t.shape)).copy()
