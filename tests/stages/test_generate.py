"""Generation: prefill and decode programs over one set of weights, a KV cache in executor
memory, streamed tokens, continuous batching, stop conditions, cancellation and limits, in
process and over gRPC. Token ids are compared with transformers' generate on the same model."""

from __future__ import annotations

import threading
import time

import grpc
from prometheus_client import REGISTRY
import pytest
import torch

from kiln.core import errors

pytestmark = pytest.mark.slow(minutes=4)  # its file starts first under make test

NEW = 64


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256)).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    return GPT2LMHeadModel(GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                                bos_token_id=499, eos_token_id=499)).eval()


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("generate-store")


@pytest.fixture(scope="module")
def llama(store_dir):
    from kiln.llm import compile_causal_lm
    from kiln.pipeline import Pipeline

    p = Pipeline(f"file://{store_dir}")
    model = _llama()
    return p, model, compile_causal_lm(model, p, max_context=128, max_batch=4)


def _hf(model, prompt: list[int], new: int = NEW) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def _prompt(n: int, seed: int, vocab: int = 1000) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_greedy_matches_transformers_for_64_tokens(llama):
    """Greedy decoding is token-identical to transformers' generate(do_sample=False) for 64 new
    tokens, for a one-token prompt (its cache padded with a masked slot) and longer ones; the
    prefill and decode programs bind the same weight arrays (one copy in executor memory)."""
    p, model, lm = llama
    for n, seed in ((1, 0), (9, 1), (40, 2)):
        prompt = _prompt(n, seed)
        got = list(p.generate(lm, prompt, NEW))
        assert [t for t, _ in got] == _hf(model, prompt), n
        assert [r for _, r in got] == [""] * (NEW - 1) + ["length"]
    batcher = p.local_executor().batcher(lm)
    assert [id(w) for w in batcher.prefill.weights] == [id(w) for w in batcher.decode.weights]


def test_gpt2_greedy_matches_transformers(tmp_path):
    from kiln.llm import compile_causal_lm
    from kiln.pipeline import Pipeline

    p = Pipeline(f"file://{tmp_path / 'store'}")
    model = _gpt2()
    lm = compile_causal_lm(model, p, max_context=96, max_batch=2)
    for n, seed in ((1, 3), (12, 4)):
        prompt = _prompt(n, seed, 500)
        assert [t for t, _ in p.generate(lm, prompt, NEW)] == _hf(model, prompt), n


def test_sampling_is_reproducible_with_a_seed(llama):
    """Temperature, top-k and top-p sampling: the same seed gives the same tokens, another seed
    other tokens; top_k=1 is greedy whatever the temperature."""
    p, model, lm = llama
    prompt = _prompt(6, 5)

    def sample(**kw):
        return [t for t, _ in p.generate(lm, prompt, 24, **kw)]

    a = sample(temperature=1.0, seed=7)
    assert a == sample(temperature=1.0, seed=7)
    assert a != sample(temperature=1.0, seed=8)
    b = sample(temperature=0.8, top_k=50, top_p=0.9, seed=7)
    assert b == sample(temperature=0.8, top_k=50, top_p=0.9, seed=7)
    assert sample(temperature=1.5, top_k=1, seed=3) == _hf(model, prompt, 24)


def test_top_k_and_top_p_keep_only_the_most_likely_tokens():
    """choose_token draws only from the k most likely tokens, and from the smallest set whose
    probability reaches top_p; the draw follows the probabilities."""
    import numpy as np

    from executor_svc.generate import Sampling, choose_token

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    rng = np.random.default_rng(0)
    draws = [choose_token(logits, Sampling(1.0, top_k=2), rng) for _ in range(4000)]
    assert set(draws) == {0, 1} and abs(draws.count(0) / 4000 - 0.5 / 0.8) < 0.03
    draws = [choose_token(logits, Sampling(1.0, top_p=0.85), rng) for _ in range(4000)]
    assert set(draws) == {0, 1, 2}  # 0.5 + 0.3 < 0.85 <= 0.95
    assert choose_token(logits, Sampling(), None) == 0


def test_concurrent_requests_share_decode_steps_and_match_running_alone(llama):
    """Four clients at once, with prompts and lengths of their own: they join and leave a shared
    batch between decode steps (more than one sequence per step on average), and each gets the
    tokens it gets alone."""
    p, model, lm = llama
    prompts = [(_prompt(n, 10 + i), new) for i, (n, new) in enumerate(((3, 40), (17, 24), (1, 33), (30, 48)))]
    alone = [[t for t, _ in p.generate(lm, prompt, new)] for prompt, new in prompts]
    batcher = p.local_executor().batcher(lm)
    steps, batched = batcher.steps, batcher.batched
    sample = REGISTRY.get_sample_value
    hist = (sample("kiln_executor_batch_size_count") or 0, sample("kiln_executor_batch_size_sum") or 0)
    got = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def client(i):
        start.wait()
        got[i] = [t for t, _ in p.generate(lm, *prompts[i])]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == alone
    assert (batcher.batched - batched) / (batcher.steps - steps) > 1.5
    # the metrics saw the same steps and batch sizes; nothing is left queued or active
    assert sample("kiln_executor_batch_size_count") - hist[0] == batcher.steps - steps
    assert sample("kiln_executor_batch_size_sum") - hist[1] == batcher.batched - batched
    assert sample("kiln_executor_queue_depth") == 0 and sample("kiln_executor_active_sequences") == 0


def test_stop_sequences_and_eos(llama):
    """Generation stops right after a stop sequence (finish "stop") or an end-of-sequence token
    (finish "eos", unless ignore_eos), and at max_new_tokens (finish "length")."""
    from kiln.cas.digest import Digest
    from kiln.v1 import services_pb2

    p, model, lm = llama
    prompt = _prompt(5, 20)
    full = [t for t, _ in p.generate(lm, prompt, 40)]
    stop = tuple(full[10:12])
    first = next(i for i in range(len(full) - 1) if tuple(full[i:i + 2]) == stop)
    got = list(p.generate(lm, prompt, 40, stop_sequences=[stop]))
    assert [t for t, _ in got] == full[:first + 2] and got[-1][1] == "stop"
    # the same programs with an end-of-sequence token that the greedy output makes
    msg = p.store.get_message(lm, services_pb2.CausalLM)
    msg.ClearField("eos_token_ids")
    msg.eos_token_ids.append(full[7])
    lm_eos = p.store.put_message(msg)
    at = full.index(full[7])
    got = list(p.generate(lm_eos, prompt, 40))
    assert [t for t, _ in got] == full[:at + 1] and got[-1][1] == "eos"
    assert [t for t, _ in p.generate(lm_eos, prompt, 40, ignore_eos=True)] == full
    assert list(p.generate(lm, prompt, 3))[-1] == (full[2], "length")


def test_limits_are_resource_exhausted(llama, monkeypatch):
    """Past the context (prompt plus new tokens), or with every sequence slot taken and the
    waiting queue full: RESOURCE_EXHAUSTED, and the executor keeps serving. A request that finds
    the slots taken waits for one. Bad requests: INVALID_ARGUMENT."""
    from executor_svc.executor import Executor

    p, model, lm = llama
    with pytest.raises(errors.ResourceExhausted, match="context of 128"):
        list(p.generate(lm, _prompt(100, 1), 29))
    with pytest.raises(errors.ResourceExhausted, match="no room"):
        list(p.generate(lm, _prompt(128, 1), 1))
    with pytest.raises(errors.InvalidArgument, match="outside the vocabulary"):
        list(p.generate(lm, [5, 1000], 4))
    with pytest.raises(errors.InvalidArgument, match="temperature"):
        list(p.generate(lm, [5], 4, temperature=-1.0))
    monkeypatch.setenv("KILN_MAX_SEQUENCES", "2")
    monkeypatch.setenv("KILN_MAX_WAITING", "1")
    executor = Executor(p.store)  # a second executor: its own limits
    batcher = executor.batcher(lm)
    run = batcher.run
    batcher.run = lambda *a: (time.sleep(0.05), run(*a))[1]  # steps slow enough that the slots stay taken
    held = [batcher.submit(_prompt(4, i), 100, ignore_eos=True) for i in range(2)]
    waiting = batcher.submit(_prompt(4, 9), 4)  # every slot is taken: it waits for one
    with pytest.raises(errors.ResourceExhausted, match=r"holds 3 requests .*2 generating at once, 1 waiting\), its limit"):
        batcher.submit(_prompt(4, 10), 4)
    time.sleep(0.5)
    assert waiting.out.empty() and batcher.busy() == 3  # still waiting while both slots run
    batcher.cancel(held[0])  # a slot frees: the waiting request runs, as it would have alone
    assert [t for t, _, _, _, _ in waiting.stream()] == [t for t, _ in p.generate(lm, _prompt(4, 9), 4)]
    batcher.cancel(held[1])
    assert batcher.busy() == 0
    monkeypatch.setenv("KILN_MAX_WAITING", "none")
    with pytest.raises(errors.InvalidArgument, match="KILN_MAX_WAITING"):
        Executor(p.store).batcher(lm)


def test_a_closed_stream_frees_its_sequence_at_once(llama):
    p, model, lm = llama
    batcher = p.local_executor().batcher(lm)
    stream = p.generate(lm, _prompt(8, 30), 100)
    assert len([next(stream) for _ in range(3)]) == 3
    assert batcher.busy() == 1
    stream.close()
    assert batcher.busy() == 0


def test_logprobs_are_the_models_log_softmax(llama):
    """With logprobs k, each token comes with its log-probability under the model (the log-softmax
    of transformers' logits at that step, before temperature) and the k most likely tokens'."""
    p, model, lm = llama
    prompt = _prompt(6, 12)
    got = list(p.generate(lm, prompt, 8, logprobs=3, ignore_eos=True))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    assert [t for t, _ in got] == out.sequences[0, len(prompt):].tolist()
    for t, logits in zip(got, out.logits):
        want = torch.log_softmax(logits[0].double(), -1)
        top = torch.topk(want, 3)
        assert t.logprob == pytest.approx(float(want[t[0]]), abs=1e-4)
        assert [i for i, _ in t.top] == top.indices.tolist() and t.top[0][0] == t[0]  # greedy: the most likely
        assert [lp for _, lp in t.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    sampled = list(p.generate(lm, prompt, 8, temperature=1.5, seed=3, logprobs=0))
    assert all(t.top == () and t.logprob <= 0 for t in sampled)
    with pytest.raises(errors.InvalidArgument, match="logprobs"):
        list(p.generate(lm, prompt, 2, logprobs=21))


def test_generation_metrics_carry_vllms_names(llama):
    """kiln:-prefixed metrics under vLLM's names, labelled with the model's name: per request its
    queue time, first-token and end-to-end latency, the gaps between its tokens, its prompt and
    generated tokens and its finish reason (abort: its client left); requests running and
    waiting, and the KV cache's use while a sequence runs."""
    from kiln.v1 import services_pb2

    p, model, lm = llama
    name = p.store.get_message(lm, services_pb2.CausalLM).name

    def value(metric: str, **labels) -> float:
        return REGISTRY.get_sample_value(metric, {"model_name": name, **labels}) or 0.0

    counted = ("kiln:prompt_tokens_total", "kiln:generation_tokens_total", "kiln:time_to_first_token_seconds_count",
               "kiln:inter_token_latency_seconds_count", "kiln:e2e_request_latency_seconds_count",
               "kiln:request_queue_time_seconds_count")
    before = {m: value(m) for m in counted}
    finished = {r: value("kiln:request_success_total", finished_reason=r) for r in ("length", "abort")}
    for prompt in (_prompt(5, 7), _prompt(3, 8)):
        assert len(list(p.generate(lm, prompt, 6, ignore_eos=True))) == 6
    grew = {m: value(m) - before[m] for m in counted}
    assert grew == {"kiln:prompt_tokens_total": 8, "kiln:generation_tokens_total": 12,
                    "kiln:time_to_first_token_seconds_count": 2, "kiln:inter_token_latency_seconds_count": 10,
                    "kiln:e2e_request_latency_seconds_count": 2, "kiln:request_queue_time_seconds_count": 2}
    assert value("kiln:request_success_total", finished_reason="length") - finished["length"] == 2
    assert value("kiln:e2e_request_latency_seconds_sum") >= value("kiln:time_to_first_token_seconds_sum") > 0
    assert value("kiln:num_requests_running") == value("kiln:num_requests_waiting") == 0
    stream = p.generate(lm, _prompt(8, 30), 100, ignore_eos=True)
    [next(stream) for _ in range(3)]
    assert value("kiln:num_requests_running") == 1
    # a decode step has run: the sequence's cached tokens, over the 4 x 128 the model's sequences may hold
    assert value("kiln:kv_cache_usage_perc") > 0
    stream.close()
    assert value("kiln:request_success_total", finished_reason="abort") - finished["abort"] == 1
    assert value("kiln:num_requests_running") == 0 and value("kiln:kv_cache_usage_perc") == 0


def test_generate_over_grpc_streams_and_cancels(llama, executor_server):
    """Executor.Generate over gRPC streams the same tokens as in process; a client that cancels
    frees its slot on the server; a limit is RESOURCE_EXHAUSTED, an unknown model NOT_FOUND."""
    from kiln.cas.digest import Digest
    from kiln.pipeline import Pipeline
    from kiln.v1 import services_pb2, services_pb2_grpc

    p, model, lm = llama
    address, servicer = executor_server
    remote = Pipeline(p.store, {"executor": address})
    prompt = _prompt(7, 40)
    assert list(remote.generate(lm, prompt, 20)) == list(p.generate(lm, prompt, 20))
    # log-probabilities come over the wire as they are made here
    there, here = list(remote.generate(lm, prompt, 5, logprobs=2)), list(p.generate(lm, prompt, 5, logprobs=2))
    assert [(t.logprob, t.top) for t in there] == [(t.logprob, t.top) for t in here] and len(there[0].top) == 2
    assert all(t.logprob is None and t.top == () for t in remote.generate(lm, prompt, 3))
    stub = services_pb2_grpc.ExecutorStub(grpc.insecure_channel(address))
    call = stub.Generate(services_pb2.GenerateRequest(model=lm.to_pb(), prompt_ids=prompt, max_new_tokens=100))
    assert next(call).index == 0
    call.cancel()
    batcher = servicer.executor.batcher(lm)

    def freed() -> bool:
        deadline = time.monotonic() + 10
        while batcher.busy() and time.monotonic() < deadline:
            time.sleep(0.02)
        return batcher.busy() == 0

    assert freed()
    stream = remote.generate(lm, prompt, 100)  # the client library: closing its iterator cancels the call
    next(stream)
    assert batcher.busy() == 1
    stream.close()
    assert freed()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(services_pb2.GenerateRequest(model=lm.to_pb(), prompt_ids=_prompt(100, 1),
                                                        max_new_tokens=50)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(errors.NotFound):
        list(remote.generate(Digest("0" * 64, 10), [1, 2], 3))
