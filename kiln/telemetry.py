"""OpenTelemetry for every stage: spans, W3C context over gRPC, and the default exporters.

Exporter: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set and the OTLP exporter is installed;
otherwise one JSON line per finished span appended to KILN_TRACE_FILE
(default ~/.cache/kiln/traces.jsonl). OTEL_TRACES_EXPORTER=none turns export off.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Iterator, Optional, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

_TRACER = trace.get_tracer("kiln")
_lock = threading.Lock()
_configured = False


class JsonLinesSpanExporter(SpanExporter):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for s in spans:
            ctx = s.get_span_context()
            lines.append(json.dumps({
                "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
                "parent_id": f"{s.parent.span_id:016x}" if s.parent else None, "name": s.name,
                "start_ns": s.start_time, "end_ns": s.end_time,
                "service": s.resource.attributes.get("service.name", ""),
                "attributes": {k: v if isinstance(v, (str, int, float, bool)) else list(v)
                               for k, v in (s.attributes or {}).items()},
                "status": s.status.status_code.name}))
        with self._lock, open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS


def setup_tracing(service_name: str = "kiln", exporter: Optional[SpanExporter] = None) -> None:
    """Install the process's tracer provider once; later calls only add `exporter`."""
    global _configured
    with _lock:
        provider = trace.get_tracer_provider()
        if not _configured or not isinstance(provider, TracerProvider):
            provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
            trace.set_tracer_provider(provider)
            _configured = True
            if exporter is None:
                default = _default_exporter()
                if default is not None:
                    provider.add_span_processor(BatchSpanProcessor(default))
        if exporter is not None:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor

            provider.add_span_processor(SimpleSpanProcessor(exporter))


def _default_exporter() -> Optional[SpanExporter]:
    if os.environ.get("OTEL_TRACES_EXPORTER", "") == "none":
        return None
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        except ImportError:
            pass
    return JsonLinesSpanExporter(os.environ.get("KILN_TRACE_FILE", "~/.cache/kiln/traces.jsonl"))


@contextlib.contextmanager
def span(name: str, **attributes) -> Iterator[trace.Span]:
    with _TRACER.start_as_current_span(name) as s:
        for k, v in attributes.items():
            s.set_attribute(k, v)
        yield s


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def child_span(name: str, **attributes) -> contextlib.AbstractContextManager:
    """A span only inside a recorded trace (a gRPC request, a traced caller): hot paths such as
    each run of a compiled program cost nothing when nobody traces them (a span is ~30 µs; the
    context manager returned untraced is one shared nullcontext)."""
    if not trace.get_current_span().is_recording():
        return _NO_SPAN
    return span(name, **attributes)


def current_span() -> trace.Span:
    return trace.get_current_span()


def grpc_server_interceptors() -> list:
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor()]


def instrument_channel(channel):
    """A channel that opens a client span per call and sends W3C trace context in metadata."""
    from opentelemetry.instrumentation.grpc import client_interceptor, grpcext

    return grpcext.intercept_channel(channel, client_interceptor())
