"""Gather and scatter on the CPU: data-dependent indices, checked against their axis.
"""

from __future__ import annotations



from codegen_svc.loopnest import code_at


class DataKernel:
    def emit_gather(self):
        n = self.g.nodes[self.k.output]
        src, index = n.inputs
        src_shape = self.g.nodes[src].shape
        lines, idx, depth = self.loops(n.shape)
        pad = "    " * depth
        lines += self.statement(pad, lambda: f"j = np.int64({self.value(index, tuple(idx))})")
        lines += self.checked_index(pad, src_shape[n.axis], "Gather")
        sidx = list(idx)
        sidx[n.axis] = "j"
        lines += self.statement(pad, lambda: code_at("out", self.flat(n.shape, idx)) + " = "
                                f"{self.store(n.dtype, self.value(src, tuple(sidx)))}")
        return lines

    def emit_scatter(self):
        n = self.g.nodes[self.k.output]
        dst, index, src = n.inputs
        lines, idx, depth = self.loops(n.shape)
        lines += self.statement("    " * depth, lambda: code_at("out", self.flat(n.shape, idx)) + " = "
                                f"{self.store(n.dtype, self.value(dst, tuple(idx)))}")
        src_shape = self.g.nodes[index].shape
        loops, sidx, d2 = self.loops(src_shape)
        lines += loops
        pad = "    " * d2
        lines += self.statement(pad, lambda: f"j = np.int64({self.value(index, tuple(sidx))})")
        lines += self.checked_index(pad, n.shape[n.axis], "Scatter")
        oidx = list(sidx)
        oidx[n.axis] = "j"
        lines += self.statement(pad, lambda: code_at("out", self.flat(n.shape, oidx)) + " = "
                                f"{self.store(n.dtype, self.value(src, tuple(sidx)))}")
        return lines
