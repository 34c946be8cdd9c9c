"""Elementwise kernels on the CPU: one loop nest over the output, its first loop on the pool when parallel.
"""

from __future__ import annotations



from codegen_svc.loopnest import code_at


class ElementwiseKernel:
    def emit_elementwise(self):
        n = self.g.nodes[self.k.output]
        lines, idx, depth = self.loops(n.shape, parallel=self.k.parallel)
        lines += self.statement("    " * depth, lambda: code_at("out", self.flat(n.shape, idx)) + " = "
                                f"{self.store(n.dtype, self.value(self.k.output, tuple(idx)))}")
        return lines
