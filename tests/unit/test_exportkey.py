"""kiln.exportkey: the key under which an exported program is recorded changes with everything
the export reads (weights, attributes, configs, input shapes, dynamic shapes, the source of the
model's code and of what that code calls) and with nothing else; a compile that finds its key
skips the export and computes what eager computes, and a changed model is exported again."""

import importlib
import sys
import threading

import torch

import kiln
import kiln.pipeline as kiln_pipeline
from helpers import Fn
from kiln.exportkey import export_key
from kiln.pipeline import Pipeline


class _Net(torch.nn.Module):
    def __init__(self, scale: float = 2.0):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.scale = scale
        self.register_buffer("shift", torch.zeros(4), persistent=False)

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale + self.shift


def _key(m, x, dynamic=None, **options):
    return export_key(m, (x,), None, dynamic, {"entry": "test", **options}, code=(kiln_pipeline,))


def test_the_key_follows_what_the_export_reads():
    torch.manual_seed(0)
    m, x = _Net(), torch.randn(3, 8)
    k = _key(m, x)
    assert k is not None and k == _key(m, torch.randn(3, 8))  # values of inputs are never read
    torch.manual_seed(0)
    assert _key(_Net(), x) == k  # an equal model built again: the same key
    changed = []
    with torch.no_grad():
        m.fc.weight[0, 0] += 1
    changed.append(_key(m, x))
    m.scale = 3.0
    changed.append(_key(m, x))
    m.shift[0] = 1.0  # a non-persistent buffer is read by the forward too
    changed.append(_key(m, x))
    changed.append(_key(m, torch.randn(5, 8)))
    changed.append(_key(m, torch.randn(5, 8, dtype=torch.float64)))
    changed.append(_key(m, torch.randn(5, 8), dynamic=({0: torch.export.Dim("b", max=64)},)))
    changed.append(_key(m, torch.randn(5, 8), dynamic=({0: torch.export.Dim("b", max=32)},)))
    changed.append(_key(m, torch.randn(5, 8), dynamic=({0: torch.export.Dim("b", max=32)},), max_batch=4))
    m.eval()  # built in training mode
    changed.append(_key(m, torch.randn(5, 8), dynamic=({0: torch.export.Dim("b", max=32)},), max_batch=4))
    same = [(i, j) for i, a in enumerate([k, *changed]) for j, b in enumerate([k, *changed]) if i < j and a == b]
    assert None not in changed and not same, same


def test_the_key_follows_the_source_of_the_code_the_model_calls(tmp_path, monkeypatch):
    (tmp_path / "kiln_test_helper.py").write_text("def act(x):\n    return x * 2\n")
    (tmp_path / "kiln_test_model.py").write_text(
        "import torch\nfrom kiln_test_helper import act\n\n"
        "class M(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 4)\n\n    def forward(self, x):\n        return act(self.fc(x))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        model = importlib.import_module("kiln_test_model").M()
        x = torch.randn(2, 4)
        before = _key(model, x)
        assert before is not None and _key(model, x) == before
        # the helper's file changed (a module imported by the model's module): a new key
        (tmp_path / "kiln_test_helper.py").write_text("def act(x):\n    return x * 3\n")
        assert _key(model, x) != before
    finally:
        sys.modules.pop("kiln_test_model", None)
        sys.modules.pop("kiln_test_helper", None)


def test_what_cannot_be_described_is_not_keyed(monkeypatch):
    m, x = _Net(), torch.randn(3, 8)
    m.lock = threading.Lock()  # no attributes to walk, no known type
    assert _key(m, x) is None
    del m.lock
    assert _key(m, x) is not None
    monkeypatch.setenv("KILN_EXPORT_CACHE", "0")
    assert _key(m, x) is None


def test_a_compile_that_finds_its_key_skips_the_export_and_a_changed_model_does_not(tmp_path, span_exporter):
    p = Pipeline(f"file://{tmp_path / 'store'}")
    torch.manual_seed(0)
    m, x = _Net(), torch.randn(3, 8)

    def compiled_export_cache(model):
        span_exporter.clear()
        c = kiln.compile(model, (x,), pipeline=p, search=False)
        (s,) = [s for s in span_exporter.get_finished_spans() if s.name == "kiln.export"]
        with torch.no_grad():
            torch.testing.assert_close(c(x), model(x), rtol=1e-5, atol=1e-6)
        return s.attributes["kiln.export_cache"], c.result.bundle

    assert compiled_export_cache(m)[0] == "miss"
    torch.manual_seed(0)
    state, bundle = compiled_export_cache(_Net())  # the same model, built again
    assert state == "hit"
    m.scale = -1.0  # a constant the program folds: a stale program would give the old outputs
    state, changed = compiled_export_cache(m)
    assert state == "miss" and changed != bundle


def test_the_cache_is_off_when_asked(tmp_path, span_exporter, monkeypatch):
    monkeypatch.setenv("KILN_EXPORT_CACHE", "off")
    p = Pipeline(f"file://{tmp_path / 'store'}")
    m, x = _Net(), torch.randn(3, 8)
    for _ in range(2):
        span_exporter.clear()
        kiln.compile(m, (x,), pipeline=p, search=False)
        (s,) = [s for s in span_exporter.get_finished_spans() if s.name == "kiln.export"]
        assert s.attributes["kiln.export_cache"] == "off"


def test_tied_weights_are_hashed_once():
    m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False))
    m[1].weight = m[0].weight
    from kiln.exportkey import _Walk

    w = _Walk()
    for mod in m.modules():
        for _, t in mod.named_parameters(recurse=False):
            w.describe(t, 0)
    assert len(w.tensors) == 1


def test_a_new_process_computes_the_same_key_for_the_same_model():
    """What a warm compile relies on: a model built the same way in another process (string hashes
    salted differently) has the same key, a transformers causal LM's generation config included."""
    import os
    import subprocess

    code = ("import torch, kiln.llm\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "from kiln.exportkey import export_key\n"
            "torch.manual_seed(0)\n"
            "m = LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,\n"
            "    num_key_value_heads=2, intermediate_size=64, vocab_size=128)).eval()\n"
            "print(export_key(m, (), None, None, {'entry': 'test'}, code=(kiln.llm,)))\n")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip().splitlines()[-1]
            for seed in ("1", "2")}
    assert len(keys) == 1 and "None" not in keys, keys


def test_captured_values_and_modules_outside_the_tree():
    """A function attribute is keyed with what its closure captured; a module held only as a plain
    attribute (its weights outside the walk) makes the model unkeyable."""
    m, x = _Net(), torch.randn(3, 8)

    def scaled(s):
        return lambda t: t * s

    m.act = scaled(2.0)
    two = _key(m, x)
    m.act = scaled(3.0)
    assert None not in (two, _key(m, x)) and _key(m, x) != two
    object.__setattr__(m, "shadow", torch.nn.Linear(2, 2))  # not registered: not in modules()
    assert _key(m, x) is None


def test_two_lambdas_of_one_function_have_two_keys():
    """Lambdas defined in one function share a qualified name and a source file: the key tells
    them apart by their code (a compile of the second found the first's program in CI)."""
    x = torch.randn(4, 8)
    fns = [lambda t: torch.sigmoid(t) * 3.0, lambda t: (torch.sigmoid(t) * 3.0, t.sum(-1)),
           lambda t: torch.sigmoid(t) * 4.0]
    keys = [_key(Fn(f), x) for f in fns]
    assert None not in keys and len(set(keys)) == 3, keys
    assert _key(Fn(fns[0]), x) == keys[0]
