"""The OpenAI-compatible endpoint, driven by the official `openai` client against a local
server: models, completions and chat completions, streaming and not, stop strings, errors.
Texts are checked against transformers' greedy generate on the same model and tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w2{% endif %}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from openai import OpenAI
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.apps.openai_api import load_model, serve
    from kiln.pipeline import Pipeline

    d = tmp_path_factory.mktemp("openai") / "tiny-chat"
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0,
                                         eos_token_id=63, max_position_embeddings=128)).eval()
    model.save_pretrained(d)
    vocab = {f"w{i}": i for i in range(60)} | {"system": 60, "user": 61, "assistant": 62, "</s>": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    # the template where the pinned transformers saves it: chat_template.jinja, beside a config without one
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    p = Pipeline(f"file://{d.parent / 'store'}")
    served = load_model(p, d, max_context=64, max_batch=4)
    http = serve(p, served, 0)
    client = OpenAI(base_url=f"http://127.0.0.1:{http.server_address[1]}/v1", api_key="unused", max_retries=0)
    yield client, model, tok
    http.shutdown()


def test_the_chat_template_comes_from_the_config_first_then_chat_template_jinja(tmp_path):
    from kiln.apps.openai_api import load_chat_template

    assert load_chat_template(tmp_path) == (None, "", "")
    (tmp_path / "chat_template.jinja").write_text("jinja {{ messages }}")
    assert load_chat_template(tmp_path) == ("jinja {{ messages }}", "", "")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "config", "bos_token": "<s>"}))
    assert load_chat_template(tmp_path) == ("config", "<s>", "")


def _greedy_text(model, tok, text: str, new: int) -> tuple[str, list[int]]:
    ids = torch.tensor([tok.encode(text).ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    new_ids = [t for t in out[0, ids.shape[1]:].tolist() if t != 63]
    return tok.decode(new_ids), new_ids


def test_models_lists_the_served_model(server):
    import time
    import urllib.request

    client, _, _ = server
    (m,) = client.models.list()
    assert m.id == "tiny-chat" and time.time() - 600 < m.created <= time.time()  # when it was served
    health = str(client.base_url).replace("/v1/", "/health")
    with urllib.request.urlopen(health, timeout=10) as r:
        assert r.status == 200
    client.completions.create(model="tiny-chat", prompt="w1", max_tokens=2)
    with urllib.request.urlopen(str(client.base_url).replace("/v1/", "/metrics"), timeout=10) as r:
        text = r.read().decode()  # the generation metrics under vLLM's names, for the served model
    assert 'kiln:time_to_first_token_seconds_count{model_name="' in text and "kiln:num_requests_running" in text


def test_completions_match_transformers_streaming_or_not(server):
    client, model, tok = server
    want, ids = _greedy_text(model, tok, "w5 w6 w7", 12)
    r = client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=12, temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == r.usage.total_tokens - 3
    assert r.choices[0].finish_reason == ("length" if len(ids) == 12 else "stop")
    chunks = list(client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    seeded = [client.completions.create(model="tiny-chat", prompt="w9", max_tokens=10, temperature=1.0, seed=4)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    unseeded = {client.completions.create(model="tiny-chat", prompt="w9", max_tokens=10, temperature=1.0)
                .choices[0].text for _ in range(3)}
    assert len(unseeded) > 1  # without a seed each request draws its own, as OpenAI's do
    # token ids instead of text, alone or as a batch of one
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        assert client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12,
                                         temperature=0).choices[0].text == want


def test_logprobs_are_the_models_for_completions_and_chats(server):
    """logprobs: each token's log-probability under the model (transformers' log-softmax at that
    step) and the most likely tokens', in OpenAI's completion and chat formats, streamed or not."""
    client, model, tok = server
    ids = torch.tensor([tok.encode("w5 w6 w7").ids])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    new = out.sequences[0, 3:].tolist()
    n = new.index(63) if 63 in new else len(new)  # the end-of-sequence token is not text
    want = [float(torch.log_softmax(lg[0].double(), -1)[t]) for lg, t in zip(out.logits, new)][:n]
    r = client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in new[:n]] and lp.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(top) == 2 and max(top.values()) == pytest.approx(v, abs=1e-4)  # greedy: the most likely
               for top, v in zip(lp.top_logprobs, want))
    assert [r.choices[0].text[o:].startswith(t) for o, t in zip(lp.text_offset, lp.tokens)] == [True] * n
    chunks = list(client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=6, temperature=0,
                                            logprobs=2, stream=True))
    assert [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] == \
        pytest.approx(want, abs=1e-4)
    messages = [{"role": "user", "content": "w20 w21"}]
    c = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = c.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
                           and e.bytes == list(e.token.encode()) for e in content)
    assert client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4,
                                          temperature=0).choices[0].logprobs is None


def test_n_choices_are_sequences_of_their_own(server):
    """n choices: greedy ones all equal transformers'; sampled ones each draw their own (and a seed
    repeats them all); streamed, each chunk names its choice; usage counts the prompt once."""
    client, model, tok = server
    want, _ = _greedy_text(model, tok, "w5 w6 w7", 8)
    r = client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=8, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == [want, want]
    one = client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2 * one.usage.completion_tokens
    sampled = [[c.text for c in client.completions.create(model="tiny-chat", prompt="w9", max_tokens=10,
                                                          temperature=1.0, seed=11, n=3).choices] for _ in range(2)]
    assert sampled[0] == sampled[1] and len(set(sampled[0])) > 1
    chunks = list(client.completions.create(model="tiny-chat", prompt="w9", max_tokens=10, temperature=1.0, seed=11,
                                            n=3, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == sampled[0]
    assert chunks[-1].usage.prompt_tokens == 1
    messages = [{"role": "user", "content": "w20 w21"}]
    c = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4, temperature=0, n=2)
    assert len(c.choices) == 2 and c.choices[0].message.content == c.choices[1].message.content


def test_a_stream_ends_with_its_usage_when_asked(server):
    client, model, tok = server
    want, _ = _greedy_text(model, tok, "w5 w6 w7", 8)
    chunks = list(client.completions.create(model="tiny-chat", prompt="w5 w6 w7", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *text, last = chunks
    assert all(c.usage is None for c in text) and "".join(c.choices[0].text for c in text) == want
    assert last.choices == [] and last.usage.prompt_tokens == 3 and last.usage.total_tokens == 3 + last.usage.completion_tokens
    messages = [{"role": "user", "content": "w20 w21"}]
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_a_stop_string_ends_the_text_before_it(server):
    client, model, tok = server
    want, _ = _greedy_text(model, tok, "w11 w12", 16)
    words = want.split()
    stop = words[4]
    r = client.completions.create(model="tiny-chat", prompt="w11 w12", max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny-chat", prompt="w11 w12", max_tokens=16, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_chat_completions_render_the_template(server):
    client, model, tok = server
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w20 w21 w22"}]
    want, _ = _greedy_text(model, tok, "system w3 w4 user w20 w21 w22 w2", 10)
    r = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    chunks = list(client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=10,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    # content as a list of text parts, as newer clients send it
    parts = [{"role": "system", "content": [{"type": "text", "text": "w3 w4"}]},
             {"role": "user", "content": [{"type": "text", "text": "w20 w21 w22"}]}]
    r = client.chat.completions.create(model="tiny-chat", messages=parts, max_tokens=10, temperature=0)
    assert r.choices[0].message.content == want


def test_errors_are_openai_errors(server):
    import openai

    client, _, _ = server
    # past the context: 400, which the client does not retry (it retries a 429)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 64 tokens.*65"):
        client.completions.create(model="tiny-chat", prompt="w1 w2", max_tokens=63)
    # what kiln does not support is refused by name, never ignored
    with pytest.raises(openai.BadRequestError, match="tools is not supported"):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    with pytest.raises(openai.BadRequestError, match="response_format is not supported"):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                       response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="logprobs must be an integer"):
        client.completions.create(model="tiny-chat", prompt="w1", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "w1"}], max_tokens=2,
                                       top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"token ids must be in \[0, 64\)"):
        client.completions.create(model="tiny-chat", prompt=[1, 99], max_tokens=2)
    # the value that means "off" changes nothing, so it is taken
    assert client.completions.create(model="tiny-chat", prompt="w1", max_tokens=2, presence_penalty=0,
                                     logprobs=None).choices[0].text is not None
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-9", prompt="w1", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"n must be an integer in \[1, 16\]"):
        client.completions.create(model="tiny-chat", prompt="w1", max_tokens=2, n=17)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny-chat", messages=[], max_tokens=2)
    assert client.completions.create(model="tiny-chat", prompt="w1", max_tokens=2).choices[0].text is not None
