"""Untrusted artifacts: .pt2 archives and Hugging Face directories; a malicious pickle or shipped
code is refused (or ignored) without running."""

import io
import os
import zipfile

import pytest
import torch

from importer_svc.safe_load import load_program
from kiln.core.errors import InvalidArgument
from kiln.apps.examples import mlp_example


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _archive(replace: dict[str, bytes]) -> bytes:
    model, inputs = mlp_example()
    buf = io.BytesIO()
    torch.export.save(torch.export.export(model, inputs), buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name in src.namelist():
            data = src.read(name)
            for suffix, new in replace.items():
                if name.endswith(suffix):
                    data = new
            z.writestr(name, data)
    return out.getvalue()


def _pickled(marker) -> bytes:
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    return buf.getvalue()


def test_malicious_sample_inputs_run_under_torch_but_not_kiln(tmp_path):
    marker = tmp_path / "pwned"
    data = _archive({"sample_inputs/model.pt": _pickled(marker)})
    with pytest.raises(InvalidArgument):
        load_program(data)
    assert not marker.exists()
    # the payload is real: plain torch.export.load executes it
    try:
        torch.export.load(io.BytesIO(data))
    except Exception:
        pass
    assert marker.exists()


def test_pickled_weight_is_refused_before_loading(tmp_path):
    marker = tmp_path / "pwned"
    model, inputs = mlp_example()
    buf = io.BytesIO()
    torch.export.save(torch.export.export(model, inputs), buf)
    config = zipfile.ZipFile(io.BytesIO(buf.getvalue())).read("archive/data/weights/model_weights_config.json")
    config = config.replace(b'"use_pickle": false', b'"use_pickle": true', 1)
    data = _archive({"weights/model_weights_config.json": config, "weights/weight_0": _pickled(marker)})
    with pytest.raises(InvalidArgument, match="pickled"):
        load_program(data)
    assert not marker.exists()


def test_clean_archive_loads():
    ep = load_program(_archive({}))
    assert isinstance(ep, torch.export.ExportedProgram)


def _hf_dir(tmp_path, safetensors: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    d = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=safetensors)
    return d


def test_hf_directory_with_only_pickled_weights_is_refused_without_unpickling(tmp_path):
    from kiln.core.errors import FailedPrecondition
    from kiln.hf import load_hf_directory

    marker = tmp_path / "pwned"
    d = _hf_dir(tmp_path, safetensors=True)
    for f in d.glob("*.safetensors"):
        f.unlink()
    (d / "pytorch_model.bin").write_bytes(_pickled(marker))
    with pytest.raises(FailedPrecondition, match="pickled"):
        load_hf_directory(d)
    assert not marker.exists()


def test_hf_directory_code_and_pickles_beside_safetensors_never_run(tmp_path):
    """A directory that ships a modeling file and a malicious .bin next to real safetensors:
    kiln loads the safetensors, and neither the code nor the pickle runs."""
    import json

    from kiln.core.errors import FailedPrecondition
    from kiln.hf import load_hf_directory

    marker = tmp_path / "pwned"
    d = _hf_dir(tmp_path, safetensors=True)
    (d / "pytorch_model.bin").write_bytes(_pickled(marker))
    (d / "modeling_evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    module, kwargs = load_hf_directory(d)
    assert module(**kwargs).shape[-1] == 100  # the real model, from safetensors
    assert not marker.exists()
    cfg = json.loads((d / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Model"}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FailedPrecondition, match="custom code"):
        load_hf_directory(d)
    assert not marker.exists()
