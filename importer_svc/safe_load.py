"""Loading an untrusted .pt2 without executing code from it.

torch.export.load unpickles parts of the archive: weights and constants flagged `use_pickle`
(torch.load with weights_only=False), custom and opaque objects (pickle.loads), legacy weight
files, and the sample inputs (torch.load, falling back to weights_only=False). Any of these
can run arbitrary code. kiln therefore (1) inspects the archive first and refuses every
pickled payload but the sample inputs, and (2) loads it with torch.load forced to
weights_only=True and pickle.loads disabled, so what remains (sample inputs) can only hold
tensors and plain containers.
"""

from __future__ import annotations

import io
import json
import threading
import zipfile
from unittest import mock

import torch

from kiln.core.errors import InvalidArgument

_lock = threading.Lock()


class _NoPickle:
    @staticmethod
    def loads(*_a, **_k):
        raise InvalidArgument("the program archive holds a pickled object; kiln does not unpickle artifacts")

    load = loads


def _refuse(reason: str):
    raise InvalidArgument(f"refusing the .pt2: {reason} (kiln never executes code from an artifact)")


def inspect_archive(data: bytes) -> None:
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile as e:
        raise InvalidArgument(f"not a torch.export program (.pt2): {e}") from e
    for name in z.namelist():
        parts = name.split("/")
        if "weights" in parts or "constants" in parts:
            if name.endswith(".pt"):
                _refuse(f"{name} is a legacy pickled weight file")
            if name.endswith("_config.json"):
                try:
                    config = json.loads(z.read(name)).get("config", {})
                except (ValueError, AttributeError) as e:
                    raise InvalidArgument(f"{name} is not a payload config: {e}") from e
                for fqn, meta in config.items():
                    if not isinstance(meta, dict):
                        _refuse(f"{name}: malformed entry {fqn!r}")
                    if meta.get("use_pickle"):
                        _refuse(f"{fqn!r} in {name} is pickled")
                    path = str(meta.get("path_name", ""))
                    if path.startswith(("custom_obj", "opaque")):
                        _refuse(f"{fqn!r} in {name} is a custom object")


def _weights_only_load(real):
    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        return real(f, *args, **kwargs)

    return load


def load_program(data: bytes) -> torch.export.ExportedProgram:
    inspect_archive(data)
    from torch.export.pt2_archive import _package

    with _lock, mock.patch.object(torch, "load", _weights_only_load(torch.load)), \
            mock.patch.object(_package, "pickle", _NoPickle), \
            mock.patch.object(torch._C, "_pickle_load_obj", _NoPickle.loads, create=True):
        try:
            return torch.export.load(io.BytesIO(data))
        except InvalidArgument:
            raise
        except Exception as e:  # a malformed or hostile archive: torch raises many exception types here
            raise InvalidArgument(f"not a loadable torch.export program (.pt2): {type(e).__name__}: "
                                  f"{str(e)[:500]}") from e
