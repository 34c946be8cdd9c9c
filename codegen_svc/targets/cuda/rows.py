"""Row kernels on the device: the row loop nest of targets/cpu/rows.py, one thread per row.
"""

from __future__ import annotations



from codegen_svc.targets.cpu.rows import RowKernel as LoopBody


class RowKernel(LoopBody):
    pass
