"""Hugging Face models built from small configs with random weights, compiled and run by kiln.

Tolerance: fp32 allclose(rtol=1e-4, atol=1e-4) on logits / hidden states, as the importer
issue states.
"""

import pytest
import torch

import kiln


class Logits(torch.nn.Module):
    """Returns the tensor a user compares: logits for LMs, last_hidden_state for encoders."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kw):
        out = self.model(**kw)
        return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 100, (2, 7))
    return LlamaForCausalLM(cfg), {"input_ids": ids, "use_cache": False}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 100, (2, 7)), "use_cache": False}


def _bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding in the second sequence
    return BertModel(cfg), {"input_ids": ids, "attention_mask": mask, "token_type_ids": (ids % 2)}


@pytest.mark.parametrize("build", [_llama, _gpt2, _bert], ids=["llama", "gpt2", "bert"])
def test_hf_model_matches_eager(local_pipeline, build):
    torch.manual_seed(0)
    model, kwargs = build()
    wrapped = Logits(model.eval())
    compiled = kiln.compile(wrapped, (), kwargs, pipeline=local_pipeline)
    with torch.no_grad():
        ref = wrapped(**kwargs)
    out = compiled(**kwargs)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4), (out - ref).abs().max()
