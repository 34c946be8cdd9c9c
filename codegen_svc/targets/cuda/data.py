"""Gather and scatter on the device: a gather is the CPU's loop nest, one thread per output element;
a scatter is one block, the copy then the scatter as block-stride loops with a barrier between.
"""

from __future__ import annotations



from codegen_svc.loopnest import code_at
from codegen_svc.targets.cpu.data import DataKernel as LoopBody
from codegen_svc.targets.cuda.launch import Launch


class DataKernel(LoopBody):
    def emit_scatter_cuda(self) -> None:
        """One block: copy the destination, barrier, then write the source at its indices."""
        n = self.g.nodes[self.k.output]
        dst, index, src = n.inputs
        lines, idx, pad = self.block_loops(n.shape, "    ")
        lines += self.statement(pad, lambda: code_at("out", self.flat(n.shape, idx)) + " = "
                                f"{self.store(n.dtype, self.value(dst, tuple(idx)))}")
        lines.append("    cuda.syncthreads()")
        loops, sidx, pad = self.block_loops(self.g.nodes[index].shape, "    ")
        lines += loops
        lines += self.statement(pad, lambda: f"j = np.int64({self.value(index, tuple(sidx))})")
        lines += self.checked_index(pad, n.shape[n.axis], "Scatter")
        oidx = list(sidx)
        oidx[n.axis] = "j"
        lines += self.statement(pad, lambda: code_at("out", self.flat(n.shape, oidx)) + " = "
                                f"{self.store(n.dtype, self.value(src, tuple(sidx)))}")
        self.launches.append(Launch("d0", self.device_params(), lines, "1", str(self.block)))
