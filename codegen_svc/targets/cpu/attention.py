"""Fused attention on the CPU: per tile of query rows, the scores by BLAS, the softmax as a row
kernel over the tile and P·V by BLAS, with no score matrix in memory.
"""

from __future__ import annotations



from kiln.ir.graph import DEFAULT_ATTENTION_TILE
from kiln.ir.kernel import gemm_axes, gemm_dims
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import numel
from codegen_svc.loopnest import COMPUTE_TYPE, ROUND_FN, code_dim
from codegen_svc.targets.cpu.rows import fits_in_cache


class AttentionKernel:
    def emit_attention(self):
        """Q·Kᵀ, a row kernel along the keys (softmax), then P·V, a tile of query rows at a time:
        per tile, the scores by BLAS into a local [tile, keys] array; per row, the row kernel's
        reductions and probabilities (reading the scores through the first GEMM's epilogue)
        into a second local array; then the tile's output rows by BLAS. The partition
        guarantees row r of a tile is the row kernel's row bi·M + m0 + r, that the scores are
        read at their own flat positions, and that P is the second GEMM's [batch, M, K] operand."""
        g, k = self.g, self.k
        gs, gp = k.scores, k.output
        sa, pa = gemm_axes(g, gs), gemm_axes(g, gp)
        Fs, Bt, Mt, Ns, Ks = gemm_dims(g, gs)
        Fp, _, _, Np, Kp = gemm_dims(g, gp)
        p = pa.a_root
        S = g.nodes[p].shape
        a = k.axis
        T = k.tile or DEFAULT_ATTENTION_TILE  # the search's tile (Kernel.tile), else the default
        ks, kp = g.nodes[gs].axis, g.nodes[gp].axis
        q_args = (sa.a_node, sa.a_root, sa.a_spec, list(sa.batch_axes), list(sa.m_axes), ks, Fs, Bt, Mt, Ks,
                  g.nodes[gs].dtype)
        lq, q_at, q_rows = self._operand("Q", "A", *q_args)
        if not q_rows:  # a block of rows of a transposed operand is no matrix BLAS takes: pack it
            lq, q_at, _ = self._operand("Q", "A", *q_args[:2], None, *q_args[3:])
        lk, k_at, _ = self._operand("K", "B", sa.b_node, sa.b_root, sa.b_spec, list(sa.batch_axes),
                                    list(sa.n_axes), ks, Fs, Bt, Ns, Ks, g.nodes[gs].dtype)
        lv, v_at, _ = self._operand("V", "B", pa.b_node, pa.b_root, pa.b_spec, list(pa.batch_axes),
                                    list(pa.n_axes), kp, Fp, Bt, Np, Kp, g.nodes[gp].dtype)
        out_dtype = g.nodes[gp].dtype
        lines = lq + lk + lv
        if not out_dtype.is_half:
            lines.append(f"    O = out[0:{code_dim(numel(g.nodes[gp].shape))}].reshape(({code_dim(Bt)}, {code_dim(Mt)}, {code_dim(Np)}))")
        rng = "prange" if k.parallel else "range"
        lines += [f"    nt = ({code_dim(Mt)} + {T - 1}) // {T}",
                  f"    for t in {rng}({code_dim(Bt)} * nt):",
                  "        bi = t // nt",
                  f"        m0 = (t % nt) * {T}",
                  f"        m1 = min(m0 + {T}, {code_dim(Mt)})",
                  f"        st = np.empty(({T}, {code_dim(Ns)}), dtype=np.float32)"]
        # a sum's input the row's later loops read again (a softmax's exponentials) is kept per
        # column while the sum is taken: one exp2 per score instead of two
        reductions = [q for q in k.nodes if q not in (gs, gp) and g.nodes[q].op in GroupOp.Reduce]
        if fits_in_cache(S[a]):
            for q in reductions:
                src = g.nodes[q].inputs[0]
                n = g.nodes[src]
                if (g.nodes[q].op is Op.SUM_REDUCE and n.op is Op.EXP2 and src in self.shared
                        and src not in self.reads and tuple(n.shape) == tuple(S)):
                    self.row_store[src] = self.local("e", src)
                    lines.append(f"        {self.row_store[src]} = np.empty({code_dim(Ns)}, dtype={COMPUTE_TYPE[n.dtype]})")
        lines += [
                  f"        np.dot({q_at.format(bi='bi')}[m0:m1], {k_at.format(bi='bi')}, st[0:m1 - m0])",
                  "        for r in range(m1 - m0):",
                  f"            rho = bi * {code_dim(Mt)} + m0 + r"]
        pad = " " * 12
        # the row kernel's index from its row number (its axis is the innermost one that is not 1)
        row_lines, idx = self.index_of("rho", tuple(1 if j == a else d for j, d in enumerate(S)), a, pad)
        lines += row_lines
        # the scores are read only at the row's own elements (the partition checks it): the first
        # GEMM's value is the tile's row r at the loop's column (kept in f32, as in an epilogue)
        self.gemm_value = (gs, Fs, list(sa.batch_axes), list(sa.m_axes), list(sa.n_axes), "st[r, np.uint64({col})]")
        self.row_col = "ra"
        lines += self.row_reductions(pad, tuple(idx), reductions)
        oidx = list(idx)
        oidx[a] = "ia"
        lines.append(pad + f"for ia in range({code_dim(S[a])}):")
        # P is rounded as the second GEMM would have read it from its buffer
        rnd = (lambda v: f"{ROUND_FN[g.nodes[p].dtype]}({v})") if g.nodes[p].dtype.is_half else (lambda v: v)
        self.row_col = "ia"
        # P overwrites the scores in place: P's element ia reads the scores only at column ia
        # (and the row's reductions, taken before), so no second tile is allocated
        lines += self.statement(pad + "    ", lambda: f"st[r, np.uint64(ia)] = {rnd(self.value(p, tuple(oidx)))}")
        self.gemm_value = self.row_col = None
        if not out_dtype.is_half:
            lines.append(f"        np.dot(st[0:m1 - m0], {v_at.format(bi='bi')}, O[bi, m0:m1])")
            return lines
        lines += [f"        ot = np.empty(({T}, {code_dim(Np)}), dtype=np.float32)",
                  f"        np.dot(st[0:m1 - m0], {v_at.format(bi='bi')}, ot[0:m1 - m0])",
                  "        for r in range(m1 - m0):",
                  f"            base = (bi * {code_dim(Mt)} + m0 + r) * {code_dim(Np)}",
                  f"            for c in range({code_dim(Np)}):",
                  f"                out[np.uint64(base + c)] = {self.store(out_dtype, 'ot[r, c]')}"]
        return lines
