"""The loop-nest renderer every target shares: a kernel's values as expressions over flat buffers.

Views become index arithmetic, masked views conditional expressions, fused elementwise chains one
expression per output element. Ops are rendered from OP_CODE, one entry per primitive; a target
overrides only the entries that differ (the cuda target's math functions). Kernel kinds (targets/<name>/)
build their loops from these pieces.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from kiln.core.errors import FailedPrecondition
from kiln.ir.dtypes import DType
from kiln.ir.graph import Graph, Node
from kiln.ir.kernel import Kernel, KernelGraph, compose_chain, view_root
from kiln.ir.ops import GroupOp, Op
from kiln.ir.shape import SYMBOL_PREFIX, Dim, contiguous_strides, numel, render_dim
from kiln.ir.view import ViewSpec


THREADS_ARG = "nthreads"  # the pool's size: every kernel's and the entry's last argument

# buffer element types; f16 and bf16 are stored as their 16-bit words (numba has no
# half-precision arithmetic on CPU) and computed in f32 inside a kernel
NP_TYPE = {DType.F32: "np.float32", DType.F16: "np.uint16", DType.BF16: "np.uint16", DType.I32: "np.int32",
       DType.I64: "np.int64", DType.BOOL: "np.bool_"}

COMPUTE_TYPE = {**NP_TYPE, DType.F16: "np.float32", DType.BF16: "np.float32"}

LOAD_FN = {DType.F16: "_h2f", DType.BF16: "_b2f"}

STORE_FN = {DType.F16: "_f2h", DType.BF16: "_f2b"}

ROUND_FN = {DType.F16: "_rh", DType.BF16: "_rb"}


def code_dim(x: Dim) -> str:
    return render_dim(x)


def axis_map(v: ViewSpec, src_shape) -> Optional[tuple]:
    """When the view only permutes, broadcasts and adds or drops dims of 1 (no offset, mask,
    merge or split), the view's axis each source axis is read at (None: a dim of 1); the
    source's index is then the view's, axis by axis, with no flat index to unravel (a
    scaled Q packed for attention took four divisions per element). Else None."""
    if v.mask is not None or v.offset != 0:
        return None
    out = []
    used = set()
    for k, c in enumerate(contiguous_strides(tuple(src_shape))):
        if src_shape[k] == 1:
            out.append(None)
            continue
        j = next((j for j in range(len(v.shape)) if j not in used and v.strides[j] == c
                  and v.shape[j] == src_shape[k]), None)
        if j is None:
            return None
        used.add(j)
        out.append(j)
    if any(v.strides[j] != 0 and v.shape[j] != 1 for j in range(len(v.shape)) if j not in used):
        return None
    return tuple(out)


def code_sum(terms: list[str]) -> str:
    terms = [t for t in terms if t != "0"]
    return "(" + " + ".join(terms) + ")" if terms else "0"


def code_scaled(i: str, s: Dim) -> str:
    if s == 0 or i == "0":
        return "0"
    return i if s == 1 else f"{i}*{code_dim(s)}"


def code_at(buf: str, index: str) -> str:
    """buf's element at a flat index. Flat indices are never negative, and an unsigned index
    tells numba so: it then drops the negative-index wraparound, which otherwise keeps LLVM
    from vectorizing the loop (a parallel add over 786k floats: 0.63 ms signed, 0.05 unsigned)."""
    return f"{buf}[{index}]" if index.isdigit() else f"{buf}[np.uint64({index})]"


def checked_index_lines(pad: str, size, op: str) -> list[str]:
    """The data-dependent index `j` outside [0, size) raises (as torch does), never reads out of bounds."""
    return [pad + f"if j < 0 or j >= {code_dim(size)}:",
            pad + f"    raise IndexError('{op} index out of range')"]


def dim_symbols(dims) -> set[str]:
    out = set()
    for d in dims:
        if not isinstance(d, int):
            out |= d.symbols()
    return out


_last_symbols: tuple = (None, [])  # (graph, its symbols): every kernel of a program asks for them


def graph_symbols(g: Graph) -> list[str]:
    """Every symbolic dim the graph uses, sorted: extra arguments of the entry and of each kernel.
    Kept for the last graph asked about: each of a program's kernels asks, and a scan per kernel
    made emitting a program quadratic in its layers (a 16-layer Llama's 8 candidates: 63 s)."""
    global _last_symbols
    last, symbols = _last_symbols
    if last is not g:
        symbols = _scan_symbols(g)
        _last_symbols = (g, symbols)
    return list(symbols)


def _scan_symbols(g: Graph) -> list[str]:
    found = set()
    for n in g.nodes:
        found |= dim_symbols(n.shape)
        if n.view is not None:
            found |= dim_symbols(n.view.strides) | dim_symbols((n.view.offset,))
            if n.view.mask is not None:
                found |= dim_symbols([x for r in n.view.mask for x in r])
    return sorted(found)


class LoopNest:
    def __init__(self, kg: KernelGraph, kernel: Kernel, consts: dict):
        self.g = kg.graph
        self.k = kernel
        self.inside = set(kernel.nodes)
        self.reads = {j: f"r{n}" for n, j in enumerate(kernel.reads)}
        self.consts = consts
        # index temporaries the next statement needs (a view chain that does not compose is
        # walked level by level; naming each level's flat index keeps the expression linear in
        # the chain's length instead of growing as dims ** levels)
        self.lets: dict[str, str] = {}
        self.let_count = 0
        # while an epilogue is written: (gemm node, its Mul's shape, batch/M/N axes, the element
        # of the product at {b}, {m}, {n})
        self.gemm_value = None
        # nodes the kernel reads more than once are named (computed once per statement), except
        # under a padding mask, whose condition must guard the reads inside it
        inside_users: dict[int, int] = {}
        for j in kernel.nodes:
            for x in kg.graph.nodes[j].inputs:
                root = view_root(kg.graph, x)[0]
                inside_users[root] = inside_users.get(root, 0) + 1
        self.shared = {j for j in kernel.nodes if inside_users.get(j, 0) > 1
                       and kg.graph.nodes[j].op not in (Op.CONSTANT, Op.VIEW)}
        self.guarded = 0
        self.row_values: dict[int, str] = {}  # row kernels: reductions already computed for the row
        self.row_col: Optional[str] = None  # attention kernels: the loop variable along the row
        self.gemm_flat: Optional[str] = None  # GEMM epilogues: C flat, when its order is the GEMM node's
        self.gemm_base = ""  # subtracted from a flat index into gemm_flat (a block of C's rows)
        # attention kernels: members a reduction loop stored per column of the row, to be read
        # back by the later loops instead of computed again (a softmax's exponentials)
        self.row_store: dict[int, str] = {}  # planned: node -> its row array
        self.row_cache: dict[int, tuple[str, tuple]] = {}  # stored: node -> (row array, the row's index)
        self.locals: dict[tuple[str, int], str] = {}  # (prefix, node) -> its local's name, see local()

    def local(self, prefix: str, node: int) -> str:
        """The name of the local holding a node's value (a row's reduction, a row value), numbered
        within the kernel in the order they are first named, never by the graph's node ids: the same
        kernel in two layers (or two programs) is then the same text, hashed, cached and compiled once."""
        key = (prefix, node)
        if key not in self.locals:
            self.locals[key] = f"{prefix}{sum(1 for p, _ in self.locals if p == prefix)}"
        return self.locals[key]

    def let(self, expr: str) -> str:
        if expr.isidentifier() or expr.isdigit():
            return expr
        for name, e in self.lets.items():
            if e == expr:
                return name
        # every temporary of the kernel has its own name: numba types a name once per function,
        # so reusing one for an index and a float (or a bool) would unify them to float64
        name = f"x{self.let_count}"
        self.let_count += 1
        self.lets[name] = expr
        return name

    def statement(self, pad: str, make) -> list[str]:
        """`make()` builds a statement from value expressions; the temporaries they named come first."""
        self.lets = {}
        text = make()
        lines = [pad + f"{name} = {e}" for name, e in self.lets.items()] + [pad + text]
        self.lets = {}
        return lines

    def const(self, value: float, dtype: DType) -> str:
        if dtype is DType.BOOL:
            return "True" if value else "False"
        if dtype.is_half:  # the half's value, held in f32
            value = float(np.asarray(value, dtype=np.float32).astype(dtype.numpy).astype(np.float32))
        key = (value, dtype)
        if key not in self.consts:
            name = f"C{len(self.consts)}"
            lit = repr(value) if math.isfinite(value) else ("np.inf" if value > 0 else "-np.inf" if value < 0 else "np.nan")
            if not dtype.is_float:
                lit = str(int(value))
            self.consts[key] = (name, f"{name} = {COMPUTE_TYPE[dtype]}({lit})")
        return self.consts[key][0]

    @staticmethod
    def load(dtype: DType, element: str) -> str:
        """A buffer element as a compute value (16-bit floats widen to f32)."""
        return f"{LOAD_FN[dtype]}({element})" if dtype.is_half else element

    @staticmethod
    def store(dtype: DType, value: str) -> str:
        """A compute value as a buffer element (f32 rounds to the 16-bit float, to nearest even)."""
        return f"{STORE_FN[dtype]}({value})" if dtype.is_half else value

    def flat(self, shape, idx) -> str:
        return code_sum([code_scaled(i, s) for i, s in zip(idx, contiguous_strides(shape))])

    def value(self, j: int, idx: tuple[str, ...]) -> str:
        """Expression for node j's element at multi-index idx."""
        n = self.g.nodes[j]
        if j in self.row_values:
            return self.row_values[j]
        if j in self.row_cache:
            arr, ridx = self.row_cache[j]
            a = self.k.axis
            if all(x == y for t, (x, y) in enumerate(zip(idx, ridx)) if t != a):  # this row, any column
                return f"{arr}[np.uint64({idx[a]})]"
        if j in self.reads:
            return self.load(n.dtype, code_at(self.reads[j], self.flat(n.shape, idx)))
        if self.gemm_value is not None and j == self.gemm_value[0]:
            if self.gemm_flat:
                return code_at(self.gemm_flat, self.flat(n.shape, idx) + self.gemm_base)
            _, F, b_axes, m_axes, n_axes, at = self.gemm_value
            if self.row_col is not None:  # an attention kernel's scores: this row's element at the loop's column
                return at.format(col=self.row_col)
            return at.format(b=self._linear(idx, b_axes, F), m=self._linear(idx, m_axes, F),
                             n=self._linear(idx, n_axes, F))
        op = n.op
        if op is Op.CONSTANT:
            return self.const(n.value, n.dtype)
        if op is Op.VIEW:
            return self.view_value(j, idx)
        expr = self.compute(j, n, idx)
        return self.let(expr) if j in self.shared and not self.guarded else expr

    def compute(self, j: int, n, idx: tuple[str, ...]) -> str:
        render = self.op_code.get(n.op)
        if render is None:
            raise FailedPrecondition(f"codegen cannot inline {n.op.value}: the {KERNEL_OPS[n.op]} kernels render it")
        a = [self.value(x, idx) for x in n.inputs] if n.op in GroupOp.Elementwise else []
        return render(self, n, a, idx)

    def view_value(self, j: int, idx) -> str:
        root, chain = view_root(self.g, j)
        spec = compose_chain(chain)
        specs = [spec] if spec is not None else list(reversed(chain))
        # walk from the outermost view inwards, turning indices into the source's indices
        cur = idx
        conds = []
        src_shape = None
        for level, v in enumerate(specs):
            if v.mask is not None:
                for k, (lo, hi) in enumerate(v.mask):
                    if lo != 0 or hi != v.shape[k]:
                        conds.append(f"({code_dim(lo)} <= {cur[k]} < {code_dim(hi)})")
            flat = code_sum([code_dim(v.offset)] + [code_scaled(i, s) for i, s in zip(cur, v.strides)])
            inner = root if level == len(specs) - 1 else None
            src_shape = self.g.nodes[root].shape if inner is not None else specs[level + 1].shape
            if inner is not None and root in self.reads:
                val = self.load(self.g.nodes[root].dtype, code_at(self.reads[root], flat))
                break
            if inner is not None and self.gemm_flat and root == self.gemm_value[0]:
                val = code_at(self.gemm_flat, flat + self.gemm_base)
                break
            mapped = axis_map(v, src_shape)
            cur = (tuple("0" if m is None else cur[m] for m in mapped) if mapped is not None
                   else self.unravel(self.let(flat), src_shape))
        else:
            self.guarded += bool(conds)
            val = self.value(root, cur)
            self.guarded -= bool(conds)
        if conds:
            zero = self.const(0.0, self.g.nodes[j].dtype)
            return f"({val} if ({' and '.join(conds)}) else {zero})"
        return val

    @staticmethod
    def unravel(flat: str, shape) -> tuple[str, ...]:
        """The multi-index of `flat` in shape's row-major order. Divided unsigned: numba's signed
        // and % follow Python's floor rounding, a test and a fix-up each; unsigned ones are a
        multiply and a shift (packing 256 rows of BERT's head merge: 626 us signed, 303
        unsigned). A flat index is never negative where it is read; where a padded view's
        source index is (the mask is false) its parts are never read."""
        out = []
        for k, c in enumerate(contiguous_strides(shape)):
            if shape[k] == 1:
                out.append("0")
                continue
            if c == 1 and k == 0:
                out.append(flat)
                continue
            e = f"np.uint64({flat})" if c == 1 else f"(np.uint64({flat}) // np.uint64({code_dim(c)}))"
            if k > 0:
                e = f"({e} % np.uint64({code_dim(shape[k])}))"
            out.append(f"np.int64({e})")
        return tuple(out)

    def index_of(self, flat: str, shape, skip_axis, pad: str) -> tuple[list[str], list]:
        """The multi-index of `flat` in shape as named locals `i<k>` (lines at `pad`): "0" for
        a dim of 1, None at skip_axis."""
        lines, idx = [], []
        for k, e in enumerate(self.unravel(flat, shape)):
            if k == skip_axis or e == "0":
                idx.append(None if k == skip_axis else "0")
                continue
            lines.append(pad + f"i{k} = {e}")
            idx.append(f"i{k}")
        return lines, idx

    def loops(self, shape, skip_axis=None, parallel=False, collapse=False):
        """Nested loops over shape (but skip_axis), the first of more than one iteration on the
        pool when parallel; collapsed: one pool loop over all their iterations, unravelled."""
        if parallel and collapse:
            looped = tuple(1 if k == skip_axis else d for k, d in enumerate(shape))
            lines, idx = self.index_of("fi", looped, skip_axis, "        ")
            return [f"    for fi in prange({code_dim(numel(looped))}):"] + lines, idx, 2
        lines, idx, depth = [], [], 1
        first = True
        for k, d in enumerate(shape):
            if k == skip_axis:
                idx.append(None)
                continue
            if d == 1:
                idx.append("0")
                continue
            rng = "prange" if parallel and first else "range"
            first = False
            lines.append("    " * depth + f"for i{k} in {rng}({code_dim(d)}):")
            idx.append(f"i{k}")
            depth += 1
        return lines, idx, depth

    @staticmethod
    def checked_index(pad: str, size, op: str) -> list[str]:
        return checked_index_lines(pad, size, op)

    def signature(self) -> str:
        return ", ".join(["out"] + [self.reads[j] for j in self.k.reads] + self.symbols() + [THREADS_ARG])

    def symbols(self) -> list[str]:
        return [SYMBOL_PREFIX + s for s in graph_symbols(self.g)]

    @staticmethod
    def _linear(idx, axes, F):
        if not axes:
            return "0"
        st = contiguous_strides(tuple(F[j] for j in axes))
        return code_sum([code_scaled(idx[j], s) for j, s in zip(axes, st)])


def _cast(w: LoopNest, n, a, idx) -> str:
    if n.dtype is DType.BOOL:
        return f"({a[0]} != 0)"
    if n.dtype.is_half:
        return f"{ROUND_FN[n.dtype]}(np.float32({a[0]}))"
    return f"{NP_TYPE[n.dtype]}({a[0]})"


def _iota(w: LoopNest, n, a, idx) -> str:
    if n.dtype.is_half:
        return f"{ROUND_FN[n.dtype]}(np.float32({idx[n.axis]}))"
    return f"{NP_TYPE[n.dtype]}({idx[n.axis]})"


# op -> code for one element: f(writer, node, its inputs' values, the element's index). A target
# overrides the entries that differ ({**OP_CODE, Op.SIN: ...}) and passes its table to check_op_table.
OP_CODE: dict[Op, Callable[[LoopNest, Node, list, tuple], str]] = {
    Op.EXP2: lambda w, n, a, idx: f"_exp2({a[0]})",
    Op.LOG2: lambda w, n, a, idx: f"np.log2({a[0]})",
    Op.SIN: lambda w, n, a, idx: f"np.sin({a[0]})",
    Op.SQRT: lambda w, n, a, idx: f"np.sqrt({a[0]})",
    Op.RECIP: lambda w, n, a, idx: f"({w.const(1.0, n.dtype)} / {a[0]})",
    Op.ADD: lambda w, n, a, idx: f"({a[0]} or {a[1]})" if n.dtype is DType.BOOL else f"({a[0]} + {a[1]})",
    Op.MUL: lambda w, n, a, idx: f"({a[0]} and {a[1]})" if n.dtype is DType.BOOL else f"({a[0]} * {a[1]})",
    Op.MOD: lambda w, n, a, idx: f"({a[0]} % {a[1]})",
    Op.LESS_THAN: lambda w, n, a, idx: f"({a[0]} < {a[1]})",
    Op.WHERE: lambda w, n, a, idx: f"({a[1]} if {a[0]} else {a[2]})",
    Op.CAST: _cast,
    Op.IOTA: _iota,
}
# the primitives that are loops, not one expression: the kernel kinds that render them
KERNEL_OPS = {Op.SUM_REDUCE: "reduce and row", Op.MAX_REDUCE: "reduce and row", Op.GATHER: "gather",
              Op.SCATTER: "scatter"}


def check_op_table(table: dict) -> dict:
    """A table must render every primitive, as an expression or through a kernel kind: checked at import."""
    missing = GroupOp.Primitive - table.keys() - KERNEL_OPS.keys()
    both = table.keys() & KERNEL_OPS.keys()
    if missing or both:
        raise ImportError(f"op table: no code for {sorted(o.value for o in missing)}; "
                          f"both inline and a kernel kind: {sorted(o.value for o in both)}")
    return table


LoopNest.op_code = check_op_table(OP_CODE)
