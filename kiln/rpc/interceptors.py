"""gRPC server interceptors every kiln server runs (kiln.rpc.server.build_server puts them in order):
metrics, the bearer-token check, and turning unparsable requests into INVALID_ARGUMENT."""

from __future__ import annotations

import hmac
import time
from typing import Callable, Optional

import grpc

from kiln.core.metrics import RPC_IN_FLIGHT, RPC_LATENCY, RPC_REQUESTS

# health probes (Kubernetes' gRPC probe sends no token) reveal nothing but SERVING
UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def rewrap(handler, wrap: Callable[[Callable, bool], Callable], deserializer=None):
    """`handler` with its behavior replaced by wrap(behavior, streaming) (a unary behavior returns,
    a streaming one is a generator); kiln's RPCs are unary or server-streaming."""
    decode = deserializer or handler.request_deserializer
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary, False), decode,
                                                   handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream, True), decode,
                                                    handler.response_serializer)
    return handler


def _split_method(full: str) -> tuple[str, str]:
    """'/kiln.v1.Executor/Run' -> ('kiln.v1.Executor', 'Run')."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service or "unknown", method or full


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every RPC the server handles (unary and server-streaming), with its final code."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        service, method = _split_method(handler_call_details.method)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            RPC_REQUESTS.labels(service, method, "UNIMPLEMENTED").inc()
            return None

        def finish(context, t0: float, error: Optional[BaseException]) -> None:
            code = context.code() if hasattr(context, "code") else None
            if code is None:
                code = grpc.StatusCode.UNKNOWN if error is not None else grpc.StatusCode.OK
            name = code.name if isinstance(code, grpc.StatusCode) else str(code)
            RPC_REQUESTS.labels(service, method, name).inc()
            RPC_LATENCY.labels(service, method).observe(time.perf_counter() - t0)
            RPC_IN_FLIGHT.labels(service, method).dec()

        def wrap(inner, streaming: bool):
            def unary(request, context):
                t0, error = time.perf_counter(), None
                RPC_IN_FLIGHT.labels(service, method).inc()
                try:
                    return inner(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    finish(context, t0, error)

            def stream(request, context):
                t0, error = time.perf_counter(), None
                RPC_IN_FLIGHT.labels(service, method).inc()
                try:
                    yield from inner(request, context)
                except BaseException as e:
                    error = e
                    raise
                finally:
                    finish(context, t0, error)

            return stream if streaming else unary

        return rewrap(handler, wrap)


def _aborting(code: grpc.StatusCode, message: str):
    """A wrap for rewrap whose behavior aborts before running the RPC."""
    def wrap(inner, streaming: bool):
        def unary(request, context):
            context.abort(code, message)

        def stream(request, context):
            context.abort(code, message)
            yield  # pragma: no cover - abort raises

        return stream if streaming else unary

    return wrap


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Rejects a call without `authorization: Bearer <one of tokens>` (health checks excepted)."""

    def __init__(self, tokens: tuple[str, ...]):
        self._tokens = [t.encode() for t in tokens]

    def _problem(self, metadata) -> Optional[str]:
        values = [v for k, v in (metadata or ()) if k == "authorization"]
        if not values:
            return "this server needs a bearer token (authorization metadata); none was sent"
        scheme, _, token = (values[0] if isinstance(values[0], str) else values[0].decode()).partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.strip().encode(), t)
                                                 for t in self._tokens):
            return "the bearer token is not accepted"
        return None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method in UNAUTHENTICATED_METHODS:
            return handler
        problem = self._problem(handler_call_details.invocation_metadata)
        return handler if problem is None else rewrap(handler, _aborting(grpc.StatusCode.UNAUTHENTICATED, problem))


class _Malformed:
    def __init__(self, error: str):
        self.error = error


class RequestDecodeInterceptor(grpc.ServerInterceptor):
    """A request that does not parse as its message type is INVALID_ARGUMENT (gRPC's own answer,
    INTERNAL, would blame the server for the client's bytes)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer

        def lenient(data: bytes):
            try:
                return decode(data)
            except Exception as e:  # noqa: BLE001 - any parse failure is the client's
                return _Malformed(f"{type(e).__name__}: {e}")

        def wrap(inner, streaming: bool):
            def check(request, context) -> None:
                if isinstance(request, _Malformed):
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"malformed request for {handler_call_details.method}: {request.error}")

            def unary(request, context):
                check(request, context)
                return inner(request, context)

            def stream(request, context):
                check(request, context)
                yield from inner(request, context)

            return stream if streaming else unary

        return rewrap(handler, wrap, lenient)
