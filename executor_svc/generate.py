"""Generation: a KV cache per sequence in executor memory, decode steps shared by sequences.

A Batcher serves one CausalLM (kiln/llm.py). Each request becomes a Sequence with its own
cache (per layer, keys and values [1, kv heads, length, head dim]) and attention mask (1 for a
real token, 0 for a pad slot). One thread runs the model: it prefills sequences that have
arrived, then runs one decode step over every active sequence (continuous batching: requests
join and leave between steps). A step left-pads the shorter caches to the longest with masked
slots; a masked key gets exactly zero weight, so a sequence's tokens do not depend on what it
was batched with. Tokens go to each sequence's queue as they are made.

Limits: at most `max_sequences` sequences at once and the CausalLM's max context (prompt plus
new tokens). A request that finds every sequence slot taken waits in a bounded queue
(KILN_MAX_WAITING, default WAITING_PER_SEQUENCE per slot) and starts when a slot frees, in
arrival order; past the context, or with the queue full, it gets ResourceExhausted. A cancelled
sequence (its client went away) leaves at once: its slot and its cache are released before the
next step, and a waiting one leaves the queue.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np

from kiln.core.errors import InvalidArgument, KilnError, ResourceExhausted
from kiln.core import metrics
from kiln.core.metrics import EXECUTOR_ACTIVE, EXECUTOR_BATCH, EXECUTOR_QUEUE
from kiln.core.telemetry import child_span

MIN_PAST = 2  # kiln/llm.py: the decode program's cache holds at least two slots
FINISH_LENGTH, FINISH_EOS, FINISH_STOP = "length", "eos", "stop"
CANCELLED = object()  # ends a cancelled sequence's stream
MAX_LOGPROBS = 20      # most likely tokens reported per token, at most (OpenAI's top_logprobs bound)


WAITING_PER_SEQUENCE = 4  # requests that may wait per sequence slot, by default


def max_waiting_setting(max_sequences: int) -> int:
    """KILN_MAX_WAITING: requests that may wait for a sequence slot (0: none wait, a full
    executor refuses at once). Default WAITING_PER_SEQUENCE per slot."""
    v = os.environ.get("KILN_MAX_WAITING", "")
    try:
        n = int(v) if v else WAITING_PER_SEQUENCE * max_sequences
    except ValueError:
        n = -1
    if n < 0:
        raise InvalidArgument(f"KILN_MAX_WAITING must be a whole number of requests, at least 0, got {v!r}")
    return n


def max_sequences_setting(default: int) -> int:
    v = os.environ.get("KILN_MAX_SEQUENCES", "")
    try:
        n = int(v) if v else default
    except ValueError:
        raise InvalidArgument(f"KILN_MAX_SEQUENCES must be a whole number, got {v!r}") from None
    return max(1, min(n, default))


@dataclass
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    logprobs: int = -1  # >= 0: each token's log-probability, and this many of the most likely tokens'

    def check(self, vocab: int) -> None:
        if not -1 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}] (or off), got {self.logprobs}")
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise InvalidArgument(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.top_p <= 1:
            raise InvalidArgument(f"top_p must be in [0, 1], got {self.top_p}")


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The token's log-probability under the model (the log-softmax of its logits, before any
    temperature or cut: what OpenAI's and vLLM's logprobs report) and the k most likely tokens'."""
    z = logits.astype(np.float64)
    z = z - z.max()
    lp = z - np.log(np.exp(z).sum())
    top = np.argsort(-lp, kind="stable")[:k]
    return float(lp[token]), tuple((int(t), float(lp[t])) for t in top)


def choose_token(logits: np.ndarray, s: Sampling, rng: Optional[np.random.Generator]) -> int:
    """The next token: the first maximum when greedy; else a draw from the softmax of the
    logits over the temperature, cut to the top k and to the smallest set whose probability
    reaches top_p, made with the sequence's own seeded generator."""
    if s.temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    order = np.argsort(-z, kind="stable")
    if s.top_k:
        order = order[:s.top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if 0 < s.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p)) + 1  # the first prefix reaching top_p
        order, p = order[:keep], p[:keep] / p[:keep].sum()
    i = int(np.searchsorted(np.cumsum(p), rng.random() * 1.0, side="right"))
    return int(order[min(i, len(order) - 1)])


@dataclass
class Sequence:
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop: list[tuple[int, ...]]
    eos: frozenset
    out: "queue.Queue" = field(default_factory=queue.Queue)
    generated: list[int] = field(default_factory=list)
    cache: Optional[list[np.ndarray]] = None
    mask: Optional[np.ndarray] = None
    position: int = 0          # real tokens in the cache: the next token's position
    finished: bool = False
    cancelled: bool = False
    arrived: float = field(default_factory=time.monotonic)  # for the latency metrics
    last_token: float = 0.0

    def __post_init__(self):
        self.rng = np.random.default_rng(self.sampling.seed) if self.sampling.temperature > 0 else None

    def stream(self) -> Iterator[tuple[int, int, str, Optional[float], tuple]]:
        """(token, index, finish reason or "", its log-probability, the most likely tokens'
        ((token, log-probability), ...); None and () unless Sampling.logprobs asks) as they are
        made; raises what the model raised; ends when the sequence is cancelled (so a server
        thread reading it is let go)."""
        while True:
            item = self.out.get()
            if item is CANCELLED:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
            if item[2]:
                return


class Batcher:
    def __init__(self, lm, prefill, decode, run, max_sequences: int):
        self.lm, self.prefill, self.decode, self.run = lm, prefill, decode, run
        self.max_sequences = max_sequences
        self.max_waiting = max_waiting_setting(max_sequences)
        self.eos = frozenset(int(e) for e in lm.eos_token_ids)
        self.cond = threading.Condition()
        self.pending: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.steps = 0             # decode steps run, and
        self.batched = 0           # sequences they computed together (batched / steps: mean batch)
        self._thread: Optional[threading.Thread] = None
        name = lm.name or "kiln"  # the metrics' model_name
        self._waiting, self._running = metrics.REQUESTS_WAITING.labels(name), metrics.REQUESTS_RUNNING.labels(name)
        self._ttft, self._itl = metrics.TIME_TO_FIRST_TOKEN.labels(name), metrics.INTER_TOKEN_LATENCY.labels(name)
        self._e2e, self._queued = metrics.E2E_REQUEST_LATENCY.labels(name), metrics.REQUEST_QUEUE_TIME.labels(name)
        self._prompt_tokens = metrics.PROMPT_TOKENS.labels(name)
        self._generation_tokens = metrics.GENERATION_TOKENS.labels(name)
        self._kv_usage = metrics.KV_CACHE_USAGE.labels(name)
        self._success = lambda reason: metrics.REQUEST_SUCCESS.labels(name, reason)

    # ---- requests ----

    def submit(self, prompt: list[int], max_new_tokens: int = 0, sampling: Sampling = Sampling(),
               stop: tuple[tuple[int, ...], ...] = (), ignore_eos: bool = False) -> Sequence:
        lm = self.lm
        if not prompt:
            raise InvalidArgument("the prompt holds no tokens")
        bad = [t for t in prompt if not 0 <= t < lm.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token {bad[0]} is outside the vocabulary [0, {lm.vocab_size})")
        if max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        sampling.check(lm.vocab_size)
        if any(not s for s in stop):
            raise InvalidArgument("a stop sequence holds no tokens")
        room = lm.max_context - len(prompt)
        if room < 1:
            raise ResourceExhausted(f"a prompt of {len(prompt)} tokens leaves no room in the model's context of "
                                    f"{lm.max_context}")
        if max_new_tokens > room:
            raise ResourceExhausted(f"{len(prompt)} prompt tokens and {max_new_tokens} new ones exceed the model's "
                                    f"context of {lm.max_context} tokens")
        seq = Sequence(list(prompt), max_new_tokens or room, sampling, [tuple(s) for s in stop],
                       frozenset() if ignore_eos else self.eos)
        with self.cond:
            if len(self.active) + len(self.pending) >= self.max_sequences + self.max_waiting:
                raise ResourceExhausted(f"this executor holds {self.max_sequences + self.max_waiting} requests for "
                                        f"this model ({self.max_sequences} generating at once, {self.max_waiting} "
                                        "waiting), its limit; retry later")
            self.pending.append(seq)
            EXECUTOR_QUEUE.inc()
            self._waiting.inc()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kiln-generate", daemon=True)
                self._thread.start()
            self.cond.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The client went away: free the sequence's slot and cache now, and end its stream."""
        with self.cond:
            if not seq.cancelled:
                seq.out.put(CANCELLED)
                if not seq.finished:
                    self._success("abort").inc()
            seq.cancelled = True
            if seq in self.pending:
                self.pending.remove(seq)
                EXECUTOR_QUEUE.dec()
                self._waiting.dec()
            if seq in self.active:
                self.active.remove(seq)
                EXECUTOR_ACTIVE.dec()
                self._running.dec()
            seq.cache = seq.mask = None
            self._cache_usage()

    def busy(self) -> int:
        with self.cond:
            return len(self.pending) + len(self.active)

    # ---- the model's thread ----

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.active:
                    self.cond.wait()
                # as many as there are free slots, in arrival order; the rest wait
                arrived = [self.pending.popleft() for _ in range(min(len(self.pending),
                                                                    self.max_sequences - len(self.active)))]
                self.active.extend(arrived)
                EXECUTOR_QUEUE.dec(len(arrived))
                EXECUTOR_ACTIVE.inc(len(arrived))
                self._waiting.dec(len(arrived))
                self._running.inc(len(arrived))
            now = time.monotonic()
            for seq in arrived:
                self._queued.observe(now - seq.arrived)
            for seq in arrived:
                self._guarded([seq], self._prefill)
            with self.cond:
                batch = [s for s in self.active if not s.cancelled]
            if batch:
                self._guarded(batch, self._decode)
            with self.cond:
                self._cache_usage()

    def _cache_usage(self) -> None:
        """kiln:kv_cache_usage_perc, under self.cond: the running sequences' cached tokens over the
        most the model's sequences may hold."""
        held = sum(len(s.mask) for s in self.active if s.mask is not None)
        self._kv_usage.set(held / max(1, self.max_sequences * self.lm.max_context))

    def _guarded(self, seqs: list[Sequence], step) -> None:
        try:
            step(seqs)
        except Exception as e:  # noqa: BLE001 - the model failed: these requests get the error
            err = e if isinstance(e, KilnError) else KilnError(f"generation failed: {type(e).__name__}: {e}")
            for s in seqs:
                self._finish(s, err)

    def _finish(self, seq: Sequence, error: Optional[BaseException] = None) -> None:
        with self.cond:
            seq.finished = True
            if seq in self.active:
                self.active.remove(seq)
                EXECUTOR_ACTIVE.dec()
                self._running.dec()
            seq.cache = seq.mask = None
        if error is not None:
            seq.out.put(error)

    def _emit(self, seq: Sequence, logits: np.ndarray) -> None:
        token = choose_token(logits, seq.sampling, seq.rng)
        logprob, top = (token_logprobs(logits, token, seq.sampling.logprobs) if seq.sampling.logprobs >= 0
                        else (None, ()))
        seq.generated.append(token)
        reason = ""
        if token in seq.eos:
            reason = FINISH_EOS
        elif any(len(seq.generated) >= len(s) and tuple(seq.generated[-len(s):]) == s for s in seq.stop):
            reason = FINISH_STOP
        elif len(seq.generated) >= seq.max_new_tokens:
            reason = FINISH_LENGTH
        if seq.cancelled:
            return
        now = time.monotonic()
        if len(seq.generated) == 1:
            self._ttft.observe(now - seq.arrived)
        else:
            self._itl.observe(now - seq.last_token)
        seq.last_token = now
        self._generation_tokens.inc()
        if reason:
            self._e2e.observe(now - seq.arrived)
            self._success(reason).inc()
            with self.cond:
                seq.finished = True  # before its client can see the last token (and close: no abort)
        seq.out.put((token, len(seq.generated) - 1, reason, logprob, top))
        if reason:
            self._finish(seq)

    def _prefill(self, seqs: list[Sequence]) -> None:
        (seq,) = seqs
        if seq.cancelled:
            return
        n = len(seq.prompt)
        ids = np.array([seq.prompt], dtype=np.int64)
        mask = np.ones((1, n), dtype=np.int64)
        pos = np.arange(n, dtype=np.int64)[None]
        with child_span("executor.prefill", **{"kiln.prompt_tokens": n}):
            outs = self.run(self.prefill, [("", ids), ("", pos), ("", mask)])
        self._prompt_tokens.inc(n)
        logits, cache = outs[0][1], [a for _, a in outs[1:]]
        seq.cache, seq.mask, seq.position = cache, mask[0], n
        self._emit(seq, logits[0, -1])

    def _decode(self, seqs: list[Sequence]) -> None:
        with self.cond:
            seqs = [s for s in seqs if not s.cancelled and not s.finished]
            if not seqs:
                return
            caches = [(s.cache, s.mask) for s in seqs]
        b = len(seqs)
        width = max(MIN_PAST, max(len(m) for _, m in caches))
        ids = np.array([[s.generated[-1]] for s in seqs], dtype=np.int64)
        pos = np.array([[s.position] for s in seqs], dtype=np.int64)
        mask = np.zeros((b, width), dtype=np.int64)
        stacked = []
        for layer in range(len(caches[0][0])):
            first = caches[0][0][layer]
            buf = np.zeros((b, first.shape[1], width, first.shape[3]), dtype=first.dtype)
            for i, (c, m) in enumerate(caches):
                buf[i, :, width - len(m):] = c[layer][0]
            stacked.append(buf)
        for i, (_, m) in enumerate(caches):
            mask[i, width - len(m):] = m
        with child_span("executor.decode_step", **{"kiln.batch": b, "kiln.cache_len": width}):
            outs = self.run(self.decode, [("", ids), ("", pos), ("", mask)] + [("", c) for c in stacked])
        self.steps += 1
        self.batched += b
        EXECUTOR_BATCH.observe(b)
        logits, grown = outs[0][1], [a for _, a in outs[1:]]
        for i, s in enumerate(seqs):
            keep = len(caches[i][1]) + 1
            with self.cond:
                if s.cancelled:
                    continue
                s.cache = [np.ascontiguousarray(g[i:i + 1, :, -keep:]) for g in grown]
                s.mask = np.append(s.mask, 1)
                s.position += 1
            self._emit(s, logits[i, -1])
