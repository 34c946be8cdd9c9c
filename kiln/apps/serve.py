"""`kiln serve`: the map from stage name to servicer, and the servers that host them."""

from __future__ import annotations

from typing import Iterable, Optional

import grpc

from codegen_svc.server import CodegenServicer
from executor_svc.server import ExecutorServicer
from importer_svc.server import ImporterServicer
from kiln.rpc.auth import AuthConfig
from kiln.rpc.server import build_server
from optimizer_svc.server import OptimizerServicer

STAGES = {"importer": ImporterServicer, "optimizer": OptimizerServicer, "codegen": CodegenServicer,
          "executor": ExecutorServicer}


def stage_services(store, stages: Iterable[str]):
    """(add_to_server, service name) pairs for the named stages, sharing one store."""
    out = []
    for name in stages:
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {', '.join(STAGES)} or all")
        servicer = STAGES[name](store)
        out.append((servicer.add_to_server, servicer.SERVICE_NAME))
    return out


def serve(stages: Iterable[str], port: int, store, host: str = "127.0.0.1",
          auth: Optional[AuthConfig] = None) -> tuple[grpc.Server, int]:
    return build_server(stage_services(store, stages), port, host, auth=auth)
