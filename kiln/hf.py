"""Hugging Face model directories (config.json + *.safetensors) as kiln inputs.

The architecture is built by transformers from the config; weights are read only from
safetensors (never pickle); code shipped in the directory is never run (no
trust_remote_code: a config that asks for remote code is refused).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from kiln.core.errors import FailedPrecondition, InvalidArgument


TENSOR_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


class ModelOutputTensor(torch.nn.Module):
    """A transformers model as a function of its tensor inputs, returning the tensor users
    compare: logits, else last_hidden_state. The inputs are named parameters (not **kwargs)
    so that torch.export can mark their batch and sequence dims dynamic; the KV cache is off."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None):
        given = dict(zip(TENSOR_INPUTS, (input_ids, attention_mask, token_type_ids, position_ids)))
        kwargs = {k: v for k, v in given.items() if v is not None}
        if getattr(self.model.config, "use_cache", None) is not None:
            kwargs["use_cache"] = False
        out = self.model(**kwargs)
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state


def dynamic_shapes_for(kwargs: dict, max_batch: int | None, max_seq: int | None) -> dict:
    """torch.export dynamic_shapes making dim 0 `batch` and dim 1 `seq` of every [batch, seq]
    input symbolic, up to the given maxima (None keeps that dim static)."""
    from torch.export import Dim

    dims = {}
    if max_batch is not None:
        dims[0] = Dim("batch", min=1, max=max_batch)
    if max_seq is not None:
        dims[1] = Dim("seq", min=1, max=max_seq)
    return {k: (dict(dims) if v.dim() == 2 else None) for k, v in kwargs.items()}


def is_hf_directory(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file()


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' "Loading weights" bar off while kiln loads a directory (a compile prints its
    own result; a bar per load would be noise in every command and server log)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_hf_directory(path: str | Path, batch: int = 1, seq_len: int = 16):
    """(module, example kwargs) for a save_pretrained directory."""
    import transformers

    p = Path(path)
    try:
        raw = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise InvalidArgument(f"{p / 'config.json'}: not a readable JSON config: {e}") from e
    if "auto_map" in raw:
        raise FailedPrecondition(f"{p} asks for custom code (auto_map); kiln never runs code from a model directory")
    if not list(p.glob("*.safetensors")):
        raise FailedPrecondition(f"{p} has no *.safetensors weights; kiln does not load pickled (.bin) weights")
    archs = raw.get("architectures") or []
    if not archs or not hasattr(transformers, archs[0]):
        raise FailedPrecondition(f"{p}: architecture {archs[:1] or 'unset'} is not a transformers class")
    cls = getattr(transformers, archs[0])
    try:
        with _no_progress_bars():
            model = cls.from_pretrained(p, use_safetensors=True, trust_remote_code=False, local_files_only=True)
    except Exception as e:  # transformers raises many types for a broken directory
        raise InvalidArgument(f"{p}: transformers could not build {archs[0]}: {type(e).__name__}: {e}") from e
    model.eval()
    vocab = int(getattr(model.config, "vocab_size", 2))
    ids = torch.randint(0, vocab, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return ModelOutputTensor(model), kwargs
