"""What tests share: small modules and models, the CLI as a subprocess, and output comparison.

Servers are not started here: conftest.py's fixtures are the one place that starts them."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import torch

STAGES = ("importer", "optimizer", "codegen", "executor")
FARM_LEASE_TTL_S = 3  # in the farm fixture, a killed replica's lease is taken over after this


class Fn(torch.nn.Module):
    """Wraps a function as a module, so torch.export can export it."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def pairs(got, want):
    """zip(got, want) for comparing outputs, after checking that there are as many of each (a
    plain zip stops at the shorter and would pass with outputs missing)."""
    got, want = list(got), list(want)
    assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
    return zip(got, want)


def kiln_cli(*args, env=None, check=True):
    """`python -m kiln ARGS` in a subprocess (a command that exits, never a server)."""
    r = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"kiln {' '.join(args)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


# Hugging Face models from small configs, random weights (nothing downloaded), with inputs


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 100, (2, 7))
    return LlamaForCausalLM(cfg), {"input_ids": ids}


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return GPT2LMHeadModel(cfg), {"input_ids": torch.randint(0, 100, (2, 7))}


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    ids = torch.randint(0, 100, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # padding in the second sequence
    return BertModel(cfg), {"input_ids": ids, "attention_mask": mask, "token_type_ids": (ids % 2)}


class Server:
    """A client of a `kiln serve all` process (conftest's kiln_serve started it) over its store:
    raw stubs, a Pipeline, and the status code a call ends with."""

    def __init__(self, process, store):
        from kiln.v1 import services_pb2_grpc

        self.process, self.store, self.addr = process, store, process.addr
        self.channel = grpc.insecure_channel(self.addr, options=[("grpc.max_send_message_length", 256 << 20)])
        self.executor = services_pb2_grpc.ExecutorStub(self.channel)
        self.optimizer = services_pb2_grpc.OptimizerStub(self.channel)

    def pipeline(self):
        import kiln

        return kiln.Pipeline(self.store, {s: self.addr for s in STAGES})

    def code(self, method, request, timeout: float = 60) -> grpc.StatusCode:
        try:
            r = method(request, timeout=timeout)
            if hasattr(r, "__next__"):
                list(r)
        except grpc.RpcError as e:
            return e.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.channel.close()
