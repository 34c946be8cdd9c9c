"""Per-kernel SIMD vector widths for numba-compiled kernels.

numba gives no per-function control of the vector width: LLVM's loop vectorizer takes it from
the target (on x86 with AVX-512, LLVM prefers 256-bit vectors unless told otherwise). LLVM does
read a function attribute, "prefer-vector-width"="N", that sets the widest vector the
vectorizer uses in that function. A kernel emitted with a width names
`pipeline_class=kernel_pipeline(N)` (kiln.runtime.pipeline): its lowering pass marks (`marking`)
every function lowered while it runs
(the kernel itself and the parallel gufuncs numba outlines from its prange loops, which are
compiled inside that lowering) with the attribute, through one wrapper around numba's CPU
target post-lowering hook, installed on first use. Functions compiled outside such a lowering
are untouched. The choice is a schedule the search offers and times (rules/schedules.py).
"""

from __future__ import annotations

import contextlib
import threading

from kiln.ir.graph import VECTOR_WIDTHS as WIDTHS  # bits; 0 (no attribute): LLVM's own choice for the target

_state = threading.local()
_install_lock = threading.Lock()
_installed = False


def host_widths() -> tuple[int, ...]:
    """The vector widths this machine's CPU has (bits): 128 always (SSE2 / NEON), 256 with AVX2,
    512 with AVX-512F."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    widths = [128]
    if features.get("avx2"):
        widths.append(256)
    if features.get("avx512f"):
        widths.append(512)
    return tuple(widths)


def _attributes_with(attrs, width: int):
    """A copy of an llvmlite FunctionAttributes that also prints the string attribute
    "prefer-vector-width"="width" (llvmlite.ir knows only LLVM's enum attributes)."""
    base = type(attrs)

    class WithWidth(base):
        def __bool__(self):
            return True  # printed even when the enum attributes are empty

        def _to_list(self, typ):
            # enum attributes, then this one, then alignstack / personality (which take operands)
            full, enum = super()._to_list(typ), len(self)
            return full[:enum] + [f'"prefer-vector-width"="{width}"'] + full[enum:]

    out = WithWidth()
    for name in attrs:
        set.add(out, name)
    out.alignstack, out.personality = attrs.alignstack, attrs.personality
    return out


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        from numba.core import cpu

        original = cpu.CPUContext.post_lowering

        def post_lowering(self, mod, library):
            width = getattr(_state, "width", 0)
            if width:
                for fn in mod.functions:
                    if not fn.is_declaration:
                        fn.attributes = _attributes_with(fn.attributes, width)
            return original(self, mod, library)

        cpu.CPUContext.post_lowering = post_lowering
        _installed = True


def check_width(width: int) -> None:
    if width and width not in WIDTHS:
        raise ValueError(f"vector width must be one of {WIDTHS} bits, not {width}")


@contextlib.contextmanager
def marking(width: int):
    """While it is open (a kernel's lowering, see kiln.runtime.pipeline), every function lowered is
    marked with the vector width `width` (bits; 0: none, LLVM's own choice)."""
    check_width(width)
    if width:
        _install()
    outer = getattr(_state, "width", 0)
    _state.width = width
    try:
        yield
    finally:
        _state.width = outer
