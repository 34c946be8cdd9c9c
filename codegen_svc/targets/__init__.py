"""The registry of codegen targets: one folder per target, with the same file names for the same
kernel kinds (elementwise, rows, reduce, gemm, attention, data) and a `target.py` that composes
them over the shared loop-nest renderer. A new target is a folder and one entry in TARGETS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kiln.core.errors import FailedPrecondition
from codegen_svc.program import Program
from codegen_svc.targets.cpu import target as cpu
from codegen_svc.targets.cuda import target as cuda


@dataclass(frozen=True)
class Target:
    name: str
    emit: Callable[..., Program]  # emit(kernel_graph, **launch)
    # (block, tile) as a request gives them (0: default) -> the launch keywords for emit that are
    # not the defaults (they key the action cache); raises InvalidArgument for a shape it cannot run
    launch: Callable[[int, int], dict]
    # other launch shapes a compile times beside the best predicted program's, as (block, tile)
    launch_shapes: tuple[tuple[int, int], ...] = ()


TARGETS = {t.name: t for t in (
    Target("cpu", cpu.emit_cpu, cpu.launch),
    Target("cuda", cuda.emit_cuda, cuda.launch, cuda.LAUNCH_SHAPES),
)}


def target(name: str) -> Target:
    found = TARGETS.get(name or "cpu")
    if found is None:
        raise FailedPrecondition(f"unknown target {name!r}; this codegen emits for {', '.join(TARGETS)}")
    return found
