"""An OpenAI-compatible HTTP endpoint in front of Executor.Generate.

`kiln serve-openai DIR` compiles the model directory's causal LM (kiln/llm.py; cached) and
serves `/v1/models`, `/v1/completions` and, when the directory's tokenizer_config.json has a
chat template, `/v1/chat/completions`, streaming (server-sent events) or not. Text goes
through the directory's tokenizer.json (`tokenizers`); a chat template is rendered in Jinja2's
sandbox, so a template cannot run code. Generation runs wherever the pipeline's executor is:
in process, or a remote Executor over gRPC.

OpenAI's semantics: `max_tokens` (default 16), `temperature` (default 1; 0 is greedy),
`top_p`, `seed`, `stop` (strings: the text ends before the first one, finish "stop"); an
end-of-sequence token finishes with "stop", the token limit with "length". A prompt is text or
token ids; a chat message's content is text or a list of text parts. `stream_options`'
`include_usage` adds the usage chunk at the end of a stream. `logprobs` (a completion: 0..20; a
chat: true, with `top_logprobs` 0..20) reports each token's log-probability under the model.
`n` choices (up to 16) are `n` sequences, each drawing with its own seed.

Errors come back as OpenAI's error object: 400 for a bad request (a prompt and max_tokens past
the model's context among them: a client retries a 429) and for any field kiln does not support
(tools, response_format, penalties, ...: named, never ignored); 404 for an unknown model or path;
429 past a limit (the executor's RESOURCE_EXHAUSTED). `/health` answers 200 once the model is
served, and `/metrics` has this process's metrics (generation's under vLLM's names:
kiln.core.metrics).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator, Optional

from kiln.core import errors
from kiln.cas.digest import Digest

DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 1 << 20

# the request fields kiln acts on, per route; any other field is refused by name (a field left
# at the value that means "off", such as presence_penalty 0 or logprobs false, changes nothing)
SUPPORTED = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
             "logprobs"}
FIELDS = {"/v1/completions": SUPPORTED | {"prompt"},
          "/v1/chat/completions": SUPPORTED | {"messages", "max_completion_tokens", "top_logprobs"}}
MAX_LOGPROBS = 20  # the most likely tokens reported per token, at most (OpenAI's bound; the executor's)
MAX_CHOICES = 16   # choices per request (n), each a sequence of its own on the executor
OFF = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
       "echo": (None, False), "best_of": (None, 1), "logit_bias": (None, {}),
       "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None,),
       "parallel_tool_calls": (None,), "functions": (None, []), "function_call": (None, "none")}


@dataclass
class Model:
    name: str
    digest: Digest
    tokenizer: object
    chat_template: Optional[str]
    bos: str = ""
    eos: str = ""
    max_context: int = 0  # prompt and new tokens together (0: not known here; the executor checks)
    created: int = 0      # when it was served (Unix seconds), as /v1/models reports it
    vocab_size: int = 0   # token ids a prompt may hold (0: the tokenizer's)


def load_chat_template(path: str | Path) -> tuple[Optional[str], str, str]:
    """(chat template or None, bos token, eos token) from tokenizer_config.json, the template
    from chat_template.jinja where the config has none (where transformers writes it)."""
    f = Path(path) / "tokenizer_config.json"
    cfg = {}
    if f.is_file():
        try:
            cfg = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise errors.InvalidArgument(f"{f}: not readable JSON: {e}") from e

    def token(v) -> str:
        return v.get("content", "") if isinstance(v, dict) else (v or "")

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    jinja = Path(path) / "chat_template.jinja"
    if template is None and jinja.is_file():
        try:
            template = jinja.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise errors.InvalidArgument(f"{jinja}: not a readable template: {e}") from e
    return template, token(cfg.get("bos_token")), token(cfg.get("eos_token"))


def choice_seeds(body: dict) -> list[int]:
    """One sampling seed per choice (n): the request's seed and the ones after it, so each choice
    draws its own and a seeded request repeats; without a seed a new one per request, so sampled
    requests differ as OpenAI's do. (Greedy choices are all the same.)"""
    n, seed = body.get("n", 1), body.get("seed")
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise errors.InvalidArgument(f"n must be an integer in [1, {MAX_CHOICES}], got {n!r}")
    if seed is None:
        seed = secrets.randbelow(1 << 31)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 62:
        raise errors.InvalidArgument(f"seed must be an integer in [0, 2^62), got {seed!r}")
    return [seed + i for i in range(n)]


def merged(completions: list) -> Iterator[tuple[int, Optional[str], list]]:
    """The choices' (index, new text, its tokens) as each is made, and (index, None, []) when one
    is done. One choice is read here; several by a thread each. Closing this ends them all: each
    choice's sequence is freed at its next token."""
    if len(completions) == 1:
        chunks = completions[0].chunks()
        try:
            for piece, tokens in chunks:
                yield 0, piece, tokens
        finally:
            chunks.close()
        yield 0, None, []
        return
    import queue
    import threading

    made: queue.Queue = queue.Queue()
    stop = threading.Event()

    def pump(i: int, c) -> None:
        try:
            for piece, tokens in c.chunks():  # leaving the loop closes the choice's token stream
                if stop.is_set():
                    return
                made.put((i, piece, tokens))
            made.put((i, None, []))
        except BaseException as e:  # noqa: BLE001 - handed to the reader, which raises it
            made.put((i, e, []))

    for i, c in enumerate(completions):
        threading.Thread(target=pump, args=(i, c), name=f"kiln-choice-{i}", daemon=True).start()
    try:
        for _ in range(len(completions)):
            while True:
                i, piece, tokens = made.get()
                if isinstance(piece, BaseException):
                    raise piece
                yield i, piece, tokens
                if piece is None:
                    break
    finally:
        stop.set()


def _logprobs_asked(body: dict, chat: bool) -> int:
    """How many of the most likely tokens to report per token (-1: no logprobs). A chat asks with
    logprobs (true) and top_logprobs (0..20); a completion with logprobs (0..20)."""
    def count(name, v) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_LOGPROBS:
            raise errors.InvalidArgument(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        return v

    if chat:
        asked, top = body.get("logprobs"), body.get("top_logprobs")
        if asked not in (None, True, False):
            raise errors.InvalidArgument(f"logprobs must be true or false, got {asked!r}")
        if top is not None and not asked:
            raise errors.InvalidArgument("top_logprobs needs logprobs: true")
        return count("top_logprobs", top or 0) if asked else -1
    asked = body.get("logprobs")
    return -1 if asked is None else count("logprobs", asked)


def check_fields(route: str, body: dict) -> None:
    """Refuses, by name, any field kiln does not act on (unless it is at its "off" value)."""
    for name, value in body.items():
        if name in FIELDS[route] or (name in OFF and any(value == v and type(value) is type(v) for v in OFF[name])):
            continue
        raise errors.InvalidArgument(f"{name} is not supported by this server (kiln serves {route} with "
                                     f"{', '.join(sorted(FIELDS[route]))})")


def message_text(content) -> Optional[str]:
    """A message's content as text: a string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    return None


def render_chat(model: Model, messages: list) -> str:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and message_text(m.get("content")) is not None
            for m in messages):
        raise errors.InvalidArgument("messages must be a non-empty list of {role, content} objects with text content "
                                     "(a string, or a list of {type: text, text} parts)")
    messages = [dict(m, content=message_text(m["content"])) for m in messages]

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(model.chat_template).render(messages=messages, add_generation_prompt=True,
                                                           bos_token=model.bos, eos_token=model.eos)
    except TemplateError as e:
        raise errors.InvalidArgument(f"the chat template refused the messages: {e}") from e


class Completion:
    """Text as it is made, with OpenAI's stop strings: chunks of new text, then the finish reason."""

    def __init__(self, pipeline, model: Model, prompt_ids: list[int], body: dict, chat: bool, seed: int):
        self.model, self.prompt_tokens, self.chat = model, len(prompt_ids), chat
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens", DEFAULT_MAX_TOKENS))
        temperature = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        self.logprobs = _logprobs_asked(body, chat)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise errors.InvalidArgument(f"max_tokens must be a positive integer, got {max_tokens!r}")
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise errors.InvalidArgument(f"{name} must be a number, got {v!r}")
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
            raise errors.InvalidArgument("stop must be a string or a list of up to 4 non-empty strings")
        if model.max_context and len(prompt_ids) + max_tokens > model.max_context:
            # the request as asked can never run here: a 400, which clients do not retry (a 429 they do)
            raise errors.InvalidArgument(
                f"this model's maximum context length is {model.max_context} tokens; the request asks for "
                f"{len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, {max_tokens} to generate): "
                "shorten the prompt or lower max_tokens")
        self.stop = stop
        self.tokens = pipeline.generate(model.digest, prompt_ids, max_tokens, temperature=float(temperature),
                                        top_p=float(top_p) if top_p < 1 else 0.0, seed=seed, logprobs=self.logprobs)
        self.completion_tokens = 0
        self.finish_reason = None
        self._reported: list[int] = []  # tokens whose logprobs were reported (their text offsets)
        self.started = next(self.tokens, None)  # the request's errors (a limit) before any response

    def chunks(self) -> Iterator[tuple[str, list]]:
        """(new text, the tokens that made it) as it is made. A token's text may be held back a
        while (it may become a stop string); its token comes with the text it ends up in. The
        end-of-sequence token is not text; the tokens of a stop string come with the text before it."""
        made, shown, held = [], "", []
        item = self.started
        try:
            while item is not None:
                token, reason = item
                self.completion_tokens += 1
                if reason != "eos":  # the end-of-sequence token is not text
                    made.append(token)
                    held.append(item)
                text = self.model.tokenizer.decode(made)
                cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
                if cut >= 0:
                    if cut > len(shown) or held:
                        yield text[len(shown):max(cut, len(shown))], held
                    self.finish_reason = "stop"
                    return
                if reason:  # hold back text that may still become a stop string
                    self.finish_reason = "length" if reason == "length" else "stop"
                    if len(text) > len(shown) or held:
                        yield text[len(shown):], held
                    return
                safe = len(text) - max((len(s) - 1 for s in self.stop), default=0)
                if safe > len(shown):
                    yield text[len(shown):safe], held
                    shown, held = text[:safe], []
                item = next(self.tokens, None)
        finally:
            self.tokens.close()  # a stop string or a client gone: the sequence is freed

    def logprobs_json(self, tokens: list) -> Optional[dict]:
        """OpenAI's logprobs object for these tokens, the next ones after those reported before
        (None when not asked): a chat's `content` list, or a completion's parallel lists."""
        if self.logprobs < 0:
            return None
        decode = self.model.tokenizer.decode
        if self.chat:
            def entry(t, lp):
                text = decode([t])
                return {"token": text, "logprob": lp, "bytes": list(text.encode())}

            return {"content": [dict(entry(t[0], t.logprob), top_logprobs=[entry(i, lp) for i, lp in t.top])
                                for t in tokens]}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t in tokens:
            text = decode([t[0]])
            self._reported.append(t[0])
            out["tokens"].append(text)
            out["token_logprobs"].append(t.logprob)
            out["top_logprobs"].append({decode([i]): lp for i, lp in t.top})
            # where the token's text starts in the completion (a decoder may put a space before it)
            out["text_offset"].append(len(decode(self._reported)) - len(text))
        return out



def usage_of(completions: list) -> dict:
    """A request's usage: its prompt once, every choice's tokens."""
    prompt, made = completions[0].prompt_tokens, sum(c.completion_tokens for c in completions)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}


_STATUS = {"INVALID_ARGUMENT": (400, "invalid_request_error"), "NOT_FOUND": (404, "not_found_error"),
           "FAILED_PRECONDITION": (400, "invalid_request_error"), "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
           "UNAVAILABLE": (503, "server_error"), "DEADLINE_EXCEEDED": (504, "server_error")}


def make_handler(pipeline, model: Model):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # quiet: no line per request on stderr
            pass

        def _json(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, kind: str, message: str) -> None:
            self._json(status, {"error": {"message": message, "type": kind, "param": None, "code": None}})

        def do_GET(self):
            if self.path.rstrip("/") == "/v1/models":
                return self._json(200, {"object": "list", "data": [
                    {"id": model.name, "object": "model", "created": model.created, "owned_by": "kiln",
                     "max_model_len": model.max_context or None}]})
            if self.path.rstrip("/") == "/health":  # serving: the model is compiled and loaded
                return self._json(200, {"status": "ok"})
            if self.path.rstrip("/") == "/metrics":  # this process's (kiln.core.metrics), as vLLM's server has them
                from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

                data = generate_latest()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self._error(404, "not_found_error", f"no route {self.path}")

        def do_POST(self):
            route = self.path.rstrip("/")
            if route not in ("/v1/completions", "/v1/chat/completions"):
                return self._error(404, "not_found_error", f"no route {self.path}")
            try:
                length = int(self.headers.get("Content-Length", "0"))
                if not 0 < length <= MAX_BODY_BYTES:
                    raise errors.InvalidArgument(f"a request body of 1..{MAX_BODY_BYTES} bytes is required")
                try:
                    body = json.loads(self.rfile.read(length))
                except ValueError as e:
                    raise errors.InvalidArgument(f"the body is not JSON: {e}") from e
                if not isinstance(body, dict):
                    raise errors.InvalidArgument("the body must be a JSON object")
                if body.get("model") not in (None, model.name):
                    raise errors.NotFound(f"model {body.get('model')!r} is not served here; this server serves "
                                          f"{model.name!r}")
                check_fields(route, body)
                options = body.get("stream_options")
                if options is not None and (not body.get("stream") or not isinstance(options, dict)
                                            or set(options) - {"include_usage"}):
                    raise errors.InvalidArgument("stream_options takes {include_usage: bool}, and only with stream")
                chat = route.endswith("chat/completions")
                if chat:
                    if model.chat_template is None:
                        raise errors.NotFound(f"{model.name} has no chat template: use /v1/completions")
                    ids = model.tokenizer.encode(render_chat(model, body.get("messages")), add_special_tokens=False).ids
                else:
                    ids = prompt_ids(model, body.get("prompt"))
                completions = []
                try:
                    for seed in choice_seeds(body):
                        completions.append(Completion(pipeline, model, ids, body, chat, seed))
                except errors.KilnError:
                    for c in completions:  # the choices started already are freed
                        c.tokens.close()
                    raise
            except errors.KilnError as e:
                status, kind = _STATUS.get(e.code, (500, "server_error"))
                return self._error(status, kind, str(e))
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            try:
                if body.get("stream"):
                    self._stream(completions, rid, chat, bool((body.get("stream_options") or {}).get("include_usage")))
                else:
                    texts, tokens = [""] * len(completions), [[] for _ in completions]
                    for i, piece, made in merged(completions):
                        texts[i] += piece or ""
                        tokens[i] += made
                    choices = []
                    for i, (c, text) in enumerate(zip(completions, texts)):
                        logprobs = c.logprobs_json(tokens[i])
                        choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                        "logprobs": logprobs, "finish_reason": c.finish_reason} if chat else
                                       {"index": i, "text": text, "logprobs": logprobs,
                                        "finish_reason": c.finish_reason})
                    self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                                     "created": int(time.time()), "model": model.name, "choices": choices,
                                     "usage": usage_of(completions)})
            except errors.KilnError as e:  # failed midway: the status line may be gone already
                if not body.get("stream"):
                    status, kind = _STATUS.get(e.code, (500, "server_error"))
                    self._error(status, kind, str(e))

        def _stream(self, completions: list, rid: str, chat: bool, usage: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            created = int(time.time())

            def event(i: int, delta: Optional[dict], text: Optional[str], finish, last: bool = False,
                      logprobs: Optional[dict] = None) -> None:
                if chat:
                    choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
                    obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model.name,
                           "choices": [choice]}
                else:
                    choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish}
                    obj = {"id": rid, "object": "text_completion", "created": created, "model": model.name,
                           "choices": [choice]}
                if usage:  # every chunk says it has none; the last one, with no choices, has it
                    obj["usage"] = usage_of(completions) if last else None
                    if last:
                        obj["choices"] = []
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            choices = merged(completions)
            try:
                if chat:
                    for i in range(len(completions)):
                        event(i, {"role": "assistant", "content": ""}, None, None)
                for i, piece, tokens in choices:
                    if piece is None:  # choice i is done
                        event(i, {}, "", completions[i].finish_reason)
                    else:
                        event(i, {"content": piece}, piece, None, logprobs=completions[i].logprobs_json(tokens))
                if usage:
                    event(0, None, None, None, last=True)
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client left
            finally:
                choices.close()  # every choice's token stream is closed, freeing its sequence

    return Handler


def prompt_ids(model: Model, prompt) -> list[int]:
    """A completion's prompt as token ids: text (tokenized), or token ids, alone or as a batch of one."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return model.tokenizer.encode(prompt, add_special_tokens=True).ids
    vocab = model.vocab_size or model.tokenizer.get_vocab_size()
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise errors.InvalidArgument(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
        return list(prompt)
    raise errors.InvalidArgument("prompt must be a non-empty string or a non-empty list of token ids "
                                 "(one prompt per request)")


def load_model(pipeline, path: str | Path, max_context: int, max_batch: int, name: str = "") -> Model:
    from kiln.llm import compile_causal_lm, load_tokenizer
    from kiln.v1 import services_pb2

    tokenizer = load_tokenizer(path)
    template, bos, eos = load_chat_template(path)
    digest = compile_causal_lm(path, pipeline, max_context=max_context, max_batch=max_batch, name=name)
    lm = pipeline.store.get_message(digest, services_pb2.CausalLM)
    return Model(name or Path(path).name, digest, tokenizer, template, bos, eos, lm.max_context, int(time.time()),
                 lm.vocab_size)


def serve(pipeline, model: Model, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Start serving in a background thread; returns the server (server_address, shutdown())."""
    import threading

    server = ThreadingHTTPServer((host, port), make_handler(pipeline, model))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kiln-openai", daemon=True).start()
    return server
