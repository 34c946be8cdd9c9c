"""GEMMs on the CPU: BLAS (np.dot on packed contiguous blocks) or generated loops, with fused
prologues (operands packed through their views) and epilogues over blocks of C's rows.
"""

from __future__ import annotations

from typing import Optional


from kiln.ir.dtypes import DType
from kiln.ir.graph import DEFAULT_GEMM_TILE
from kiln.ir.kernel import (compose_chain, flat_reads, gemm_axes, gemm_dims, gemm_writes_rows, kernel_gemm,
                            view_root)
from kiln.ir.shape import contiguous_strides, evaluate_dim, numel
from kiln.ir.view import ViewSpec
from codegen_svc.loopnest import COMPUTE_TYPE, THREADS_ARG, code_at, code_dim, code_scaled, code_sum


EPILOGUE_ROWS = DEFAULT_GEMM_TILE  # rows of C a GEMM's epilogue works on at a time, where the search chose no tile

# a GEMM whose B is this small (elements) is cheap to stream again per BLAS call: its blocks of
# packed A and of C stay within SMALL_BLOCK_BYTES where GEMM_MIN_ROWS rows allow (a CNN's
# im2col rows are long, its B small)
SMALL_B = 1 << 16

SMALL_BLOCK_BYTES = 1 << 14

GEMM_MIN_ROWS = 64  # the fewest rows per block of a GEMM split across the pool

GEMM_MIN_COLUMNS = 256  # the fewest columns per block of a GEMM whose columns the pool shares


def sub_block_rows(a_cols, c_cols, b_elements) -> int:
    """Rows of a GEMM's sub-block (packed A's `a_cols` and C's `c_cols` per row). EPILOGUE_ROWS,
    unless B is small enough to stream again per BLAS call for free: then as many rows as fit
    in SMALL_BLOCK_BYTES (at least GEMM_MIN_ROWS: fewer rows per BLAS call cost more in calls
    than they save in memory), which keeps the blocks' memory small. Dims may be symbolic: then
    the full EPILOGUE_ROWS."""
    per_row = 4 * (a_cols + c_cols)
    if not isinstance(b_elements, int) or not isinstance(per_row, int) or b_elements > SMALL_B or per_row == 0:
        return EPILOGUE_ROWS
    return max(GEMM_MIN_ROWS, min(EPILOGUE_ROWS, SMALL_BLOCK_BYTES // per_row))


def axis_runs(chain: list[ViewSpec]):
    """A view chain (innermost first) as loops over base axes: the first view's axes, whose
    source strides it gives, and an axis of stride 0 for each broadcast after it. Every later
    view must permute, merge and broadcast its input's axes (each axis of it a run of its
    input's axes, at that run's row-major stride); then each final axis is a run of base axes.
    Returns (base sizes, base source strides, source offset, run per final axis), or None."""
    first = chain[0]
    if first.mask is not None:
        return None
    sizes, strides = list(first.shape), list(first.strides)
    runs = [[i] for i in range(len(first.shape))]
    prev = tuple(first.shape)
    for v in chain[1:]:
        if v.mask is not None or v.offset != 0:
            return None
        row = contiguous_strides(prev)
        new, used = [], set()
        for size, st in zip(v.shape, v.strides):
            if size == 1:
                new.append([])
                continue
            if st == 0:  # a broadcast: a base axis of its own that reads nothing new
                sizes.append(size)
                strides.append(0)
                new.append([len(sizes) - 1])
                continue
            found = None
            for e in range(len(prev)):
                if prev[e] == 1 or row[e] != st or e in used:
                    continue
                for a in range(e, -1, -1):
                    run = [m for m in range(a, e + 1) if prev[m] != 1]
                    if used & set(run):
                        break
                    if numel(tuple(prev[m] for m in run)) == size:
                        found = run
                        break
                if found is not None:
                    break
            if found is None:
                return None
            used |= set(found)
            new.append([b for m in found for b in runs[m]])
        if any(prev[m] != 1 and m not in used for m in range(len(prev))):
            return None  # an axis dropped: a slice, not a merge
        runs, prev = new, tuple(v.shape)
    return sizes, strides, first.offset, runs


class GemmKernel:
    def emit_gemm(self):
        gi = kernel_gemm(self.g, self.k)
        r = self.g.nodes[gi]
        gm = gemm_axes(self.g, gi)
        m_axes, n_axes, b_axes = list(gm.m_axes), list(gm.n_axes), list(gm.batch_axes)
        F, Bt, Mt, Nt, K = gemm_dims(self.g, gi)
        k = r.axis
        lines = []
        a_args = (gm.a_node, gm.a_root, gm.a_spec, b_axes, m_axes, k, F, Bt, Mt, K, r.dtype)
        a_view = self._operand_view("A", "A", *a_args[1:])
        # a single matrix whose A needs a copy packs it a block of rows at a time, in the block loop;
        # so does a transposed A under a searched tile (a block of its rows is no matrix BLAS takes)
        tile = self.k.tile if Bt == 1 else 0
        pack_rows = Bt == 1 and (a_view is None or (tile and not a_view[2]))
        la, a_at, a_rows = (([], "at", True) if pack_rows else a_view if a_view is not None
                            else self._operand("A", "A", *a_args))
        lb, b_at, _ = self._operand("B", "B", gm.b_node, gm.b_root, gm.b_spec, b_axes, n_axes, k, F, Bt, Nt, K,
                                    r.dtype)
        lines += la + lb
        direct = gemm_writes_rows(self.g, gi) and not r.dtype.is_half and gi == self.k.output
        out = self.g.nodes[self.k.output]
        # too few rows for the pool to share at any binding (a decode step's GEMV): it shares
        # the columns instead, each thread a block of B's rows (a weight's [N, K] rows) in cache
        largest = {name: hi for name, _, hi in self.g.symbols}
        columns = (self.k.parallel and Bt == 1 and not pack_rows and not tile and a_rows
                   and b_at == "B[{bi}].T" and evaluate_dim(Mt, largest) < 2 * GEMM_MIN_ROWS
                   and evaluate_dim(Nt, largest) >= 2 * GEMM_MIN_COLUMNS)
        blocked = Bt == 1 and a_rows and (self.k.parallel or pack_rows or tile) and not columns
        epilogue_rows = None if direct else self._epilogue_rows(gi, Nt)
        rows = epilogue_rows if blocked else None
        # an epilogue that reads C only where it writes the output (epilogue_rows) runs in place:
        # BLAS writes C into the output, and no block of C is allocated (a Llama's attention scores
        # took a 256 KB C beside a 256 KB output, its MLP 64 KB per thread)
        in_place = epilogue_rows is not None and r.dtype is DType.F32 and out.dtype is DType.F32
        if direct or in_place:
            lines.append(f"    C = out[0:{code_dim(numel(r.shape))}].reshape(({code_dim(Bt)}, {code_dim(Mt)}, {code_dim(Nt)}))")
        elif rows is None:  # else no whole C: each block of rows has its own
            lines.append(f"    C = np.empty(({code_dim(Bt)}, {code_dim(Mt)}, {code_dim(Nt)}), dtype={COMPUTE_TYPE[r.dtype]})")
        if blocked:
            # split M across the pool: one block of A's rows per thread (BLAS runs single-threaded
            # beside numba's pool, see executor.single_threaded_blas). More blocks than threads
            # cost: each BLAS call packs all of B again (BERT's 512x384x1536 GEMM and GELU on 2
            # threads: 3.5 ms in 2 blocks, 3.85 in 4). The pool's size is an argument: numba
            # cannot cache a kernel that asks for it
            nc = f"max(1, min({THREADS_ARG}, {code_dim(Mt)} // {GEMM_MIN_ROWS}))" if self.k.parallel else "1"
            lines += [f"    nc = {nc}",
                      f"    for c in {'prange' if self.k.parallel else 'range'}(nc):",
                      f"        lo = c * {code_dim(Mt)} // nc",
                      f"        hi = (c + 1) * {code_dim(Mt)} // nc"]
            if rows is None and not pack_rows and not tile:
                lines.append(f"        np.dot({a_at.format(bi='0')}[lo:hi], {b_at.format(bi='0')}, C[0][lo:hi])")
            else:
                # sub-blocks of the searched tile's rows (Kernel.tile), else EPILOGUE_ROWS or fewer: A's
                # rows packed just before BLAS reads them, the epilogue run on C's rows right after
                # BLAS wrote them, both while in cache
                sb = tile or sub_block_rows(K if pack_rows else 0, Nt if rows is not None else 0, K * Nt)
                if pack_rows:
                    lines.append(f"        at = np.empty(({sb}, {code_dim(K)}), dtype={COMPUTE_TYPE[r.dtype]})")
                if rows is not None and not in_place:
                    lines += [f"        ct = np.empty(({sb}, {code_dim(Nt)}), dtype={COMPUTE_TYPE[r.dtype]})",
                              "        Cf = ct.reshape(-1)"]
                lines += [f"        for s0 in range(lo, hi, {sb}):",
                          f"            s1 = min(s0 + {sb}, hi)"]
                if pack_rows:
                    lines += self._pack_rows(gm.a_node, m_axes, k, F, K)
                a_blk = "at[0:s1 - s0]" if pack_rows else f"{a_at.format(bi='0')}[s0:s1]"
                c_blk = "ct[0:s1 - s0]" if rows is not None and not in_place else "C[0][s0:s1]"
                lines.append(f"            np.dot({a_blk}, {b_at.format(bi='0')}, {c_blk})")
                if rows is not None:
                    return lines + self._epilogue_block(gi, F, b_axes, m_axes, n_axes, Nt, rows, in_place)
        elif columns:
            lines += [f"    nc = max(1, min({THREADS_ARG}, {code_dim(Nt)} // {GEMM_MIN_COLUMNS}))",
                      "    for c in prange(nc):",
                      f"        n0 = c * {code_dim(Nt)} // nc",
                      f"        n1 = (c + 1) * {code_dim(Nt)} // nc",
                      f"        cb = np.empty(({code_dim(Mt)}, n1 - n0), dtype={COMPUTE_TYPE[r.dtype]})",
                      f"        np.dot({a_at.format(bi='0')}, B[0][n0:n1].T, cb)",
                      "        C[0][:, n0:n1] = cb"]
        else:
            rng = "prange" if self.k.parallel else "range"
            lines += [f"    for bi in {rng}({code_dim(Bt)}):",
                      f"        np.dot({a_at.format(bi='bi')}, {b_at.format(bi='bi')}, C[bi])"]
        if direct:
            return lines
        # store each element, through the epilogue when the kernel has one: the GEMM's value at
        # an index is C's element there (value() asks self.gemm_value)
        self.gemm_value = (gi, F, b_axes, m_axes, n_axes, "C[{b}, {m}, {n}]")
        if in_place:
            self.gemm_flat = "out"
        elif gemm_writes_rows(self.g, gi):  # C's flat order is the GEMM node's: read it by flat index
            lines.append("    Cf = C.reshape(-1)")
            self.gemm_flat = "Cf"
        loops, idx, depth = self.loops(out.shape, parallel=self.k.parallel and gi != self.k.output)
        lines += loops
        lines += self.statement("    " * depth, lambda: code_at("out", self.flat(out.shape, idx)) + " = "
                                f"{self.store(out.dtype, self.value(self.k.output, tuple(idx)))}")
        return lines

    def _epilogue_block(self, gi, F, b_axes, m_axes, n_axes, Nt, rows, in_place: bool) -> list[str]:
        """The epilogue over C's rows s0..s1, which BLAS just wrote into the block `ct`, or in
        place into the output's own rows."""
        out = self.g.nodes[self.k.output]
        lines = ["            for m in range(s0, s1):"]
        self.gemm_value = (gi, F, b_axes, m_axes, n_axes, None)
        self.gemm_flat = "out" if in_place else "Cf"
        self.gemm_base = "" if in_place else f" - s0*{code_dim(Nt)}"  # the block's first row is ct's row 0
        pad = " " * 16
        lead, idx = rows
        for j, e in zip(lead, self.unravel("m", tuple(out.shape[j] for j in lead))):
            if e != "0":
                lines.append(pad + f"i{j} = {e}")
        for j in range(len(lead), len(out.shape)):
            if out.shape[j] != 1:
                lines.append(pad + f"for i{j} in range({code_dim(out.shape[j])}):")
                pad += "    "
        return lines + self.statement(pad, lambda: code_at("out", self.flat(out.shape, idx)) + " = "
                                      f"{self.store(out.dtype, self.value(self.k.output, tuple(idx)))}")

    def _pack_rows(self, node, m_axes, k, F, K) -> list[str]:
        """Copy A's rows s0..s1 into the block `at`, each element read through A's views (in the
        source's own loops where A's rows are runs of a strided view's elements, _row_runs)."""
        runs = self._row_runs(node, m_axes, k, F, K)
        if runs is not None:
            return self._pack_runs(*runs)
        pad = " " * 16
        lines = ["            for mm in range(s0, s1):"]
        pidx = ["0"] * len(F)
        for j, e in zip(m_axes, self.unravel("mm", tuple(F[j] for j in m_axes))):
            if e != "0":
                lines.append(pad + f"p{j} = {e}")
                pidx[j] = f"p{j}"
        pidx[k] = f"p{k}"
        lines.append(pad + f"for p{k} in range({code_dim(K)}):")
        return lines + self.statement(pad + "    ",
                                      lambda: f"at[mm - s0, np.uint64(p{k})] = {self.value(node, tuple(pidx))}")

    def _row_runs(self, node, m_axes, k, F, K):
        """When A (GEMM operand `node`, a view of a buffer this kernel reads) is a strided view V
        of the buffer, of static shape S, read in V's row-major order: row m of A is the elements
        m·K .. m·K + K - 1 of that order, and K the product of S's trailing dims from t on. Then
        (buffer, V, t); else None. (A transformer's head merge: attention output [b, h, s, d]
        permuted to [b, s, h, d] and reshaped to [b·s, h·d] composes into no single strided
        view, so reading it element by element unravels a flat index with four divisions; in
        V's loops, each row is h runs of d contiguous elements.)"""
        root, chain = view_root(self.g, node)
        if root not in self.reads or self.g.nodes[root].dtype is not self.g.nodes[node].dtype:
            return None
        for cut in range(1, len(chain)):
            inner, outer = compose_chain(chain[:cut]), compose_chain(chain[cut:])
            if inner is None or outer is None or inner.mask is not None or outer.mask is not None:
                continue
            S = tuple(inner.shape)
            if not all(isinstance(d, int) for d in S + tuple(F)) or outer.offset != 0:
                continue
            rows = contiguous_strides(tuple(F[j] for j in m_axes))
            want = [0] * len(F)
            for j, st in zip(m_axes, rows):
                want[j] = st * K
            want[k] = 1
            if any(F[j] != 1 and outer.strides[j] != want[j] for j in range(len(F))):
                continue
            t = next((t for t in range(len(S) + 1) if numel(S[t:]) == K), None)
            if t is not None:
                return self.reads[root], inner, t, self.g.nodes[root].dtype
        return None

    def _pack_runs(self, buf: str, v: ViewSpec, t: int, dtype: DType) -> list[str]:
        """_pack_rows in V's own loops: row mm's index over V's leading dims (before t) once, then
        nested loops over its trailing dims, the innermost reading contiguous runs where V's
        stride is 1; no flat index is unravelled per element."""
        S, pad = tuple(v.shape), " " * 16
        lines = ["            for mm in range(s0, s1):"]
        base = [code_dim(v.offset)]
        for j, e in enumerate(self.unravel("mm", S[:t])):
            if e != "0":
                lines.append(pad + f"q{j} = {e}")
                base.append(code_scaled(f"q{j}", v.strides[j]))
        lines.append(pad + f"qb = {code_sum(base)}")
        src, dst = ["qb"], []
        for j, st in zip(range(t, len(S)), contiguous_strides(S[t:])):
            if S[j] == 1:
                continue
            lines.append(pad + f"for q{j} in range({S[j]}):")
            pad += "    "
            src.append(code_scaled(f"q{j}", v.strides[j]))
            dst.append(code_scaled(f"q{j}", st))
        return lines + [pad + f"at[mm - s0, {'np.uint64(' + code_sum(dst) + ')' if dst else '0'}] = "
                        f"{self.load(dtype, code_at(buf, code_sum(src)))}"]

    def _epilogue_rows(self, gi: int, Nt):
        """When the epilogue can run on a block of C's rows as soon as BLAS wrote them: the
        output has C's elements in C's flat order, every member reads the others only at their
        own flat positions (reshapes, no permutes), and C's row of Nt elements is the output's
        trailing dims. Then (the leading dims, which a row number unravels into, and the
        output's index names); else None."""
        g, out = self.g, self.g.nodes[self.k.output]
        members = set(self.k.nodes)
        if not gemm_writes_rows(g, gi) or numel(out.shape) != numel(g.nodes[gi].shape) or \
                not flat_reads(g, members, members):
            return None
        for p in range(len(out.shape), -1, -1):
            if numel(tuple(out.shape[p:])) == Nt:
                lead = list(range(p))
                idx = tuple("0" if out.shape[j] == 1 else f"i{j}" for j in range(len(out.shape)))
                return lead, idx
        return None

    def _operand_view(self, name, role, root, spec: Optional[ViewSpec], b_axes, x_axes, k, F, Bt, Xt, K, dtype):
        """_operand's lines, matrix and row flag when the operand is a view BLAS takes as it is
        (strides [batch, X, K] or [batch, K, X], contiguous); else None."""
        # BLAS takes f32 (16-bit floats widen into a copy) from a buffer (an operand the kernel
        # computes, an attention's scaled Q, is packed as it is computed)
        if spec is not None and not dtype.is_half and root in self.reads:
            buf = self.reads[root]
            st = spec.strides
            sizes_bxk = tuple(F[j] for j in b_axes + x_axes) + (K,)
            sizes_bkx = tuple(F[j] for j in b_axes) + (K,) + tuple(F[j] for j in x_axes)
            strides_bxk = tuple(st[j] for j in b_axes + x_axes) + (st[k],)
            strides_bkx = tuple(st[j] for j in b_axes) + (st[k],) + tuple(st[j] for j in x_axes)
            off = code_dim(spec.offset)
            span_ = f"{buf}[{off}:{off} + {code_dim(numel(sizes_bxk))}]"
            bxk = strides_bxk == contiguous_strides(sizes_bxk)
            bkx = strides_bkx == contiguous_strides(sizes_bkx)
            native, transposed = (bxk, bkx) if role == "A" else (bkx, bxk)
            if native:
                dims = (Xt, K) if role == "A" else (K, Xt)
                return ([f"    {name} = {span_}.reshape(({code_dim(Bt)}, {code_dim(dims[0])}, {code_dim(dims[1])}))"],
                        f"{name}[{{bi}}]", True)
            if transposed:
                dims = (K, Xt) if role == "A" else (Xt, K)
                return ([f"    {name} = {span_}.reshape(({code_dim(Bt)}, {code_dim(dims[0])}, {code_dim(dims[1])}))"],
                        f"{name}[{{bi}}].T", False)
        return None

    def _operand(self, name, role, node, root, spec: Optional[ViewSpec], b_axes, x_axes, k, F, Bt, Xt, K, dtype):
        """Lines binding the operand (role A or B) to the 3-d array `name`; the 2-d matrix
        expression for batch `{bi}` (A: [X, K], B: [K, X]); and whether its rows are
        C-contiguous (so a block of rows is a matrix BLAS takes). A transposed operand is a C
        array's `.T` (F-contiguous, which BLAS takes directly). Packs a copy only when the
        strides allow no view, or the views do not compose or pad (or spec is None): the copy
        then reads each element through the views."""
        view = self._operand_view(name, role, root, spec, b_axes, x_axes, k, F, Bt, Xt, K, dtype)
        if view is not None:
            return view
        merged = self._pack_merged(name, role, node, b_axes, x_axes, k, F, Bt, Xt, K, dtype)
        if merged is not None:
            return merged
        # pack: loop over the operand's own axes (the other operand's are 0) and copy
        shape3 = (Bt, Xt, K) if role == "A" else (Bt, K, Xt)
        lines = [f"    {name} = np.empty(({', '.join(code_dim(x) for x in shape3)}), dtype={COMPUTE_TYPE[dtype]})"]
        axes = b_axes + x_axes + [k]
        depth = 1
        for j in axes:  # a parallel kernel packs in parallel too (over the first axis)
            rng = "prange" if self.k.parallel and depth == 1 else "range"
            lines.append("    " * depth + f"for p{j} in {rng}({code_dim(F[j])}):")
            depth += 1
        pidx = tuple(f"p{j}" if j in axes else "0" for j in range(len(F)))
        bi = self._linear(pidx, b_axes, F)
        xi = self._linear(pidx, x_axes, F)
        dst = f"{bi}, {xi}, p{k}" if role == "A" else f"{bi}, p{k}, {xi}"
        lines += self.statement("    " * depth, lambda: f"{name}[{dst}] = {self.value(node, pidx)}")
        return lines, f"{name}[{{bi}}]", True

    def _pack_merged(self, name, role, node, b_axes, x_axes, k, F, Bt, Xt, K, dtype):
        """_operand's pack in loops over the source's own axes, when the operand's views only
        permute, merge and broadcast the axes of a strided view of a buffer (axis_runs): a GQA
        attention's keys, [b, kv heads, keys, d] broadcast to [b, kv heads, 2, keys, d], merged
        to [b, heads, keys, d] and transposed. The source offset and the packed position are then
        sums of loop indices times strides: no flat index is unravelled (a decode step's keys
        took four unsigned divisions per element and view level). Else None."""
        root, chain = view_root(self.g, node)
        if root not in self.reads or not chain or self.g.nodes[root].dtype is not self.g.nodes[node].dtype:
            return None
        found = axis_runs(chain)
        if found is None:
            return None
        sizes, strides, offset, runs = found
        own = set(b_axes + x_axes + [k])
        looped = sorted({m for j in own for m in runs[j]})
        if any(strides[m] != 0 for j in range(len(runs)) if j not in own for m in runs[j]):
            return None  # it varies along the other operand's axes: no GEMM operand
        if any(sizes[m] != 1 and strides[m] != 0 and m not in looped for m in range(len(sizes))):
            return None
        shape3 = (Bt, Xt, K) if role == "A" else (Bt, K, Xt)
        lines = [f"    {name} = np.empty(({', '.join(code_dim(x) for x in shape3)}), dtype={COMPUTE_TYPE[dtype]})"]
        looped = [m for m in looped if sizes[m] != 1]
        # the pool takes the first loop of a known size (a batch of one sequence would leave it idle)
        pool = next((m for m in looped if isinstance(sizes[m], int)), looped[0] if looped else None)
        depth = 1
        for m in looped:
            rng = "prange" if self.k.parallel and m == pool else "range"
            lines.append("    " * depth + f"for q{m} in {rng}({code_dim(sizes[m])}):")
            depth += 1
        pidx = ["0"] * len(F)
        for j in own:  # the operand's index along axis j, from its run of base axes
            members = [m for m in runs[j] if sizes[m] != 1]
            st = contiguous_strides(tuple(sizes[m] for m in members))
            pidx[j] = code_sum([code_scaled(f"q{m}", c) for m, c in zip(members, st)])
        bi, xi = self._linear(pidx, b_axes, F), self._linear(pidx, x_axes, F)
        dst = f"{bi}, {xi}, {pidx[k]}" if role == "A" else f"{bi}, {pidx[k]}, {xi}"
        src = code_sum([code_dim(offset)] + [code_scaled(f"q{m}", strides[m]) for m in looped])
        value = self.load(self.g.nodes[root].dtype, code_at(self.reads[root], src))
        return lines + ["    " * depth + f"{name}[{dst}] = {value}"], f"{name}[{{bi}}]", True
