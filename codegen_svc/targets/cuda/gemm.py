"""GEMMs on the device: a TILE x TILE block of threads per tile of C, A's and B's tiles staged in shared
memory; an epilogue that reads C only at its own element runs on the accumulator.
"""

from __future__ import annotations



from kiln.ir.kernel import flat_preserving, gemm_axes, gemm_dims, kernel_gemm
from kiln.ir.ops import Op
from kiln.ir.shape import numel
from codegen_svc.loopnest import code_at, code_dim
from codegen_svc.targets.cuda.launch import Launch


class GemmKernel:
    def _mul_index(self, F, k_axis, groups: dict, t: str, use: tuple[str, ...]):
        """An index of a GEMM's Mul (shape F): group g's axes from its linear index when g is in
        `use` (else 0: the operand broadcasts along it), the reduced axis at t."""
        idx = []
        for j in range(len(F)):
            if j == k_axis:
                idx.append(t)
                continue
            for name, parts in groups.items():
                if j in parts:
                    idx.append(parts[j] if name in use else "0")
                    break
            else:
                idx.append("0")
        return tuple(idx)

    def _groups(self, F, gm, b: str, m: str, n: str) -> dict:
        def unravel(var, axes):
            return dict(zip(axes, self.unravel(var, tuple(F[j] for j in axes)))) if axes else {}
        return {"b": unravel(b, gm.batch_axes), "m": unravel(m, gm.m_axes), "n": unravel(n, gm.n_axes)}

    def _reads_only_at_own_element(self, gi: int) -> bool:
        """Whether the epilogue reads C only at the output element's own flat position (every
        view on the way from C to the output is a reshape), so the thread that computes C's
        element can finish the output element too."""
        g = self.g
        if numel(g.nodes[self.k.output].shape) != numel(g.nodes[gi].shape):
            return False
        inside = set(self.k.nodes) | {self.k.output}
        after: set[int] = {gi}  # nodes whose value depends on C
        for q in sorted(inside):
            n = g.nodes[q]
            if q == gi or not any(x in after for x in n.inputs):
                continue
            after.add(q)
            if n.op is Op.VIEW and not flat_preserving(n.view, g.nodes[n.inputs[0]].shape):
                return False
        return True

    def emit_gemm_cuda(self) -> None:
        g, k = self.g, self.k
        gi = kernel_gemm(g, k)
        r = g.nodes[gi]
        gm = gemm_axes(g, gi)
        F, Bt, Mt, Nt, K = gemm_dims(g, gi)
        T, ka = self.tile, r.axis
        zero = self.const(0.0, r.dtype)
        groups = self._groups(F, gm, "bi", "m", "n")
        lines = ["    tx = cuda.threadIdx.x", "    ty = cuda.threadIdx.y",
                 f"    n = cuda.blockIdx.x * {T} + tx", f"    m = cuda.blockIdx.y * {T} + ty",
                 "    bi = cuda.blockIdx.z",
                 f"    As = cuda.shared.array(({T}, {T}), dtype=numba.float32)",
                 f"    Bs = cuda.shared.array(({T}, {T}), dtype=numba.float32)",
                 f"    acc = {zero}",
                 f"    for k0 in range(0, {code_dim(K)}, {T}):",
                 "        ta = k0 + tx",
                 "        tb = k0 + ty",
                 f"        if m < {code_dim(Mt)} and ta < {code_dim(K)}:"]
        lines += self.statement(" " * 12, lambda: "As[ty, tx] = " + self.value(
            gm.a_node, self._mul_index(F, ka, groups, "ta", ("b", "m"))))
        lines += ["        else:", f"            As[ty, tx] = {zero}", f"        if n < {code_dim(Nt)} and tb < {code_dim(K)}:"]
        lines += self.statement(" " * 12, lambda: "Bs[ty, tx] = " + self.value(
            gm.b_node, self._mul_index(F, ka, groups, "tb", ("b", "n"))))
        lines += ["        else:", f"            Bs[ty, tx] = {zero}",
                  "        cuda.syncthreads()",
                  f"        for kk in range({T}):",
                  "            acc += As[ty, kk] * Bs[kk, tx]",
                  "        cuda.syncthreads()",
                  f"    if m < {code_dim(Mt)} and n < {code_dim(Nt)}:"]
        grid = f"(({code_dim(Nt)} + {T - 1}) // {T}, ({code_dim(Mt)} + {T - 1}) // {T}, {code_dim(Bt)})"
        out = g.nodes[k.output]
        if self._reads_only_at_own_element(gi):
            gidx = self._mul_index(F, ka, groups, "0", ("b", "m", "n"))  # the GEMM node's index (axis k is 1)
            self.row_values[gi] = "acc"
            if tuple(out.shape) == tuple(r.shape):
                oidx = gidx
            else:  # a reshaped output: the same flat position
                lines.append("        f = " + self.flat(r.shape, gidx))
                oidx = tuple(self.unravel("f", out.shape))
            lines += self.statement(" " * 8, lambda: code_at("out", self.flat(out.shape, oidx)) + " = "
                                    f"{self.store(out.dtype, self.value(k.output, oidx))}")
            self.launches.append(Launch("d0", self.device_params(), lines, grid, f"({T}, {T})",
                                         guard=f"{code_dim(numel(out.shape))} > 0"))
            return
        # an epilogue that reads C elsewhere than at its own element: C first, then the epilogue
        lines.append("        C[bi, m, n] = acc")
        params = ["C"] + self.device_params()[1:]
        self.prologue.append(f"    C = cuda.device_array(({code_dim(Bt)}, {code_dim(Mt)}, {code_dim(Nt)}), dtype=np.float32)")
        self.launches.append(Launch("d0", params, lines, grid, f"({T}, {T})", guard=f"{code_dim(numel(r.shape))} > 0"))
        self.gemm_value = (gi, F, list(gm.batch_axes), list(gm.m_axes), list(gm.n_axes), "C[{b}, {m}, {n}]")
        body, idx, depth = self.loops(out.shape)
        body += self.statement("    " * depth, lambda: code_at("out", self.flat(out.shape, idx)) + " = "
                               f"{self.store(out.dtype, self.value(k.output, tuple(idx)))}")
        self.gemm_value = None
        self.one_per_thread(body, self.device_params() + ["C"])
