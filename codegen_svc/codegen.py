"""Codegen stage: KernelGraph digest -> Bundle digest for one target."""

from __future__ import annotations

from typing import Optional

from kiln.cas import cache
from kiln.cas.digest import Digest
from kiln.core.errors import InvalidArgument
from kiln.ir.serialize import bundle_to_pb, kernel_graph_from_pb
from kiln.cas.store import BlobStore
from kiln.core.telemetry import current_span, span
from kiln.v1 import ir_pb2
from codegen_svc.targets import target as target_named

STAGE_VERSION = "codegen-1-" + cache.code_version("codegen_svc", "kiln.ir")


def emit(store: BlobStore, kg_d: Digest, target: str = "cpu", deadline: Optional[float] = None,
         block: int = 0, tile: int = 0) -> tuple[Digest, int, int]:
    """Returns (bundle digest, kernel count, peak bytes). `block` and `tile` shape a cuda
    program's launches (0: the defaults)."""
    tgt = target_named(target)
    target = tgt.name
    launch = tgt.launch(block, tile)
    options: dict = {"target": target, **launch}
    key = cache.action_key("emit", STAGE_VERSION, {"kernel_graph": kg_d}, options)
    with cache.flight(store, key, deadline) as hit:  # one replica does it; the others wait
        if hit is not None:
            b = store.get_message(hit["bundle"], ir_pb2.Bundle)
            return hit["bundle"], len(b.kernels), b.memory.peak_bytes
        try:
            kg = kernel_graph_from_pb(store.get_message(kg_d, ir_pb2.KernelGraph))
        except ValueError as e:
            raise InvalidArgument(f"kernel graph {kg_d} is malformed: {e}") from e
        with span("codegen.emit", **{"kiln.kernel_graph": str(kg_d), "kiln.target": target}) as s:
            prog = tgt.emit(kg, **launch)
            s.set_attribute("kiln.kernels", len(prog.kernels))
        d = store.put_message(bundle_to_pb(target, prog, kg, kg_d))
        current_span().set_attribute("kiln.bundle", str(d))
        cache.record(store, key, {"bundle": d})
        return d, len(prog.kernels), prog.memory.peak_bytes
