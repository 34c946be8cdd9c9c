"""The numba compiler pipeline of kiln's CPU kernels: numba's own, with the lowering passes run
under the kernel's vector width (kiln.runtime.vectorwidth), with parallel loops' wrapper
libraries linked once (kiln.runtime.linkonce) and with loops unrolled within O2's budget
(kiln.runtime.unroll). Every kernel the cpu target emits names it:
`pipeline_class=kernel_pipeline(width)`.
"""

from __future__ import annotations

from functools import lru_cache

from kiln.runtime.linkonce import linking_once
from kiln.runtime.unroll import capped
from kiln.runtime.vectorwidth import check_width, marking


@lru_cache(maxsize=None)
def kernel_pipeline(width: int = 0):
    """A numba pipeline class (njit's `pipeline_class`) whose lowering marks what it lowers with
    the vector width `width` (bits; 0: LLVM's own), links parallel loops' wrappers once and
    unrolls within O2's budget."""
    check_width(width)  # refused here, when the kernel's module is imported, not at its first call
    from numba.core.compiler import CompilerBase, DefaultPassBuilder
    from numba.core.compiler_machinery import register_pass
    from numba.core.typed_passes import NativeLowering, NativeParforLowering

    def marked(base):
        def run_pass(self, state):
            with marking(width), linking_once(), capped():
                return base.run_pass(self, state)

        cls = type(f"{base.__name__}Kernel{width}", (base,), {"_name": f"{base._name}_kernel{width}",
                                                             "run_pass": run_pass})
        return register_pass(mutates_CFG=True, analysis_only=False)(cls)

    lowering = {NativeLowering: marked(NativeLowering), NativeParforLowering: marked(NativeParforLowering)}

    class Pipeline(CompilerBase):
        def define_pipelines(self):
            pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
            pm.passes = [(lowering.get(p, p), desc) for p, desc in pm.passes]
            pm.finalize()
            return [pm]

    Pipeline.__name__ = Pipeline.__qualname__ = f"KernelPipeline{width}"
    return Pipeline
