"""Causal LMs for generation: a prefill and a decode program over one set of weights.

A transformers causal LM (a Hugging Face model directory, or the module itself) is exported
twice. Prefill takes a prompt (token ids, positions, attention mask; one sequence) and returns
the last position's logits and every layer's keys and values. Decode takes one token per
sequence of a batch, with its position, its attention mask over the cache (the new token is
always attended), and the cache so far (each layer's keys and values, [batch, kv heads, past, head dim], `past`
symbolic), and returns the logits and the grown cache. Both import to graphs that name the
same weights, so their manifests point at the same blobs. The executor owns the cache between
steps (executor_svc/generate.py); a CausalLM message ties the two compiled programs together.

Positions are passed explicitly (the count of real tokens before each one), so a sequence may
be left-padded with masked slots: a batch of sequences with caches of different lengths shares
one decode step, and a cache shorter than the two slots export's symbolic dims start at is
padded to two.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from kiln.core import errors
from kiln.cas.digest import Digest
from kiln.core.telemetry import span
from kiln.exportkey import export_key

MIN_PAST = 2  # torch.export's symbolic dims start at 2: shorter caches are left-padded (masked)


def _cache_tensors(cache) -> list:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _layers(model) -> int:
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    if not n:
        raise errors.FailedPrecondition(f"{type(model).__name__}: its config names no layer count")
    return int(n)


def _wrappers(model):
    import torch
    from transformers import DynamicCache

    layers = _layers(model)

    class Prefill(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids, attention_mask):
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                             use_cache=True, logits_to_keep=1)
            return (out.logits, *_cache_tensors(out.cache))

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, position_ids, past_mask, cache):
            past = DynamicCache()
            for i in range(layers):
                past.update(cache[2 * i], cache[2 * i + 1], i)
            # the mask over the cache, and the new token (always attended)
            mask = torch.cat([past_mask, torch.ones_like(input_ids)], dim=1)
            out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                             cache=past, use_cache=True)  # transformers 5 names it cache (past_key_values: deprecated)
            return (out.logits, *_cache_tensors(out.cache))

    return Prefill().eval(), Decode().eval(), layers


def load_causal_lm(path: str | Path):
    """The transformers model of a model directory (safetensors only, no remote code)."""
    from kiln.hf import load_hf_directory

    wrapped, _ = load_hf_directory(path)
    model = wrapped.model
    if not getattr(model, "can_generate", lambda: False)():
        raise errors.FailedPrecondition(f"{path}: {type(model).__name__} is not a causal LM (it cannot generate)")
    return model


def load_tokenizer(path: str | Path):
    """The directory's tokenizer (tokenizer.json, through `tokenizers`: data, never code)."""
    from tokenizers import Tokenizer

    f = Path(path) / "tokenizer.json"
    if not f.is_file():
        raise errors.FailedPrecondition(f"{path} has no tokenizer.json; give token ids instead of text")
    try:
        return Tokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises its own exception types for a broken file
        raise errors.InvalidArgument(f"{f}: not a readable tokenizer: {e}") from e


def compile_causal_lm(model, pipeline=None, *, max_context: int = 256, max_batch: int = 16,
                      search: bool = True, candidates: Optional[int] = None, name: str = "",
                      progress: Optional[bool] = None) -> Digest:
    """Compile a transformers causal LM (or a model directory) for Executor.Generate; returns
    the digest of its CausalLM message. `progress` shows the compile's progress on stderr after
    2 s (None: when stderr is a terminal; kiln.core.progress)."""
    from kiln.core import progress as live

    label = f"compile {Path(model).name if isinstance(model, (str, Path)) else type(model).__name__}"
    with live.progress(label, progress):
        return _compile_causal_lm(model, pipeline, max_context, max_batch, search, candidates, name)


def _compile_causal_lm(model, pipeline, max_context: int, max_batch: int, search: bool, candidates: Optional[int],
                       name: str) -> Digest:
    import torch

    from kiln.core import progress as live
    from torch.export import Dim

    from kiln.pipeline import Imported, Pipeline
    from kiln.v1 import services_pb2

    if not 1 <= max_batch <= 4096:
        raise errors.InvalidArgument(f"max_batch must be in 1..4096, got {max_batch}")
    if not 4 <= max_context <= 1 << 20:
        raise errors.InvalidArgument(f"max_context must be in 4..{1 << 20}, got {max_context}")
    pipeline = pipeline or Pipeline()
    if isinstance(model, (str, Path)):
        name = name or Path(model).name
        live.stage("load the model")
        model = load_causal_lm(model)
    model.eval()
    prefill, decode, layers = _wrappers(model)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    vocab = int(cfg.vocab_size)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit and max_context > limit:
        raise errors.InvalidArgument(f"max_context {max_context} is beyond the model's {limit} positions")

    live.stage("export")
    with span("kiln.export") as es:
        # the same model, settings and code compiled before: its programs, without exporting
        key = export_key(model, (), None, None, {"entry": "causal_lm", "max_context": max_context,
                                                  "max_batch": max_batch, "min_past": MIN_PAST},
                         code=(sys.modules[__name__],))
        parts = ("prefill_graph", "prefill_manifest", "decode_graph", "decode_manifest")
        found = pipeline.exported(key, parts)
        es.set_attribute("kiln.export_cache", "off" if key is None else "hit" if found else "miss")
        if found:
            programs = [Imported(found["prefill_graph"], found["prefill_manifest"]),
                        Imported(found["decode_graph"], found["decode_manifest"])]
        else:
            with torch.no_grad():
                ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
                pos = torch.arange(8)[None]
                seq = Dim("seq", min=1, max=max_context)
                ep_prefill = _export(prefill, (ids, pos, torch.ones_like(ids)), ({1: seq},) * 3)
                cache = tuple(t.expand(2, *t.shape[1:]).contiguous()
                              for t in prefill(ids, pos, torch.ones_like(ids))[1:])
                # (an example batch at the dim's maximum leaves export with a symbol per input: keep it below)
                batch = Dim("batch", min=1, max=max(max_batch, 3))
                # one `past` for every layer's keys and values, the mask one longer: kernels see that
                # they agree (export proves 32 + 32·past <= 64 + 64·past only as a run-time assert)
                past = Dim("past", min=MIN_PAST, max=max_context - 1)
                ep_decode = _export(decode, (ids[:, :2].reshape(2, 1), torch.full((2, 1), 8),
                                             torch.ones(2, 8, dtype=torch.long), cache),
                                    ({0: batch}, {0: batch}, {0: batch, 1: past},
                                     tuple({0: batch, 2: past} for _ in cache)),
                                    deferred_asserts=True)
            batch_dim = next(n for n in ep_decode.graph.nodes if n.op == "placeholder"
                             and n.name.endswith("input_ids")).meta["val"].shape[0]
            if not isinstance(batch_dim, torch.SymInt):
                raise errors.FailedPrecondition(f"{type(model).__name__}: export fixed the decode program's batch "
                                                f"at {batch_dim}; sequences could not share decode steps")
            programs = [ep_prefill, ep_decode]
            del ep_prefill, ep_decode
    results = []
    for part in ("prefill", "decode"):
        live.section(part)
        results.append(pipeline.compile_program(programs.pop(0), search=search, candidates=candidates))
    if not found:
        pipeline.record_exported(key, dict(zip(parts, (results[0].graph, results[0].manifest,
                                                       results[1].graph, results[1].manifest))))
    eos = cfg.eos_token_id if getattr(cfg, "eos_token_id", None) is not None else []
    lm = services_pb2.CausalLM(prefill_bundle=results[0].bundle.to_pb(), prefill_manifest=results[0].manifest.to_pb(),
                               decode_bundle=results[1].bundle.to_pb(), decode_manifest=results[1].manifest.to_pb(),
                               layers=layers, max_context=max_context, max_batch=max_batch,
                               eos_token_ids=[int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])],
                               vocab_size=vocab, name=name or type(model).__name__)
    return pipeline.store.put_message(lm)


def _export(module, args, dynamic_shapes, deferred_asserts: bool = False):
    import torch

    try:
        return torch.export.export(module, args, dynamic_shapes=dynamic_shapes,
                                   prefer_deferred_runtime_asserts_over_guards=deferred_asserts)
    except Exception as e:
        raise errors.FailedPrecondition(f"torch.export of {type(module).__name__.lower()} failed: "
                                        f"{type(e).__name__}: {e}") from e
