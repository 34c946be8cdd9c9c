"""The layers of the code, checked: no import cycle among the project's modules, and no import
from a lower layer up into a higher one (docs/architecture.md draws the same picture)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kiln", "importer_svc", "optimizer_svc", "codegen_svc", "executor_svc")
STAGES = PACKAGES[1:]

# (module prefix, rank): a module may import only modules of its own rank or lower
LAYERS = [
    ("kiln.v1", 0), ("kiln.core", 1), ("kiln.ir", 2), ("kiln.cas", 2), ("kiln.runtime", 3),
    ("kiln.rpc", 4), *((s, 5) for s in STAGES), ("kiln.apps", 7), ("kiln.__main__", 7), ("kiln", 6),
]
FOUNDATION = 3  # ranks up to here: the IR, storage, runtime support; nothing above them


def rank(module: str) -> int:
    for prefix, r in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return r
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and to docs/architecture.md")


def project_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).with_suffix("")
            if "v1" in rel.parts:  # generated protobuf code
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def imports(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports, anywhere in it (function-local imports count)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = project_modules()
    g = {m: imports(p, m, {**known, "kiln.v1": None}) for m, p in known.items()}
    g["kiln.v1"] = set()  # generated from protos/, imports nothing of ours
    return g


def test_every_module_is_in_a_layer():
    for m in graph():
        rank(m)


def test_no_import_goes_up_a_layer():
    bad = [f"{m} (rank {rank(m)}) imports {t} (rank {rank(t)})"
           for m, targets in graph().items() for t in targets if rank(t) > rank(m)]
    assert not bad, "\n".join(sorted(bad))


def test_stages_import_no_other_stage_and_their_logic_no_grpc():
    bad = []
    for m, targets in graph().items():
        stage = m.split(".")[0]
        if stage not in STAGES:
            continue
        bad += [f"{m} imports {t}" for t in targets if t.split(".")[0] in STAGES and t.split(".")[0] != stage]
        if not m.endswith(".server"):
            bad += [f"{m} (stage logic) imports {t}" for t in targets if t.startswith("kiln.rpc")]
            text = project_modules()[m].read_text()
            if "import grpc" in text or "from grpc" in text:
                bad.append(f"{m} (stage logic) imports grpc")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in sorted(g[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(cycles)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a planted cycle and a planted upward import are found."""
    g = {"kiln.ir.a": {"kiln.ir.b"}, "kiln.ir.b": {"kiln.ir.a"}, "kiln.cas.c": {"kiln.apps.cli"},
         "kiln.apps.cli": set()}
    import sys

    here = sys.modules[__name__]
    monkeypatch.setattr(here, "graph", lambda: g)
    import pytest

    with pytest.raises(AssertionError, match="kiln.ir.a -> kiln.ir.b -> kiln.ir.a"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="kiln.cas.c .rank 2. imports kiln.apps.cli"):
        test_no_import_goes_up_a_layer()
