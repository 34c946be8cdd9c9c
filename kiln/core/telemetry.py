"""OpenTelemetry for every stage: spans, W3C context over gRPC, and the default exporters.

Exporter: OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set and the OTLP exporter is installed;
otherwise OTLP JSON appended to KILN_TRACE_FILE (default traces.jsonl in KILN_CACHE_DIR, see
kiln.core.localcache: capped by KILN_TRACE_MAX_MB, oldest lines first), one export request per
line, as the OpenTelemetry Collector's file exporter writes it; `read_spans` reads it back for
`kiln trace`. OTEL_TRACES_EXPORTER=none turns export off.

Libraries that trace themselves (egglog: a span per rule registration and per run, thousands per
compile) are not recorded unless KILN_TRACE_LIBRARIES=1: they were two thirds of a compile's
spans and slowed the search by half under an exporter that keeps spans.
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

from kiln.core.localcache import append_line, trace_cap, trace_file  # noqa: F401 (trace_file: kiln trace's default)

_TRACER = trace.get_tracer("kiln")
_lock = threading.Lock()
_configured = False

QUIET_LIBRARIES = ("egglog",)  # instrumentation scopes recorded only with KILN_TRACE_LIBRARIES=1


class _Provider(TracerProvider):
    """The SDK's provider, with a no-op tracer for QUIET_LIBRARIES unless asked for."""

    def get_tracer(self, instrumenting_module_name: str, *args, **kwargs) -> trace.Tracer:
        if instrumenting_module_name.split(".")[0] in QUIET_LIBRARIES and \
                os.environ.get("KILN_TRACE_LIBRARIES", "") not in ("1", "true", "yes"):
            return trace.NoOpTracer()
        return super().get_tracer(instrumenting_module_name, *args, **kwargs)


def _otlp_value(v) -> dict:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}  # OTLP JSON writes 64-bit ints as strings
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    return {"arrayValue": {"values": [_otlp_value(x) for x in v]}}


def _otlp_attributes(attrs) -> list[dict]:
    return [{"key": k, "value": _otlp_value(v)} for k, v in (attrs or {}).items()]


def _from_otlp_value(v: dict):
    if "arrayValue" in v:
        return [_from_otlp_value(x) for x in v["arrayValue"].get("values", [])]
    if "intValue" in v:
        return int(v["intValue"])
    for k in ("stringValue", "boolValue", "doubleValue"):
        if k in v:
            return v[k]
    return None


def otlp_json(spans: Sequence[ReadableSpan]) -> dict:
    """An OTLP ExportTraceServiceRequest in its JSON form (hex ids, as the Collector's file exporter writes)."""
    by_resource: dict = {}
    for s in spans:
        scope = s.instrumentation_scope.name if s.instrumentation_scope else ""
        by_resource.setdefault(id(s.resource), (s.resource, {}))[1].setdefault(scope, []).append(s)
    out = []
    for resource, scopes in by_resource.values():
        scope_spans = []
        for scope, group in scopes.items():
            encoded = []
            for s in group:
                ctx = s.get_span_context()
                span = {"traceId": f"{ctx.trace_id:032x}", "spanId": f"{ctx.span_id:016x}", "name": s.name,
                        "kind": s.kind.value + 1,  # OTLP counts from UNSPECIFIED = 0
                        "startTimeUnixNano": str(s.start_time), "endTimeUnixNano": str(s.end_time),
                        "attributes": _otlp_attributes(s.attributes),
                        "status": {"code": s.status.status_code.value}}
                if s.parent is not None:
                    span["parentSpanId"] = f"{s.parent.span_id:016x}"
                if s.status.description:
                    span["status"]["message"] = s.status.description
                encoded.append(span)
            scope_spans.append({"scope": {"name": scope}, "spans": encoded})
        out.append({"resource": {"attributes": _otlp_attributes(resource.attributes)}, "scopeSpans": scope_spans})
    return {"resourceSpans": out}


class OtlpJsonLinesSpanExporter(SpanExporter):
    """Appends one OTLP JSON request per export batch to a file (the OTel Collector's file format)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        line = json.dumps(otlp_json(spans), separators=(",", ":")) + "\n"
        with self._lock:  # one locked write per batch: concurrent processes append whole lines
            append_line(self.path, line, trace_cap())
        return SpanExportResult.SUCCESS


_STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}
_KIND = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}


def read_spans(path: str | os.PathLike) -> list[dict]:
    """Every span in an OTLP JSON lines file, flattened: trace_id, span_id, parent_id, name, service,
    kind, start_ns, end_ns, attributes, status, message. A line that does not parse (a writer killed
    mid-line) is skipped."""
    out = []
    p = Path(path).expanduser()
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            request = json.loads(line)
        except ValueError:
            continue
        for rs in request.get("resourceSpans", []):
            resource = {a["key"]: _from_otlp_value(a["value"]) for a in rs.get("resource", {}).get("attributes", [])}
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    out.append({"trace_id": s["traceId"], "span_id": s["spanId"], "parent_id": s.get("parentSpanId"),
                                "name": s["name"], "service": resource.get("service.name", ""),
                                "kind": _KIND.get(s.get("kind", 1), "INTERNAL"),
                                "start_ns": int(s["startTimeUnixNano"]), "end_ns": int(s["endTimeUnixNano"]),
                                "attributes": {a["key"]: _from_otlp_value(a["value"])
                                               for a in s.get("attributes", [])},
                                "status": _STATUS.get(s.get("status", {}).get("code", 0), "UNSET"),
                                "message": s.get("status", {}).get("message", "")})
    return out


def setup_tracing(service_name: str = "kiln", exporter: Optional[SpanExporter] = None) -> None:
    """Install the process's tracer provider once; later calls only add `exporter`."""
    global _configured
    with _lock:
        provider = trace.get_tracer_provider()
        if not _configured or not isinstance(provider, TracerProvider):
            provider = _Provider(resource=Resource.create({"service.name": service_name}))
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
    return OtlpJsonLinesSpanExporter(trace_file())


@contextlib.contextmanager
def span(name: str, **attributes) -> Iterator[trace.Span]:
    with _TRACER.start_as_current_span(name) as s:
        for k, v in attributes.items():
            s.set_attribute(k, v)
        yield s


def start_span(name: str, **attributes) -> trace.Span:
    """A child of the current span that the caller ends itself (for spans that overlap)."""
    return _TRACER.start_span(name, attributes=attributes)


_NO_SPAN = contextlib.nullcontext(trace.INVALID_SPAN)


def child_span(name: str, **attributes) -> contextlib.AbstractContextManager:
    """A span only inside a recorded trace (a gRPC request, a traced caller): hot paths such as
    each run of a compiled program cost nothing when nobody traces them (a span is ~30 µs; the
    context manager returned untraced is one shared nullcontext)."""
    if not trace.get_current_span().is_recording():
        return _NO_SPAN
    return span(name, **attributes)


def untraced() -> contextlib.AbstractContextManager:
    """No child spans inside (timing loops: a span's cost would be timed with the work)."""
    return trace.use_span(trace.INVALID_SPAN, end_on_exit=False)


def current_span() -> trace.Span:
    return trace.get_current_span()


def grpc_server_interceptors() -> list:
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor()]


def instrument_channel(channel):
    """A channel that opens a client span per call and sends W3C trace context in metadata."""
    from opentelemetry.instrumentation.grpc import client_interceptor, grpcext

    return grpcext.intercept_channel(channel, client_interceptor())
