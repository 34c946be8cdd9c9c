"""A compiled program's shape on every target: its kernels' modules and one entry module that allocates
the memory plan's buffers and calls the kernels in order, with no Python between kernels.
"""

from __future__ import annotations

from dataclasses import dataclass


from kiln.cas.digest import digest_bytes
from kiln.core.errors import FailedPrecondition
from kiln.core.telemetry import span
from kiln.ir.graph import TensorSpec
from kiln.ir.kernel import KernelGraph
from kiln.ir.ops import Op
from kiln.ir.shape import SYMBOL_PREFIX, numel
from codegen_svc.memory import ALIGN, MemoryPlan, plan_memory
from codegen_svc.loopnest import NP_TYPE, THREADS_ARG, code_dim, graph_symbols


@dataclass(frozen=True)
class EmittedKernel:
    name: str    # the KernelGraph's name for it
    kind: str
    source: str  # a whole module defining `symbol`
    symbol: str  # k_<hash of the module text>

    @property
    def module(self) -> str:
        return "kiln_" + self.symbol


@dataclass(frozen=True)
class Program:
    kernels: tuple[EmittedKernel, ...]
    module_source: str  # the entry module
    entry: str
    memory: MemoryPlan
    outputs: tuple[TensorSpec, ...]


def emit_program(kg: KernelGraph, writer, module_of, header: str, entry_decorator: str, alloc: str,
                 copy: str, arena: bool = True) -> Program:
    """Each kernel's module (written by `writer`, wrapped by `module_of`) and the entry module,
    which allocates the memory plan's buffers with `alloc` (in one arena when `arena` and the
    sizes are static) and calls the kernels in order."""
    g = kg.graph
    plan = plan_memory(kg, arena)
    kernels = []
    for t, k in enumerate(kg.kernels):
        if t in plan.skipped:  # a copy into an output that its producer now writes directly
            continue
        with span("codegen.kernel", **{"kiln.kernel": k.name, "kiln.kind": k.kind}) as ks:
            consts: dict = {}
            symbol, text = module_of(writer(kg, k, consts).emit(), consts)
            kernels.append(EmittedKernel(k.name, k.kind, text, symbol))
            ks.set_attribute("kiln.source", str(digest_bytes(text.encode())))
            ks.set_attribute("kiln.parallel", bool(k.parallel))
    imports = "\n".join(sorted({f"from {k.module} import {k.symbol}" for k in kernels}))
    module = header + imports + "\n\n\n" + emit_entry(kg, plan, [k.symbol for k in kernels], entry_decorator,
                                                        alloc, copy)
    outputs = tuple(TensorSpec(name or f"out{i}", g.nodes[o].shape, g.nodes[o].dtype)
                    for i, (o, name) in enumerate(zip(g.outputs, list(g.output_names) + [""] * len(g.outputs))))
    return Program(tuple(kernels), module, "run_graph", plan, outputs)


def emit_entry(kg: KernelGraph, plan: MemoryPlan, symbols: list[str], decorator: str, alloc: str,
                copy: str) -> str:
    g = kg.graph
    args = [f"in{i}" for i in range(len(g.inputs))] + [f"w{i}" for i in range(len(g.weights))]
    buf: dict[int, str] = {}
    in_index = {t.name: i for i, t in enumerate(g.inputs)}
    w_index = {t.name: i for i, t in enumerate(g.weights)}
    for i, n in enumerate(g.nodes):
        if n.op is Op.INPUT:
            buf[i] = f"in{in_index[n.name]}"
        elif n.op is Op.WEIGHT:
            buf[i] = f"w{w_index[n.name]}"
    syms = graph_symbols(g)
    missing = set(syms) - {s for s, _, _ in g.symbols}
    if missing:
        raise FailedPrecondition(f"graph uses symbols {sorted(missing)} that its inputs do not define")
    syms = [SYMBOL_PREFIX + s for s in syms] + [THREADS_ARG]  # passed on to every kernel
    lines = ([decorator] if decorator else []) + [f"def run_graph({', '.join(args + syms)}):"]
    # bind symbolic dims from the input shapes
    if plan.arena_bytes:  # one allocation, aligned by hand: each slot a view at its offset
        lines += [f"    arena = {alloc}({plan.arena_bytes + ALIGN}, dtype=np.uint8)",
                  f"    a0 = ({ALIGN} - arena.ctypes.data % {ALIGN}) % {ALIGN}"]
    for slot in plan.slots:
        if plan.arena_bytes:
            end = slot.offset + slot.elements * slot.dtype.itemsize
            lines.append(f"    s{slot.slot} = arena[a0 + {slot.offset}:a0 + {end}].view({NP_TYPE[slot.dtype]})")
        else:
            lines.append(f"    s{slot.slot} = {alloc}({code_dim(slot.elements)}, dtype={NP_TYPE[slot.dtype]})")
    out_buf: dict[int, str] = {}
    for o in g.outputs:
        if o in out_buf or g.nodes[o].op in (Op.INPUT, Op.WEIGHT):
            continue
        name = f"o{len(out_buf)}"
        out_buf[o] = name
        lines.append(f"    {name} = {alloc}({code_dim(numel(g.nodes[o].shape))}, dtype={NP_TYPE[g.nodes[o].dtype]})")
    for i, s in plan.node_slot.items():
        buf[i] = f"s{s}"
    buf.update(out_buf)
    for root, o in plan.aliases.items():
        buf[root] = out_buf[o]
    run = [k for t, k in enumerate(kg.kernels) if t not in plan.skipped]
    for k, symbol in zip(run, symbols):
        lines.append(f"    {symbol}({', '.join([buf[k.output]] + [buf[j] for j in k.reads] + syms)})  # {k.name}")
    rets = []
    for o in g.outputs:
        rets.append(f"{buf[o]}{copy}" if g.nodes[o].op in (Op.INPUT, Op.WEIGHT) else buf[o])
    lines.append(f"    return ({', '.join(rets)},)")
    return "\n".join(lines) + "\n"
