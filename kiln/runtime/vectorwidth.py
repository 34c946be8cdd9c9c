"""Per-kernel SIMD vector widths for numba-compiled kernels.

numba gives no per-function control of the vector width: LLVM's loop vectorizer takes it from
the target (on x86 with AVX-512, LLVM prefers 256-bit vectors unless told otherwise). LLVM does
read a function attribute, "prefer-vector-width"="N", that sets the widest vector the
vectorizer uses in that function. A kernel emitted with a width names
`pipeline_class=pipeline(N)`: its lowering pass marks every function lowered while it runs
(the kernel itself and the parallel gufuncs numba outlines from its prange loops, which are
compiled inside that lowering) with the attribute, through one wrapper around numba's CPU
target post-lowering hook, installed on first use. Functions compiled outside such a lowering
are untouched. The choice is a schedule the search offers and times (rules/schedules.py).
"""

from __future__ import annotations

import threading
from functools import lru_cache

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


@lru_cache(maxsize=None)
def pipeline(width: int):
    """A numba compiler pipeline (njit's `pipeline_class`) whose lowering marks what it lowers
    with the vector width `width` (bits)."""
    if width not in WIDTHS:
        raise ValueError(f"vector width must be one of {WIDTHS} bits, not {width}")
    _install()
    from numba.core.compiler import CompilerBase, DefaultPassBuilder
    from numba.core.compiler_machinery import register_pass
    from numba.core.typed_passes import NativeLowering, NativeParforLowering

    def marked(base):
        def run_pass(self, state):
            outer = getattr(_state, "width", 0)
            _state.width = width
            try:
                return base.run_pass(self, state)
            finally:
                _state.width = outer

        cls = type(f"{base.__name__}Width{width}", (base,), {"_name": f"{base._name}_width{width}",
                                                            "run_pass": run_pass})
        return register_pass(mutates_CFG=True, analysis_only=False)(cls)

    lowering = {NativeLowering: marked(NativeLowering), NativeParforLowering: marked(NativeParforLowering)}

    class Pipeline(CompilerBase):
        def define_pipelines(self):
            pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
            pm.passes = [(lowering.get(p, p), desc) for p, desc in pm.passes]
            pm.finalize()
            return [pm]

    Pipeline.__name__ = Pipeline.__qualname__ = f"VectorWidth{width}Pipeline"
    return Pipeline
