"""Untrusted .pt2 archives: a malicious pickle is refused without running."""

import io
import os
import zipfile

import pytest
import torch

from importer_svc.safe_load import load_program
from kiln.errors import InvalidArgument
from kiln.examples import mlp_example


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
