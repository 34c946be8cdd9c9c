"""View specs: every movement op (reshape, permute, expand, slice, pad, ...) is one strided view.

A view reads its source as a contiguous row-major tensor of the source's logical shape.
Output element `i` (a multi-index) reads source flat element `offset + sum(i[k] * strides[k])`
when `i` lies in the valid region `mask` (a half-open range per dim), and 0 otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kiln.ir.shape import Dim, Shape, contiguous_strides, is_static


@dataclass(frozen=True)
class ViewSpec:
    shape: Shape
    strides: tuple[Dim, ...]
    offset: Dim = 0
    mask: Optional[tuple[tuple[Dim, Dim], ...]] = None

    def __post_init__(self):
        if len(self.shape) != len(self.strides):
            raise ValueError(f"view rank mismatch: shape {self.shape} strides {self.strides}")
        if self.mask is not None and len(self.mask) != len(self.shape):
            raise ValueError("view mask must have one range per dim")

    @staticmethod
    def contiguous(shape: Shape) -> "ViewSpec":
        return ViewSpec(tuple(shape), contiguous_strides(shape))

    def is_contiguous_of(self, src_shape: Shape) -> bool:
        return (self.mask is None and self.offset == 0 and tuple(self.shape) == tuple(src_shape)
                and self.strides == contiguous_strides(self.shape))

    def key(self) -> str:
        """Canonical text of the spec, used as its identity inside the e-graph."""
        m = "" if self.mask is None else "|m=" + ",".join(f"{lo}:{hi}" for lo, hi in self.mask)
        return (f"s={','.join(map(str, self.shape))}|t={','.join(map(str, self.strides))}"
                f"|o={self.offset}{m}")

    def __str__(self) -> str:
        return self.key()


# ---- constructors used by the importer, all relative to a contiguous source ----


def reshape(src: Shape, new: Shape) -> ViewSpec:
    return ViewSpec.contiguous(new)


def permute(src: Shape, perm: tuple[int, ...]) -> ViewSpec:
    st = contiguous_strides(src)
    return ViewSpec(tuple(src[p] for p in perm), tuple(st[p] for p in perm))


def expand(src: Shape, new: Shape) -> ViewSpec:
    """Broadcast `src` (right-aligned, size-1 dims stretched) to `new`."""
    st = contiguous_strides(src)
    lead = len(new) - len(src)
    if lead < 0:
        raise ValueError(f"cannot expand {src} to {new}")
    strides: list[Dim] = []
    for i, d in enumerate(new):
        if i < lead:
            strides.append(0)
            continue
        s = src[i - lead]
        if s == d:
            strides.append(st[i - lead] if s != 1 else 0)
        elif s == 1:
            strides.append(0)
        else:
            raise ValueError(f"cannot expand {src} to {new}")
    return ViewSpec(tuple(new), tuple(strides))


def slice_(src: Shape, dim: int, start: int, stop: int, step: int) -> ViewSpec:
    from kiln.ir.shape import dim_floordiv

    st = contiguous_strides(src)
    n = stop - start if step == 1 else dim_floordiv(stop - start + step - 1, step)
    if isinstance(n, int):
        n = max(0, n)
    shape = list(src)
    shape[dim] = n
    strides = list(st)
    strides[dim] = st[dim] * step
    return ViewSpec(tuple(shape), tuple(strides), start * st[dim])


def pad(src: Shape, pads: tuple[tuple[int, int], ...]) -> ViewSpec:
    """Zero padding: pads[k] = (before, after) for dim k."""
    st = contiguous_strides(src)
    shape = tuple(d + b + a for d, (b, a) in zip(src, pads))
    offset: Dim = 0
    for s, (b, _) in zip(st, pads):
        offset = offset - b * s
    mask = tuple((b, b + d) for d, (b, _) in zip(src, pads))
    return ViewSpec(shape, st, offset, mask)


# ---- composition ----


def compose(inner: ViewSpec, outer: ViewSpec) -> Optional[ViewSpec]:
    """One view equal to `outer` applied to the output of `inner`, or None if none exists
    (codegen then chains the two index maps)."""
    inner_contig = inner.mask is None and inner.strides == contiguous_strides(inner.shape)
    if inner_contig:
        return ViewSpec(outer.shape, outer.strides, outer.offset + inner.offset, outer.mask)
    if not (is_static(inner.shape) and is_static(outer.shape) and is_static(inner.strides)
            and is_static(outer.strides) and isinstance(outer.offset, int)
            and isinstance(inner.offset, int)):
        return _compose_axes(inner, outer)
    if outer.mask is None and outer.offset == 0 and outer.strides == contiguous_strides(outer.shape):
        if inner.mask is not None:
            return None
        strides = _reshape_strides(inner.shape, inner.strides, outer.shape)
        return None if strides is None else ViewSpec(outer.shape, strides, inner.offset)
    return _compose_aligned(inner, outer)


def _full(mask, shape) -> bool:
    return mask is None or all(lo == 0 and hi == d for (lo, hi), d in zip(mask, shape))


def _compose_axes(inner: ViewSpec, outer: ViewSpec) -> Optional[ViewSpec]:
    """compose() where sizes are symbolic: an outer view each of whose axes is one whole axis of
    inner (a permute), a broadcast (stride 0) or of size 1, with no offset. A Conv1D's [K, N]
    weight transposed, reshaped and broadcast over a sequence of any length is then one strided
    view, which a GEMM reads in place instead of packing a copy on every call. Else None."""
    if outer.offset != 0:
        return None
    cs = contiguous_strides(inner.shape)
    strides: list[Dim] = []
    of: dict[int, int] = {}  # inner axis -> the outer axis that walks it
    for k, (n, t) in enumerate(zip(outer.shape, outer.strides)):
        if n == 1 or t == 0:
            strides.append(0)
            continue
        m = next((m for m, (d, c) in enumerate(zip(inner.shape, cs)) if d == n and c == t), None)
        if m is None or m in of:
            return None
        of[m] = k
        strides.append(inner.strides[m])
    mask = None if _full(outer.mask, outer.shape) else list(outer.mask)
    if not _full(inner.mask, inner.shape):
        mask = mask or [(0, n) for n in outer.shape]
        for m, ((lo, hi), d) in enumerate(zip(inner.mask, inner.shape)):
            if lo == 0 and hi == d:
                continue
            if m not in of or mask[of[m]] != (0, d):
                return None  # a padded axis read back by a broadcast or under a mask of outer's own
            mask[of[m]] = (lo, hi)
    return ViewSpec(outer.shape, tuple(strides), inner.offset, None if mask is None else tuple(mask))


def _reshape_strides(shape, strides, new_shape):
    """Strides that view (shape, strides) as new_shape without copying, else None."""
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return tuple(contiguous_strides(new_shape))
    old = [(d, s) for d, s in zip(shape, strides) if d != 1]
    new_strides = [0] * len(new_shape)
    oi = 0
    ni = 0
    non1 = [i for i, d in enumerate(new_shape) if d != 1]
    for i, d in enumerate(new_shape):
        if d == 1:
            new_strides[i] = 0
    while oi < len(old) and ni < len(non1):
        # grow a chunk of old dims and a chunk of new dims with equal products
        o_start = oi
        o_prod = old[oi][0]
        oi += 1
        n_idx = [non1[ni]]
        n_prod = new_shape[non1[ni]]
        ni += 1
        while o_prod != n_prod:
            if o_prod < n_prod:
                if oi >= len(old):
                    return None
                o_prod *= old[oi][0]
                oi += 1
            else:
                if ni >= len(non1):
                    return None
                n_idx.append(non1[ni])
                n_prod *= new_shape[non1[ni]]
                ni += 1
        chunk = old[o_start:oi]
        for k in range(len(chunk) - 1):  # the old chunk must be contiguous in itself
            if chunk[k][1] != chunk[k + 1][1] * chunk[k + 1][0]:
                return None
        base = chunk[-1][1]
        acc = base
        for idx in reversed(n_idx):
            new_strides[idx] = acc
            acc *= new_shape[idx]
    if oi != len(old) or ni != len(non1):
        return None
    return tuple(new_strides)


def _compose_aligned(inner: ViewSpec, outer: ViewSpec) -> Optional[ViewSpec]:
    """Outer dims that each step along a single inner dim (permute, slice, expand of a view)."""
    cs = contiguous_strides(inner.shape)
    # unravel the outer offset into an inner multi-index
    rem = outer.offset
    if rem < 0:
        return None
    base = []
    for c in cs:
        base.append(rem // c)
        rem %= c
    if any(b >= d for b, d in zip(base, inner.shape)) and any(d > 0 for d in inner.shape):
        return None
    use: dict[int, list[tuple[int, int]]] = {}
    strides: list[int] = []
    for k, (n, t) in enumerate(zip(outer.shape, outer.strides)):
        if n == 1 or t == 0:
            strides.append(0)
            continue
        if t < 0:
            return None
        m = next((m for m, c in enumerate(cs) if inner.shape[m] > 1 and t % c == 0 and t // c < inner.shape[m]), None)
        if m is None:
            return None
        q = t // cs[m]
        use.setdefault(m, []).append((k, q))
        strides.append(q * inner.strides[m])
    for m, ks in use.items():
        reach = base[m] + sum(q * (outer.shape[k] - 1) for k, q in ks)
        if reach >= inner.shape[m]:
            return None
    offset = inner.offset + sum(b * s for b, s in zip(base, inner.strides))
    mask = None if outer.mask is None else list(outer.mask)
    if inner.mask is not None:
        mask = list(mask or [(0, n) for n in outer.shape])
        for m, (lo, hi) in enumerate(inner.mask):
            if lo <= 0 and hi >= inner.shape[m]:
                continue
            ks = use.get(m, [])
            if len(ks) != 1:
                if not ks and lo <= base[m] < hi:
                    continue
                return None
            k, q = ks[0]
            # valid iff lo <= base + q*i < hi
            klo = max(0, -(-(lo - base[m]) // q))
            khi = min(outer.shape[k], -(-(hi - base[m]) // q))
            olo, ohi = mask[k]
            mask[k] = (max(olo, klo), max(max(olo, klo), min(ohi, khi)))
    return ViewSpec(outer.shape, tuple(strides), offset, None if mask is None else tuple(mask))
