"""Reductions on the CPU: one accumulator per output element, or the reduced axis outermost where
the search chose that loop order.
"""

from __future__ import annotations

import math


from kiln.ir.ops import Op
from kiln.ir.shape import numel
from codegen_svc.loopnest import COMPUTE_TYPE, code_at, code_dim


class ReduceKernel:
    def reduction(self, pad: str, q: int, idx, acc: str) -> list[str]:
        """Reduce node q along its axis into the local `acc`, at the outer index idx."""
        r = self.g.nodes[q]
        src = r.inputs[0]
        is_max = r.op is Op.MAX_REDUCE
        init = (self.const(-math.inf, r.dtype) if r.dtype.is_float else str(-(1 << 62))) if is_max \
            else self.const(0.0, r.dtype)
        ridx = list(idx)
        ridx[r.axis] = "ra"
        nan = is_max and r.dtype.is_float
        lines = [pad + f"{acc} = {init}"] + ([pad + f"{acc}n = False"] if nan else [])
        lines.append(pad + f"for ra in range({code_dim(self.g.nodes[src].shape[r.axis])}):")
        lines += self.statement(pad + "    ", lambda: f"v = {self.value(src, tuple(ridx))}")
        if src in self.row_store:
            lines.append(pad + f"    {self.row_store[src]}[np.uint64(ra)] = v")
            self.row_cache[src] = (self.row_store.pop(src), tuple(ridx))
        if is_max:
            # branch-free, so the loop vectorizes: a select for the max and a flag for NaN,
            # which is sticky as in torch.max
            lines.append(pad + f"    {acc} = v if v > {acc} else {acc}")
            if nan:
                lines += [pad + f"    {acc}n = {acc}n | (v != v)",
                          pad + f"if {acc}n:", pad + f"    {acc} = {self.const(math.nan, r.dtype)}"]
        else:
            lines.append(pad + f"    {acc} += v")
        return lines

    def emit_reduce(self):
        n = self.g.nodes[self.k.output]
        if self.k.order == "axis-outer":
            return self.emit_reduce_axis_outer()
        lines, idx, depth = self.loops(n.shape, skip_axis=n.axis, parallel=self.k.parallel,
                                       collapse=self.k.collapse)
        pad = "    " * depth
        lines += self.reduction(pad, self.k.output, idx, "acc")
        oidx = list(idx)
        oidx[n.axis] = "0"
        lines.append(pad + code_at("out", self.flat(n.shape, oidx)) + f" = {self.store(n.dtype, 'acc')}")
        return lines

    def emit_reduce_axis_outer(self):
        """The reduction with its axis looped outside the axes after it (the search's loop order,
        Kernel.order): per index of the axes before it, a row of accumulators over the axes
        after it, updated as the input is read in memory order, then stored."""
        n = self.g.nodes[self.k.output]
        a, src = n.axis, n.inputs[0]
        is_max = n.op is Op.MAX_REDUCE
        nan = is_max and n.dtype.is_float
        init = (self.const(-math.inf, n.dtype) if n.dtype.is_float else str(-(1 << 62))) if is_max \
            else self.const(0.0, n.dtype)
        inner_shape = tuple(n.shape[a + 1:])
        outer = tuple(d if j < a else 1 for j, d in enumerate(n.shape))
        lines, idx, depth = self.loops(outer, parallel=self.k.parallel, collapse=self.k.collapse)
        pad = "    " * depth
        size = code_dim(numel(inner_shape))
        lines += [pad + f"acc = np.empty({size}, dtype={COMPUTE_TYPE[n.dtype]})",
                  pad + f"for ja in range({size}):", pad + f"    acc[ja] = {init}"]
        if nan:
            lines.append(pad + f"accn = np.zeros({size}, dtype=np.bool_)")

        def inner_loops(pad0: str, axis_index: str):
            out, ix, p = [], list(idx[:a]) + [axis_index], pad0
            for j, d in enumerate(inner_shape):
                if d == 1:
                    ix.append("0")
                    continue
                out.append(p + f"for i{a + 1 + j} in range({code_dim(d)}):")
                ix.append(f"i{a + 1 + j}")
                p += "    "
            return out, ix, p

        lines.append(pad + f"for ra in range({code_dim(self.g.nodes[src].shape[a])}):")
        loops, ridx, p = inner_loops(pad + "    ", "ra")
        lines += loops
        f = self.flat(inner_shape, ridx[a + 1:])
        acc, accn = code_at("acc", f), code_at("accn", f)
        lines += self.statement(p, lambda: f"v = {self.value(src, tuple(ridx))}")
        if is_max:
            lines.append(p + f"{acc} = v if v > {acc} else {acc}")
            if nan:
                lines.append(p + f"{accn} = {accn} | (v != v)")
        else:
            lines.append(p + f"{acc} += v")
        loops, oidx, p = inner_loops(pad, "0")
        lines += loops
        if nan:
            lines += [p + f"if {accn}:", p + f"    {acc} = {self.const(math.nan, n.dtype)}"]
        lines.append(p + code_at("out", self.flat(n.shape, oidx)) + f" = {self.store(n.dtype, acc)}")
        return lines
