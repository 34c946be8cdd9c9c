"""`kiln trace`: a recorded trace as a tree with durations, or as a self-contained HTML timeline.

Reads the spans `kiln.core.telemetry.read_spans` returns (the local OTLP JSON lines file).
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from typing import Optional

from kiln.core.errors import NotFound

# attributes worth a column in the tree, besides every kiln.* one
_EXTRA_KEYS = ("rpc.method", "rpc.grpc.status_code")
GROUP_AT = 3  # this many same-named siblings without kiln attributes print as one line


@dataclass
class SpanNode:
    span: dict
    children: list["SpanNode"] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.span["end_ns"] - self.span["start_ns"]) / 1e6


def traces(spans: list[dict]) -> list[dict]:
    """One summary per trace, oldest first: id, root name, start, duration, span count, services."""
    by_trace: dict[str, list[dict]] = {}
    for s in spans:
        by_trace.setdefault(s["trace_id"], []).append(s)
    out = []
    for tid, group in by_trace.items():
        roots = forest(group)
        start = min(s["start_ns"] for s in group)
        end = max(s["end_ns"] for s in group)
        out.append({"trace_id": tid, "root": roots[0].span["name"], "start_ns": start, "ms": (end - start) / 1e6,
                    "spans": len(group), "services": sorted({s["service"] for s in group if s["service"]})})
    return sorted(out, key=lambda t: t["start_ns"])


def select(spans: list[dict], trace_id: Optional[str]) -> list[dict]:
    """The spans of one trace: the one whose id starts with `trace_id`, or the latest when None."""
    summaries = traces(spans)
    if not summaries:
        raise NotFound("no traces recorded (KILN_TRACE_FILE is empty or missing)")
    if trace_id is None:
        tid = summaries[-1]["trace_id"]
    else:
        matches = [t["trace_id"] for t in summaries if t["trace_id"].startswith(trace_id.lower())]
        if not matches:
            raise NotFound(f"no trace {trace_id!r} among {len(summaries)} recorded")
        if len(matches) > 1:
            raise NotFound(f"trace id prefix {trace_id!r} is ambiguous: {len(matches)} traces match")
        tid = matches[0]
    return [s for s in spans if s["trace_id"] == tid]


def forest(spans: list[dict]) -> list[SpanNode]:
    """Spans as trees by parent id; a span whose parent is not recorded is a root. Children by start."""
    nodes = {s["span_id"]: SpanNode(s) for s in spans}
    roots = []
    for n in nodes.values():
        parent = nodes.get(n.span["parent_id"]) if n.span["parent_id"] else None
        (parent.children if parent is not None and parent is not n else roots).append(n)
    for n in nodes.values():
        n.children.sort(key=lambda c: c.span["start_ns"])
    roots.sort(key=lambda c: c.span["start_ns"])
    return roots


_DIGEST = re.compile(r"^([0-9a-f]{64})(/-?\d+)?$")


def _short(v) -> str:
    text = str(v) if not isinstance(v, list) else ",".join(map(str, v))
    if _DIGEST.match(text):
        return text[:12]  # a digest: its prefix is enough to find it with `kiln show`
    if isinstance(v, float):
        return f"{v:.4g}"
    return text if len(text) <= 60 else text[:57] + "..."


def _runs(children: list[SpanNode]) -> list[list[SpanNode]]:
    """Consecutive siblings grouped by name (libraries' own spans repeat by the hundred)."""
    out: list[list[SpanNode]] = []
    for c in children:
        if out and out[-1][0].span["name"] == c.span["name"]:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def key_attributes(span: dict) -> dict:
    return {k: v for k, v in span["attributes"].items() if k.startswith("kiln.") or k in _EXTRA_KEYS}


def render_tree(spans: list[dict]) -> str:
    """The trace as an indented tree: name, service, duration, status and key attributes per span."""
    lines = []
    roots = forest(spans)
    t = traces(spans)[0]
    lines.append(f"trace {t['trace_id']}  {t['ms']:.1f} ms  {t['spans']} spans  {', '.join(t['services'])}")

    def walk(run: list[SpanNode], prefix: str, last: bool, top: bool) -> None:
        node, s = run[0], run[0].span
        branch = "" if top else ("└─ " if last else "├─ ")
        if len(run) >= GROUP_AT and not any(key_attributes(n.span) for n in run):
            total = sum(n.ms for n in run)
            lines.append(f"{prefix}{branch}{s['name']} ×{len(run)}  [{s['service']}]  {total:.2f} ms in all, "
                         f"longest {max(n.ms for n in run):.2f} ms")
            return
        child_prefix = prefix if top else prefix + ("   " if last else "│  ")
        for j, node in enumerate(run):
            s = node.span
            attrs = " ".join(f"{k.removeprefix('kiln.')}={_short(v)}" for k, v in key_attributes(s).items())
            status = f"  {s['status']}: {s['message']}" if s["status"] == "ERROR" else ""
            end = last and j == len(run) - 1
            branch = "" if top else ("└─ " if end else "├─ ")
            lines.append(f"{prefix}{branch}{s['name']}  [{s['service']}]  {node.ms:.2f} ms{status}"
                         + (f"  {attrs}" if attrs else ""))
            child_prefix = prefix if top else prefix + ("   " if end else "│  ")
            runs = _runs(node.children)
            for i, r in enumerate(runs):
                walk(r, child_prefix, i == len(runs) - 1, False)

    for r in roots:
        walk([r], "", True, True)
    return "\n".join(lines)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kiln trace {title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 16px; }}
#timeline {{ border-top: 1px solid #ccc; }}
.row {{ display: flex; align-items: center; border-bottom: 1px solid #eee; height: 22px; }}
.label {{ width: 38%; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }}
.lane {{ position: relative; flex: 1; height: 14px; }}
.bar {{ position: absolute; height: 14px; min-width: 1px; border-radius: 2px; }}
.ms {{ width: 90px; text-align: right; font-variant-numeric: tabular-nums; }}
.ERROR .label {{ color: #b00; }}
#detail {{ white-space: pre-wrap; font-family: monospace; margin-top: 12px; }}
</style></head>
<body>
<h1 id="summary"></h1>
<div id="timeline"></div>
<div id="detail">Click a span to see its attributes.</div>
<script type="application/json" id="spans">{data}</script>
<script>
(function () {{
  const spans = JSON.parse(document.getElementById("spans").textContent);
  const byId = new Map(spans.map(s => [s.span_id, Object.assign(s, {{children: []}})]));
  const roots = [];
  for (const s of spans) {{
    const p = s.parent_id && byId.get(s.parent_id);
    (p && p !== s ? p.children : roots).push(s);
  }}
  const byStart = (a, b) => a.start_ns - b.start_ns;
  const t0 = Math.min(...spans.map(s => s.start_ns));
  const t1 = Math.max(...spans.map(s => s.end_ns));
  const total = Math.max(t1 - t0, 1);
  const services = [...new Set(spans.map(s => s.service))].sort();
  const colour = svc => "hsl(" + (services.indexOf(svc) * 67 % 360) + ", 55%, 55%)";
  document.getElementById("summary").textContent =
    "trace " + spans[0].trace_id + " \\u2014 " + ((t1 - t0) / 1e6).toFixed(1) + " ms, " + spans.length + " spans";
  const timeline = document.getElementById("timeline");
  function add(s, depth) {{
    const row = document.createElement("div");
    row.className = "row " + s.status;
    row.dataset.span = s.span_id;
    const label = document.createElement("div");
    label.className = "label";
    label.style.paddingLeft = (depth * 14) + "px";
    label.textContent = s.name + " [" + s.service + "]";
    const lane = document.createElement("div");
    lane.className = "lane";
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.left = ((s.start_ns - t0) / total * 100).toFixed(3) + "%";
    bar.style.width = ((s.end_ns - s.start_ns) / total * 100).toFixed(3) + "%";
    bar.style.background = colour(s.service);
    lane.appendChild(bar);
    const ms = document.createElement("div");
    ms.className = "ms";
    ms.textContent = ((s.end_ns - s.start_ns) / 1e6).toFixed(2) + " ms";
    row.append(label, lane, ms);
    row.title = Object.entries(s.attributes).map(([k, v]) => k + " = " + v).join("\\n");
    row.onclick = () => {{ document.getElementById("detail").textContent = s.name + "\\n" + row.title; }};
    timeline.appendChild(row);
    s.children.sort(byStart).forEach(c => add(c, depth + 1));
  }}
  roots.sort(byStart).forEach(r => add(r, 0));
}})();
</script>
</body></html>
"""


def render_html(spans: list[dict]) -> str:
    """A self-contained page (no external resources): one row per span, bars on a shared time axis."""
    data = json.dumps(spans).replace("<", "\\u003c")  # nothing in the data can close the script element
    return _PAGE.format(title=html.escape(spans[0]["trace_id"]), data=data)
