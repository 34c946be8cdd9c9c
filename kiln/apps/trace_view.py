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


@dataclass
class Row:
    """One line of a trace as the tree and the HTML timeline show it: a span with its children's
    rows, or a run of GROUP_AT or more same-named siblings without kiln attributes folded into one."""
    spans: list[SpanNode]
    children: list["Row"] = field(default_factory=list)

    @property
    def folded(self) -> bool:
        return len(self.spans) > 1

    @property
    def span(self) -> dict:
        return self.spans[0].span


def rows(spans: list[dict]) -> list[Row]:
    """The trace's roots as rows, runs of library spans folded."""
    def of(run: list[SpanNode]) -> list[Row]:
        if len(run) >= GROUP_AT and not any(key_attributes(n.span) for n in run):
            return [Row(run)]
        return [Row([n], [r for c in _runs(n.children) for r in of(c)]) for n in run]

    return [r for root in forest(spans) for r in of([root])]


def _attr_text(span: dict) -> str:
    return " ".join(f"{k.removeprefix('kiln.')}={_short(v)}" for k, v in key_attributes(span).items())


def _row_text(row: Row) -> str:
    s = row.span
    if row.folded:
        return (f"{s['name']} ×{len(row.spans)}  [{s['service']}]  {sum(n.ms for n in row.spans):.2f} ms in all, "
                f"longest {max(n.ms for n in row.spans):.2f} ms")
    attrs = _attr_text(s)
    status = f"  {s['status']}: {s['message']}" if s["status"] == "ERROR" else ""
    return f"{s['name']}  [{s['service']}]  {row.spans[0].ms:.2f} ms{status}" + (f"  {attrs}" if attrs else "")


def render_tree(spans: list[dict]) -> str:
    """The trace as an indented tree: name, service, duration, status and key attributes per span."""
    t = traces(spans)[0]
    lines = [f"trace {t['trace_id']}  {t['ms']:.1f} ms  {t['spans']} spans  {', '.join(t['services'])}"]

    def walk(row: Row, prefix: str, branch: str, child_prefix: str) -> None:
        lines.append(prefix + branch + _row_text(row))
        for i, c in enumerate(row.children):
            last = i == len(row.children) - 1
            walk(c, child_prefix, "└─ " if last else "├─ ", child_prefix + ("   " if last else "│  "))

    for r in rows(spans):
        walk(r, "", "", "")
    return "\n".join(lines)


def _row_json(row: Row, t0: int) -> dict:
    """A row for the page's script: times in ns from the trace's start; a folded run's members
    (or a span's children) as the segments drawn inside its bar."""
    s = row.span
    start = min(n.span["start_ns"] for n in row.spans) - t0
    end = max(n.span["end_ns"] for n in row.spans) - t0
    inner = row.spans if row.folded else row.spans[0].children
    out = {"id": s["span_id"], "name": s["name"], "service": s["service"], "status": s["status"],
           "start": start, "end": end, "ms": round(sum(n.ms for n in row.spans), 6),
           "segments": [[n.span["start_ns"] - t0, n.span["end_ns"] - t0] for n in inner],
           "attrs": _attr_text(s),
           "children": [_row_json(c, t0) for c in row.children]}
    if row.folded:
        out["count"] = len(row.spans)
        out["longest_ms"] = round(max(n.ms for n in row.spans), 6)
        out["detail"] = {"spans": len(row.spans), "first span": s["span_id"]}
    else:
        out["detail"] = dict(s["attributes"], **({"status": f"{s['status']}: {s['message']}"}
                                                 if s["status"] == "ERROR" else {}))
    return out


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kiln trace {title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 16px; margin: 0 0 4px; }}
#help {{ color: #666; margin-bottom: 8px; }}
.row {{ display: flex; align-items: center; border-bottom: 1px solid #eee; height: 22px; cursor: default; }}
.row:hover {{ background: #f4f7fb; }}
.row.selected {{ background: #e3ecf7; }}
.label {{ box-sizing: border-box; flex: none; width: 30%; min-width: 240px; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }}
.toggle {{ display: inline-block; width: 14px; color: #555; cursor: pointer; user-select: none; }}
.lane {{ position: relative; flex: 1; height: 14px; }}
.axis .lane {{ height: 20px; border-bottom: 1px solid #999; }}
.tick {{ position: absolute; bottom: 0; height: 6px; border-left: 1px solid #999; }}
.ticklabel {{ position: absolute; bottom: 7px; transform: translateX(-50%); font-size: 11px; color: #555;
             white-space: nowrap; }}
.grid {{ position: absolute; top: -4px; bottom: -4px; border-left: 1px dotted #ddd; }}
.bar {{ position: absolute; top: 0; height: 14px; min-width: 1px; border-radius: 2px; overflow: hidden; }}
.seg {{ position: absolute; top: 3px; height: 8px; min-width: 1px; background: rgba(0, 0, 0, .28); }}
.ms {{ flex: none; width: 96px; text-align: right; font-variant-numeric: tabular-nums; padding-right: 8px; }}
.attrs {{ flex: none; width: 26%; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; color: #555;
         font-family: monospace; font-size: 11px; }}
.ERROR .label, .ERROR .attrs {{ color: #b00; }}
.axis {{ position: sticky; top: 0; background: #fff; z-index: 1; }}
#detail {{ white-space: pre-wrap; font-family: monospace; margin-top: 12px; }}
</style></head>
<body>
<h1 id="summary"></h1>
<div id="help">Bars share the time axis; the dark marks inside a bar are its children (or, on a folded
row, each span of the run). Click &#9662; to fold a subtree, a row for all its attributes;
#depth=N in the address opens with rows deeper than N folded.</div>
<div id="timeline"></div>
<div id="detail">Click a row to see its attributes.</div>
<script type="application/json" id="rows">{data}</script>
<script>
(function () {{
  const data = JSON.parse(document.getElementById("rows").textContent);
  const total = Math.max(data.total_ns, 1);
  const services = data.services;
  const colour = svc => "hsl(" + (services.indexOf(svc) * 67 % 360) + ", 55%, 62%)";
  const pct = ns => (ns / total * 100).toFixed(3) + "%";
  const fmt = ns => ns >= 1e9 ? (ns / 1e9).toPrecision(3) + " s" : (ns / 1e6).toPrecision(3) + " ms";
  // a tick's label: in the unit of the step, with as many decimals as the step needs
  const tickText = (ns, step) => {{
    if (ns === 0) return "0";
    const [unit, scale] = step >= 1e9 ? ["s", 1e9] : step >= 1e6 ? ["ms", 1e6] : ["\\u00b5s", 1e3];
    const decimals = Math.max(0, -Math.floor(Math.log10(step / scale) + 1e-9));
    return (ns / scale).toFixed(decimals) + " " + unit;
  }};
  document.getElementById("summary").textContent =
    "trace " + data.trace_id + " \\u2014 " + (data.total_ns / 1e6).toFixed(1) + " ms, " + data.spans + " spans"
    + (data.bundle ? ", bundle " + data.bundle.slice(0, 12) : "");
  // ticks: the step of 1, 2 or 5 times a power of ten that gives at most 10 of them
  let step = Math.pow(10, Math.floor(Math.log10(total / 10)));
  for (const m of [1, 2, 5, 10]) {{ if (total / (step * m) <= 10) {{ step *= m; break; }} }}
  const ticks = [];
  for (let t = 0; t <= total + 1; t += step) ticks.push(t);
  // a div of this class, at this position on the lane when given one
  const div = (cls, left) => {{
    const d = document.createElement("div");
    d.className = cls;
    if (left !== undefined) d.style.left = left;
    return d;
  }};
  const timeline = document.getElementById("timeline");
  const axis = div("row axis");
  const axisLane = div("lane");
  for (const t of ticks) {{
    const label = div("ticklabel", pct(t));
    label.textContent = tickText(t, step);
    axisLane.append(div("tick", pct(t)), label);
  }}
  axis.append(div("label"), axisLane, div("ms"), div("attrs"));
  timeline.appendChild(axis);
  const maxDepth = parseInt((location.hash.match(/depth=(\\d+)/) || [])[1] || "1000", 10);
  const detail = document.getElementById("detail");
  let selected = null;
  function add(r, depth, parentRows) {{
    const row = div("row " + r.status);
    row.dataset.span = r.id;
    row.dataset.depth = depth;
    if (r.count) row.dataset.count = r.count;
    const label = div("label");
    label.style.paddingLeft = (depth * 14) + "px";
    const toggle = document.createElement("span");
    toggle.className = "toggle";
    const name = document.createElement("span");
    name.className = "name";
    name.textContent = r.name + (r.count ? " \\u00d7" + r.count : "") + " [" + r.service + "]";
    label.append(toggle, name);
    const lane = div("lane");
    for (const t of ticks) lane.appendChild(div("grid", pct(t)));
    const bar = div("bar", pct(r.start));
    bar.style.width = pct(r.end - r.start);
    bar.style.background = colour(r.service);
    const span = Math.max(r.end - r.start, 1);
    for (const [a, b] of r.segments) {{  // inside the parent's bar, in its own coordinates
      const seg = div("seg", ((a - r.start) / span * 100).toFixed(3) + "%");
      seg.style.width = ((b - a) / span * 100).toFixed(3) + "%";
      bar.appendChild(seg);
    }}
    lane.appendChild(bar);
    const ms = div("ms");
    ms.textContent = r.ms.toFixed(2) + " ms";
    const attrs = div("attrs");
    attrs.textContent = r.count ? "longest " + r.longest_ms.toFixed(2) + " ms" : r.attrs;
    row.append(label, lane, ms, attrs);
    const text = Object.entries(r.detail).map(([k, v]) => k + " = " + v).join("\\n");
    row.onclick = () => {{
      if (selected) selected.classList.remove("selected");
      (selected = row).classList.add("selected");
      detail.textContent = r.name + (r.count ? " \\u00d7" + r.count : "") + "  " + fmt(r.end - r.start) + "\\n" + text;
    }};
    timeline.appendChild(row);
    const below = [];
    r.children.forEach(c => add(c, depth + 1, below));
    parentRows.push(row, ...below);
    if (below.length) {{
      // a row is shown while no row above it is folded: hiddenBy names the folded ones
      const setOpen = open => {{
        for (const b of below) {{
          const by = new Set((b.dataset.hiddenBy || "").split(" ").filter(Boolean));
          open ? by.delete(r.id) : by.add(r.id);
          if (by.size) b.dataset.hiddenBy = [...by].join(" "); else delete b.dataset.hiddenBy;
          b.style.display = by.size ? "none" : "";
        }}
        toggle.textContent = open ? "\\u25be" : "\\u25b8";
        toggle.onclick = e => {{ e.stopPropagation(); setOpen(!open); }};
      }};
      setOpen(depth < maxDepth);
    }}
  }}
  const top = [];
  data.rows.forEach(r => add(r, 0, top));
}})();
</script>
</body></html>
"""


def render_html(spans: list[dict]) -> str:
    """A self-contained page (no external resources): the rows of render_tree (library runs
    folded) as bars on a time axis, each drawing its children inside it, subtrees foldable,
    attributes beside each row."""
    t = traces(spans)[0]
    top = rows(spans)
    root = top[0].span if top else {"attributes": {}}
    data = {"trace_id": t["trace_id"], "total_ns": max(x["end_ns"] for x in spans) - t["start_ns"], "spans": t["spans"],
            "services": t["services"], "bundle": root["attributes"].get("kiln.bundle", ""),
            "rows": [_row_json(r, t["start_ns"]) for r in top]}
    text = json.dumps(data).replace("<", "\\u003c")  # nothing in the data can close the script element
    return _PAGE.format(title=html.escape(t["trace_id"]), data=text)
