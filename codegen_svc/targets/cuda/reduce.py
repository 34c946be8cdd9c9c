"""Reductions on the device: one thread per output element, looping over the reduced axis (the CPU's
loop orders are cache choices that a thread per output does not need).
"""

from __future__ import annotations



from codegen_svc.loopnest import code_at
from codegen_svc.targets.cpu.reduce import ReduceKernel as LoopBody


class ReduceKernel(LoopBody):
    def emit_reduce_plain(self) -> list[str]:
        n = self.g.nodes[self.k.output]
        lines, idx, depth = self.loops(n.shape, skip_axis=n.axis)
        pad = "    " * depth
        lines += self.reduction(pad, self.k.output, idx, "acc")
        oidx = list(idx)
        oidx[n.axis] = "0"
        lines.append(pad + code_at("out", self.flat(n.shape, oidx)) + f" = {self.store(n.dtype, 'acc')}")
        return lines
