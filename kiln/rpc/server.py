"""Server plumbing shared by the four services: error mapping, health, reflection, tracing.

This is the one place that builds gRPC servers; `kiln.apps.serve` maps stage names to servicers.
"""

from __future__ import annotations

import functools
import logging
import time
from concurrent import futures
from typing import Callable, Iterable, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kiln.core import errors
from kiln.rpc.auth import AuthConfig
from kiln.rpc.interceptors import BearerTokenInterceptor, MetricsInterceptor, RequestDecodeInterceptor
from kiln.core.telemetry import grpc_server_interceptors

log = logging.getLogger("kiln.rpc")

MAX_MESSAGE_BYTES = 64 << 20

_CODES = {c.code: getattr(grpc.StatusCode, c.code) for c in errors.BY_CODE.values()}


def _abort(context, fn: Callable, e: Exception) -> None:
    """End the call with e's status: KilnError -> its code, ValueError -> INVALID_ARGUMENT,
    anything else -> INTERNAL (logged). An abort already under way passes through."""
    if isinstance(e, errors.KilnError):
        context.abort(_CODES.get(e.code, grpc.StatusCode.INTERNAL), str(e))
    if isinstance(e, ValueError):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, grpc.RpcError) or type(e).__name__ == "_AbortError":
        raise e
    log.exception("internal error in %s", fn.__name__)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")


def rpc(fn: Callable) -> Callable:
    """Wrap a servicer method: KilnError -> its status code; anything else -> INTERNAL.
    A handler never takes its server down."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            return fn(self, request, context)
        except Exception as e:  # noqa: BLE001 - the boundary: report, keep serving
            _abort(context, fn, e)

    return wrapper


def rpc_stream(fn: Callable) -> Callable:
    """rpc for a server-streaming method: errors raised while the stream is produced get their
    status code too."""

    @functools.wraps(fn)
    def wrapper(self, request, context):
        try:
            yield from fn(self, request, context)
        except Exception as e:  # noqa: BLE001 - the boundary: report, keep serving
            _abort(context, fn, e)

    return wrapper


def deadline_of(context) -> Optional[float]:
    """The caller's deadline as a time.monotonic() value, or None."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


def build_server(register: Iterable[tuple[Callable[[grpc.Server], None], str]], port: int,
                 host: str = "127.0.0.1", max_workers: int = 8,
                 auth: Optional[AuthConfig] = None) -> tuple[grpc.Server, int]:
    """A server with the given services plus grpc.health.v1 and reflection; returns (server, port).
    TLS, mTLS and the bearer-token check follow `auth` (default: from the environment)."""
    auth = auth if auth is not None else AuthConfig.from_env()
    interceptors = [MetricsInterceptor()]  # outermost: rejected calls are counted too
    if auth.tokens:
        interceptors.append(BearerTokenInterceptor(auth.tokens))
    interceptors.append(RequestDecodeInterceptor())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         interceptors=[*interceptors, *grpc_server_interceptors()],
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    for add, service_name in register:
        add(server)
        names.append(service_name)
        health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(names, server)
    credentials = auth.server_credentials()
    bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
             else server.add_insecure_port(f"{host}:{port}"))
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    return server, bound
