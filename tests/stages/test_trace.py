"""Traces: OTLP JSON lines export, `kiln trace` as a tree and as an HTML timeline (read back in
headless Chromium, Debian's package, which `make test` installs)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.apps import trace_view
from kiln.apps.cli import main as cli_main
from kiln.core.errors import NotFound
from kiln.core.telemetry import otlp_json, read_spans

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class OddMLP(torch.nn.Module):
    """Shapes no other test compiles, so this compile misses the action cache and searches."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(23, 41)
        self.b = torch.nn.Linear(41, 7)

    def forward(self, x):
        return torch.softmax(self.b(torch.relu(self.a(x))), dim=-1)


@pytest.fixture(scope="module")
def traced(services, span_exporter, tmp_path_factory):
    """A remote compile (two timed candidates) and a call, exported to an OTLP JSON lines file."""
    from kiln.pipeline import Pipeline

    store, addrs = services
    span_exporter.clear()
    torch.manual_seed(0)
    x = torch.randn(5, 23)
    compiled = kiln.compile(OddMLP(), (x,), pipeline=Pipeline(store, addrs), candidates=2)
    compiled(x)
    spans = span_exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "kiln.compile")
    mine = [s for s in spans if s.context.trace_id == root.context.trace_id]
    path = tmp_path_factory.mktemp("trace") / "traces.jsonl"
    half = len(mine) // 2  # two export batches, as a batching processor writes them
    path.write_text(json.dumps(otlp_json(mine[:half])) + "\n" + json.dumps(otlp_json(mine[half:])) + "\n"
                    + '{"resourceSpans": [{"scopeSp')  # a writer killed mid-line
    return compiled, mine, path


def test_otlp_json_lines_round_trip_every_span(traced):
    _, mine, path = traced
    line = json.loads(path.read_text().splitlines()[0])
    otlp = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert re.fullmatch(r"[0-9a-f]{32}", otlp["traceId"]) and re.fullmatch(r"[0-9a-f]{16}", otlp["spanId"])
    assert otlp["startTimeUnixNano"].isdigit() and otlp["kind"] in (1, 2, 3)
    read = {s["span_id"]: s for s in read_spans(path)}
    assert len(read) == len(mine)
    for s in mine:
        r = read[f"{s.context.span_id:016x}"]
        assert r["name"] == s.name
        assert r["parent_id"] == (f"{s.parent.span_id:016x}" if s.parent else None)
        assert (r["start_ns"], r["end_ns"]) == (s.start_time, s.end_time)
        for k, v in (s.attributes or {}).items():
            assert r["attributes"][k] == (list(v) if isinstance(v, tuple) else v), (s.name, k)


def test_trace_spans_cover_iterations_candidates_kernels_and_runs(traced):
    compiled, mine, path = traced
    spans = read_spans(path)
    names = [s["name"] for s in spans]
    for name in ("importer.Import", "optimizer.Optimize", "codegen.Emit", "executor.Load"):
        assert name in names, name
    iterations = [s for s in spans if s["name"] == "optimizer.iteration"]
    assert iterations and all(s["attributes"]["kiln.enodes"] > 0 and "kiln.eclasses" in s["attributes"]
                              and "kiln.rules_fired" in s["attributes"] for s in iterations)
    report = compiled.result.report
    candidates = {s["attributes"]["kiln.candidate"]: s for s in spans if s["name"] == "executor.candidate"}
    assert len(candidates) == len(report.candidates) == 2
    for i, c in enumerate(report.candidates):
        assert candidates[i]["attributes"]["kiln.median_ms"] == pytest.approx(c.measured_s * 1e3)
    # the chosen bundle's emit span links its kernels
    emits = [s for s in spans if s["name"] == "codegen.Emit" and s["attributes"].get("kiln.bundle")
             == str(compiled.result.bundle)]
    assert emits, "no Emit span names the chosen bundle"
    emit = next(s for s in spans if s["name"] == "codegen.emit" and s["parent_id"] == emits[0]["span_id"])
    kernels = [s for s in spans if s["name"] == "codegen.kernel" and s["parent_id"] == emit["span_id"]]
    assert len(kernels) == compiled.result.kernels
    assert all(re.fullmatch(r"[0-9a-f]{64}/\d+", k["attributes"]["kiln.source"]) for k in kernels)


def test_library_spans_are_left_out_unless_asked_for(traced, monkeypatch):
    """egglog traces every rule registration and run itself (thousands of spans per compile, and
    a slower search under an exporter): none is recorded unless KILN_TRACE_LIBRARIES=1."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import Tracer

    _, mine, _ = traced
    assert not [s for s in mine if s.instrumentation_scope.name.startswith("egglog")]
    assert any(s.name == "optimizer.iteration" for s in mine)  # the search ran in this trace
    provider = trace.get_tracer_provider()
    assert isinstance(provider.get_tracer("egglog.egraph"), trace.NoOpTracer)
    monkeypatch.setenv("KILN_TRACE_LIBRARIES", "1")
    assert isinstance(provider.get_tracer("egglog.egraph"), Tracer)


def test_each_run_is_its_own_trace_naming_its_bundle(traced, span_exporter):
    compiled, _, _ = traced
    spans = span_exporter.get_finished_spans()
    call = next(s for s in spans if s.name == "kiln.call")
    runs = [s for s in spans if s.name == "executor.run" and s.context.trace_id == call.context.trace_id]
    assert len(runs) == 1 and runs[0].attributes["kiln.bundle"] == str(compiled.result.bundle)
    assert any(s.name == "executor.Run" and s.context.trace_id == call.context.trace_id for s in spans)


def test_kiln_trace_prints_the_tree_with_durations(traced, capsys):
    _, mine, path = traced
    assert cli_main(["trace", "--file", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    root = next(s for s in mine if s.name == "kiln.compile")
    assert lines[0].startswith(f"trace {root.context.trace_id:032x}")
    assert lines[1].startswith("kiln.compile ") and f"{(root.end_time - root.start_time) / 1e6:.2f} ms" in lines[1]
    for s in mine:
        if s.name == "optimizer.iteration":  # every iteration with its e-graph size
            assert re.search(rf"optimizer\.iteration .* iteration={s.attributes['kiln.iteration']} "
                             rf"enodes={s.attributes['kiln.enodes']} ", out)
    # children are indented under their parent: Import's server span sits below the compile
    depth = {ln.split("─ ", 1)[-1].split("  ")[0]: len(ln) - len(ln.lstrip("│├└─  ")) for ln in lines[1:]}
    assert depth["importer.Import"] > depth["kiln.compile_program"] > depth["kiln.compile"]
    assert cli_main(["trace", "--file", str(path), f"{root.context.trace_id:032x}"[:10]]) == 0
    assert capsys.readouterr().out == out
    assert cli_main(["trace", "--file", str(path), "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert len(listed) == 1 and listed[0].split()[:2] == [f"{root.context.trace_id:032x}", "kiln.compile"]


def test_kiln_trace_unknown_or_missing_is_not_found(traced, tmp_path, capsys):
    _, _, path = traced
    assert cli_main(["trace", "--file", str(path), "ffffffffff"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err
    with pytest.raises(NotFound, match="no traces recorded"):
        trace_view.select(read_spans(tmp_path / "absent.jsonl"), None)


def _dom(page, profile, fragment: str = "") -> str:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={profile}", "--dump-dom", page.as_uri() + fragment],
        capture_output=True, text=True, timeout=120, check=True).stdout


_ROW = re.compile(r'<div class="row (\w+)" data-span="([0-9a-f]{16})" data-depth="(\d+)"(?: data-count="(\d+)")?'
                  r'(?: data-hidden-by="[^"]*")?(?: style="([^"]*)")?[^>]*>(.*?)(?=<div class="row |</div>\n)')


def test_html_timeline_renders_every_span_in_headless_chromium(traced, tmp_path):
    """Every span is a row, or one of a folded run of library spans; each row's bar sits on the
    time axis, with its children drawn inside it and its kiln attributes beside it; #depth=N folds
    what is deeper."""
    compiled, mine, path = traced
    page = tmp_path / "trace.html"
    assert cli_main(["trace", "--file", str(path), "--html", str(page)]) == 0
    assert "http" not in page.read_text().split("<script")[0]  # self-contained: nothing fetched
    dom = _dom(page, tmp_path / "profile")
    rows = _ROW.findall(dom)
    by_id = {f"{s.context.span_id:016x}": s for s in mine}
    children: dict[int, list] = {}
    for s in mine:
        if s.parent is not None and f"{s.parent.span_id:016x}" in by_id:
            children.setdefault(s.parent.span_id, []).append(s)
    t0 = min(s.start_time for s in mine)
    total = max(s.end_time for s in mine) - t0
    covered = 0
    for status, span_id, depth, count, style, body in rows:
        s = by_id[span_id]
        assert "display: none" not in style  # everything open by default
        label = re.search(r'<span class="name">(.*?)</span>', body).group(1)
        assert label.startswith(s.name.replace("&", "&amp;").replace("<", "&lt;") + (f" ×{count}" if count else "") + " [")
        left = float(re.search(r'class="bar" style="[^"]*left: ([\d.]+)%', body).group(1))
        assert left == pytest.approx((s.start_time - t0) / total * 100, abs=2e-3)
        shown = float(re.search(r'<div class="ms">([\d.]+) ms</div>', body).group(1))
        segments = body.count('class="seg"')
        if count:  # a folded run: that many same-named siblings in a row, one segment each
            siblings = sorted(children[s.parent.span_id], key=lambda c: c.start_time)
            i = siblings.index(s)
            run = siblings[i:i + int(count)]
            assert len(run) == int(count) >= trace_view.GROUP_AT and {c.name for c in run} == {s.name}
            assert shown == pytest.approx(sum(c.end_time - c.start_time for c in run) / 1e6, abs=0.006)
            assert segments == int(count)
            covered += int(count)
        else:
            assert shown == pytest.approx((s.end_time - s.start_time) / 1e6, abs=0.006)  # toFixed(2)
            assert segments == len(children.get(s.context.span_id, []))
            attrs = re.search(r'<div class="attrs">(.*?)</div>', body).group(1)
            for k, v in s.attributes.items():
                if k.startswith("kiln.") and not isinstance(v, (tuple, float)):
                    assert f"{k.removeprefix('kiln.')}={trace_view._short(v)}" in attrs
            covered += 1
    assert covered == len(mine), "every span is drawn, as its own row or in a folded run"
    root = next(s for s in mine if s.name == "kiln.compile")
    assert rows[0][1] == f"{root.context.span_id:016x}"  # the root comes first, the whole width
    assert rows[0][2] == "0" and 'class="seg"' in rows[0][5]
    assert re.search(r'<h1 id="summary">trace [0-9a-f]{32} — [\d.]+ ms, %d spans, bundle %s</h1>'
                     % (len(mine), compiled.result.bundle.hash[:12]), dom)
    ticks = re.findall(r'<div class="ticklabel" style="left: ([\d.]+)%;">(0|([\d.]+) (µs|ms|s))</div>', dom)
    assert 2 <= len(ticks) <= 11 and ticks[0][1] == "0" and float(ticks[0][0]) == 0
    for left, _, value, unit in ticks[1:]:  # each label where its time falls on the axis
        ns = float(value) * {"µs": 1e3, "ms": 1e6, "s": 1e9}[unit]
        assert float(left) <= 100 and float(left) == pytest.approx(ns / total * 100, abs=0.01)
    folded = _ROW.findall(_dom(page, tmp_path / "profile", "#depth=1"))
    assert [r[1] for r in folded] == [r[1] for r in rows]
    assert all(("display: none" in r[4]) == (int(r[2]) > 1) for r in folded)


def test_compile_spans_name_the_chosen_bundle(traced):
    """Two candidates were emitted and timed: the compile's own spans name the one it kept."""
    compiled, mine, _ = traced
    for name in ("kiln.compile", "kiln.compile_program"):
        s = next(s for s in mine if s.name == name)
        assert s.attributes["kiln.bundle"] == str(compiled.result.bundle), name


def test_kiln_trace_into_a_closed_pipe_exits_quietly(traced):
    """`kiln trace | head`: the reader goes away before the tree is written; no traceback."""
    _, _, path = traced
    p = subprocess.Popen([sys.executable, "-m", "kiln", "trace", "--file", str(path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the child has imported kiln, so its first write finds no reader
    err = p.stderr.read()
    assert p.wait(120) == 0 and err == b"", err.decode()
