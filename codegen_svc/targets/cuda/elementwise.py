"""Elementwise kernels on the device: the loop nest of targets/cpu/elementwise.py, one thread per
output element (CudaKernel.loops gives each thread its index).
"""

from __future__ import annotations



from codegen_svc.targets.cpu.elementwise import ElementwiseKernel as LoopBody


class ElementwiseKernel(LoopBody):
    pass
