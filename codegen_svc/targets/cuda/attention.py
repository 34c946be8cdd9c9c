"""Fused attention on the device: a block of query rows, one thread each, walking the keys in tiles
of K and then of V staged in shared memory.
"""

from __future__ import annotations



from kiln.core.errors import FailedPrecondition
from kiln.ir.kernel import gemm_axes, gemm_dims
from kiln.ir.ops import GroupOp
from kiln.ir.shape import evaluate_dim
from codegen_svc.loopnest import code_dim, dim_symbols
from codegen_svc.targets.cuda.launch import ATTENTION_KEYS, MAX_LOCAL_KEYS, SHARED_BYTES, Launch


class AttentionKernel:
    def _attention_parts(self):
        g, k = self.g, self.k
        gs, gp = k.scores, k.output
        sa, pa = gemm_axes(g, gs), gemm_axes(g, gp)
        Fs, Bt, Mt, Ns, Ks = gemm_dims(g, gs)
        Fp, _, _, Np, Kp = gemm_dims(g, gp)
        largest = {name: hi for name, _, hi in g.symbols}
        keys = evaluate_dim(Ns, largest)
        if keys > MAX_LOCAL_KEYS:
            raise FailedPrecondition(f"attention over up to {keys} keys: the cuda target keeps at most "
                                     f"{MAX_LOCAL_KEYS} per query row")
        return gs, gp, sa, pa, Fs, Fp, Bt, Mt, Ns, Ks, Np, Kp, keys

    def _probabilities(self, pad: str, rows_var: str, sa, pa, gs, Fs) -> list[str]:
        """The row kernel over this thread's scores `st`: its reductions, then each probability
        into `pt` (the row's index from its row number `rows_var`)."""
        g, k = self.g, self.k
        p, a = pa.a_root, k.axis
        S = g.nodes[p].shape
        lines, idx = self.index_of(rows_var, tuple(1 if j == a else d for j, d in enumerate(S)), a, pad)
        self.gemm_value = (gs, Fs, list(sa.batch_axes), list(sa.m_axes), list(sa.n_axes), "st[np.uint64({col})]")
        self.row_col = "ra"
        lines += self.row_reductions(pad, tuple(idx), [q for q in k.nodes if q not in (gs, k.output)
                                                       and g.nodes[q].op in GroupOp.Reduce])
        oidx = list(idx)
        oidx[a] = "ia"
        lines.append(pad + f"for ia in range({code_dim(S[a])}):")
        self.row_col = "ia"
        lines += self.statement(pad + "    ", lambda: f"pt[ia] = {self.value(p, tuple(oidx))}")
        self.gemm_value = self.row_col = None
        return lines

    def _stage(self, buf: str, width: int, keys, key: str, col: str, threads: int, load) -> list[str]:
        """Inside the loop over key tiles (from k0): the block's threads copy keys k0.. (each a row
        of `width` values, `load()` the value at key `key`, column `col`) into the shared `buf`."""
        lines = [f"        for e in range(tq, {ATTENTION_KEYS * width}, {threads}):",
                 f"            {key} = k0 + e // {width}",
                 f"            {col} = e % {width}",
                 f"            if {key} < {code_dim(keys)}:"]
        lines += self.statement(" " * 16, lambda: f"{buf}[e // {width}, {col}] = " + load())
        return lines + ["        cuda.syncthreads()"]

    def emit_attention_cuda(self) -> None:
        """Flash-attention's staging without its online rescaling (the row kernel between the two
        GEMMs is whatever the search fused: scale, mask, softmax): a block of `tile` query rows,
        one thread each, walks the keys in tiles of ATTENTION_KEYS staged in shared memory, first
        K's (each thread's scores into a local row), then, after the row kernel, V's (each thread's
        row of P·V in local accumulators). Head dims that are symbolic or too large for shared
        memory take one thread per row without staging."""
        gs, gp, sa, pa, Fs, Fp, Bt, Mt, Ns, Ks, Np, Kp, keys = self._attention_parts()
        if dim_symbols([Ks, Np]) or ATTENTION_KEYS * (evaluate_dim(Ks, {}) + evaluate_dim(Np, {})) * 4 > SHARED_BYTES:
            return self.emit_attention_rows()
        g = self.g
        ks_n, np_n = evaluate_dim(Ks, {}), evaluate_dim(Np, {})
        # query rows per block: the search's attention tile (Node.schedule /tile=) when it chose
        # one, else the launch shape's tile
        TQ, TK = self.k.tile or self.tile, ATTENTION_KEYS
        zero = self.const(0.0, g.nodes[gs].dtype)
        q_groups = self._groups(Fs, sa, "bi", "mq", "0")
        k_groups = self._groups(Fs, sa, "bi", "0", "kj")
        v_groups = self._groups(Fp, pa, "bi", "0", "vc")
        kss, kp = g.nodes[gs].axis, g.nodes[gp].axis
        lines = ["    tq = cuda.threadIdx.x", "    bi = cuda.blockIdx.y", f"    mq = cuda.blockIdx.x * {TQ} + tq",
                 f"    live = mq < {code_dim(Mt)}", f"    rho = bi * {code_dim(Mt)} + mq",
                 f"    Ksh = cuda.shared.array(({TK}, {ks_n}), dtype=numba.float32)",
                 f"    Vsh = cuda.shared.array(({TK}, {np_n}), dtype=numba.float32)",
                 f"    qr = cuda.local.array({ks_n}, numba.float32)",
                 f"    st = cuda.local.array({max(keys, 1)}, numba.float32)",
                 f"    pt = cuda.local.array({max(keys, 1)}, numba.float32)",
                 f"    acc = cuda.local.array({np_n}, numba.float32)",
                 "    if live:", f"        for t in range({ks_n}):"]
        lines += self.statement(" " * 12, lambda: "qr[t] = " + self.value(
            sa.a_node, self._mul_index(Fs, kss, q_groups, "t", ("b", "m"))))
        lines += [f"    for k0 in range(0, {code_dim(Ns)}, {TK}):"]
        lines += self._stage("Ksh", ks_n, Ns, "kj", "kt", TQ, lambda: self.value(
            sa.b_node, self._mul_index(Fs, kss, k_groups, "kt", ("b", "n"))))
        lines += ["        if live:",
                  f"            for j in range(min({TK}, {code_dim(Ns)} - k0)):",
                  f"                s = {zero}",
                  f"                for t in range({ks_n}):",
                  "                    s += qr[t] * Ksh[j, t]",
                  "                st[k0 + j] = s",
                  "        cuda.syncthreads()",
                  "    if live:"]
        lines += self._probabilities(" " * 8, "rho", sa, pa, gs, Fs)
        lines += [f"    for c in range({np_n}):", f"        acc[c] = {zero}",
                  f"    for k0 in range(0, {code_dim(Kp)}, {TK}):"]
        lines += self._stage("Vsh", np_n, Kp, "vj", "vc", TQ, lambda: self.value(
            pa.b_node, self._mul_index(Fp, kp, v_groups, "vj", ("b", "n"))))
        lines += ["        if live:",
                  f"            for j in range(min({TK}, {code_dim(Kp)} - k0)):",
                  "                pj = pt[k0 + j]",
                  f"                for c in range({np_n}):",
                  "                    acc[c] += pj * Vsh[j, c]",
                  "        cuda.syncthreads()",
                  "    if live:",
                  f"        for c in range({np_n}):",
                  f"            out[np.uint64(rho * {np_n} + c)] = acc[c]"]
        grid = f"(({code_dim(Mt)} + {TQ - 1}) // {TQ}, {code_dim(Bt)})"
        self.launches.append(Launch("d0", self.device_params(), lines, grid, str(TQ),
                                     guard=f"{code_dim(Bt * Mt)} > 0"))

    def emit_attention_rows(self) -> None:
        """One thread per query row: its scores (Q·Kᵀ) into a local array, the row kernel's
        reductions and probabilities over them, then its row of P·V."""
        gs, gp, sa, pa, Fs, Fp, Bt, Mt, Ns, Ks, Np, Kp, keys = self._attention_parts()
        g = self.g
        zero = self.const(0.0, g.nodes[gs].dtype)
        self.threads = Bt * Mt
        lines = ["    rho = cuda.grid(1)", f"    if rho >= {code_dim(self.threads)}:", "        return",
                 f"    bi = rho // {code_dim(Mt)}", f"    mq = rho % {code_dim(Mt)}",
                 f"    st = cuda.local.array({max(keys, 1)}, numba.float32)",
                 f"    pt = cuda.local.array({max(keys, 1)}, numba.float32)",
                 f"    for c in range({code_dim(Ns)}):",
                 f"        acc = {zero}",
                 f"        for t in range({code_dim(Ks)}):"]
        mul_s = g.nodes[gs].inputs[0]
        groups = self._groups(Fs, sa, "bi", "mq", "c")
        lines += self.statement(" " * 12, lambda: "acc += " + self.value(
            mul_s, self._mul_index(Fs, g.nodes[gs].axis, groups, "t", ("b", "m", "n"))))
        lines.append("        st[c] = acc")
        lines += self._probabilities("    ", "rho", sa, pa, gs, Fs)
        v_groups = self._groups(Fp, pa, "bi", "0", "c")
        kp = g.nodes[gp].axis
        lines += [f"    for c in range({code_dim(Np)}):", f"        acc = {zero}", f"        for t in range({code_dim(Kp)}):"]
        lines += self.statement(" " * 12, lambda: "acc += pt[t] * " + self.value(
            pa.b_node, self._mul_index(Fp, kp, v_groups, "t", ("b", "n"))))
        lines.append(f"        out[np.uint64(rho * {code_dim(Np)} + c)] = acc")
        self.one_per_thread(lines)
