"""The dtypes of kiln's IR and their numpy/torch equivalents."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I32 = "i32"
    I64 = "i64"
    BOOL = "bool"

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16)

    @property
    def itemsize(self) -> int:
        return {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "i64": 8, "bool": 1}[self.value]

    @property
    def is_half(self) -> bool:
        """16-bit floats: stored as 16-bit words, computed in f32 inside kernels."""
        return self in (DType.F16, DType.BF16)

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype; bf16 is ml_dtypes' bfloat16 (numpy has none of its own)."""
        return np.dtype({"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "i32": np.int32,
                         "i64": np.int64, "bool": np.bool_}[self.value])

    @staticmethod
    def from_numpy(dt: np.dtype) -> "DType":
        table = {np.dtype(np.float32): DType.F32, np.dtype(np.float16): DType.F16,
                 np.dtype(ml_dtypes.bfloat16): DType.BF16,
                 np.dtype(np.int32): DType.I32, np.dtype(np.int64): DType.I64,
                 np.dtype(np.bool_): DType.BOOL}
        if np.dtype(dt) not in table:
            raise ValueError(f"numpy dtype {dt} has no kiln dtype")
        return table[np.dtype(dt)]

    @staticmethod
    def from_torch(dt) -> "DType":
        import torch

        table = {torch.float32: DType.F32, torch.float16: DType.F16, torch.bfloat16: DType.BF16,
                 torch.int32: DType.I32, torch.int64: DType.I64, torch.bool: DType.BOOL}
        if dt not in table:
            raise ValueError(f"torch dtype {dt} is not supported by kiln (supported: f32, f16, bf16, i32, i64, bool)")
        return table[dt]

    @property
    def torch(self):
        import torch

        return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "i32": torch.int32,
                "i64": torch.int64, "bool": torch.bool}[self.value]


def torch_to_numpy(t) -> np.ndarray:
    """A torch tensor as a contiguous numpy array of the same dtype (bf16 as ml_dtypes.bfloat16)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(DType.BF16.numpy)
    return t.numpy()


def numpy_to_torch(a: np.ndarray):
    """The inverse of torch_to_numpy."""
    import torch

    a = np.ascontiguousarray(a)
    if a.dtype == DType.BF16.numpy:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)

