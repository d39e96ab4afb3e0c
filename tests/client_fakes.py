"""Scripted fakes for the validation core: a char-level codec and an in-memory endpoint."""

from __future__ import annotations

import threading

import numpy as np

from specdeploy.client.protocol import SPECULATIVE_MODEL, GenerateResult, PerfMetrics, TargetTrace
from specdeploy.core.errors import ClientError

VOCAB = 256
END_ID = 3  # a "special" token: the codec's decode skips it, as the server's skip_special_tokens does


class CharCodec:
    """One token per character; `template=True` gives it a chat template `<role>content</role>...<assistant>`."""

    def __init__(self, template: bool = True):
        self.template = template

    def encode(self, text):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != END_ID)

    def prompt_tokens(self, text):
        return len(text)  # no special tokens added

    def chat_renderer(self):
        if not self.template:
            return None
        return lambda messages: "".join(f"<{role}>{content}</{role}>" for role, content in messages) + "<assistant>"


def continuation(prompt: str, n: int) -> str:
    """The fake target's greedy output: deterministic letters from the prompt."""
    seed = sum(map(ord, prompt))
    return "".join(chr(97 + (seed + 7 * i) % 26) for i in range(n))


class FakeEndpoint:
    """Control = `continuation`; speculative = the same, except where scripted to differ.

    corrupt: {prompt_prefix: (index, replacement_char or None, logit_gap)} changes one character/
      token of the speculative output (None: the speculative output ends there); the target's logit
      of the replacement (of END_ID for None) at that index is 5.0 - logit_gap, the control's 5.0.
    lengths: {prompt_prefix: n}: the control answers n tokens, then END_ID (an early end).
    latency: (control_s, speculative_s) per request, or a callable (model, prompt) -> seconds.
    ttft: seconds; decode_s of a request = latency - ttft - 0.001.
    fail_after: raise ClientError after that many generate calls (a server dying mid-run).
    decoupled: the models are decoupled; broken_stream: streamed text differs (U+FFFD for one char).
    sample_p: {model: [p(a), p(b)]} for seeded (sampled) requests; default [0.7, 0.3] on both.
    k_cap: the speculative path returns `speculative_k_history` (a plain prefill round, then its rounds), each round's
      k capped at k_cap, as a deployment whose schedule caps the request's k; None: no history.
    draft_counts: False: the speculative path returns no draft counts (a runtime that only exports them on /metrics).
    """

    url = "fake:0"

    def __init__(
        self,
        corrupt=None,
        lengths=None,
        latency=(0.010, 0.005),
        ttft=0.002,
        fail_after=None,
        ready=True,
        accepted_share=0.75,
        k=4,
        decoupled=False,
        broken_stream=False,
        sample_p=None,
        k_cap=None,
        draft_counts=True,
    ):
        self.corrupt = corrupt or {}
        self.lengths = lengths or {}
        self.latency = latency
        self.ttft = ttft
        self.fail_after = fail_after
        self.ready = ready
        self.accepted_share = accepted_share
        self.k = k
        self.decoupled = decoupled
        self.broken_stream = broken_stream
        self.sample_p = sample_p or {}
        self.k_cap = k_cap
        self.draft_counts = draft_counts
        self.calls = []
        self.traces = []  # (prompt, with_logits)
        self.lock = threading.Lock()

    def check_ready(self, models):
        if not self.ready:
            raise ClientError("cannot reach fake:0", "start the server")

    def is_decoupled(self, model):
        return self.decoupled

    @staticmethod
    def _match(table, prompt):
        for prefix, value in table.items():
            if prompt.startswith(prefix):
                return value
        return None

    def _control_text(self, prompt, max_tokens):
        n = self._match(self.lengths, prompt)
        return continuation(prompt, max_tokens if n is None else min(n, max_tokens))

    def _latency(self, model, prompt):
        if callable(self.latency):
            return self.latency(model, prompt)
        return self.latency[1] if model == SPECULATIVE_MODEL else self.latency[0]

    def generate(self, model, request, timeout_s):
        with self.lock:
            self.calls.append((model, request))
            if self.fail_after is not None and len(self.calls) > self.fail_after:
                raise ClientError("server at fake:0 went away (UNAVAILABLE)")
        text = self._control_text(request.prompt, request.max_tokens)
        perf = PerfMetrics()
        latency = self._latency(model, request.prompt)
        k_history = None
        if model == SPECULATIVE_MODEL:
            rule = self._match(self.corrupt, request.prompt)
            if rule is not None:
                index, char, _ = rule
                text = text[:index] if char is None else text[:index] + char + text[index + 1 :]
            k = request.num_draft_tokens or self.k
            rounds = -(-len(text) // (k * self.accepted_share + 1))
            accepted = len(text) - int(rounds)
            if self.draft_counts:
                perf = PerfMetrics(total_draft_tokens=int(rounds) * k, total_accepted_draft_tokens=accepted)
            if self.k_cap is not None:
                k_history = [0] + [min(k, self.k_cap)] * int(rounds)
        if request.sampling is not None and request.sampling.seed is not None:
            rng = np.random.default_rng(request.sampling.seed)
            p = self.sample_p.get(model, [0.7, 0.3])
            text = "".join(rng.choice(list("ab"), p=p) for _ in range(request.max_tokens))
        responses = 1
        if request.stream:
            responses = max(len(text), 1)
            if self.broken_stream and text:
                text = "\ufffd" + text[1:]
        return GenerateResult(
            text=text,
            latency_s=latency,
            ttft_s=self.ttft,
            ttft_source="stream" if request.stream else "server",
            decode_s=latency - self.ttft - 0.001,
            responses=responses,
            perf=perf,
            k_history=k_history,
        )

    def trace(self, prompt, max_tokens, timeout_s, with_logits=True):
        with self.lock:
            self.traces.append((prompt, with_logits))
        text = self._control_text(prompt, max_tokens)
        ids = [ord(c) for c in text] + ([END_ID] if len(text) < max_tokens else [])
        logits = None
        if with_logits:
            logits = np.zeros((len(ids), VOCAB), dtype=np.float32)  # [generated, vocab]
            rule = self._match(self.corrupt, prompt)
            for i, t in enumerate(ids):
                logits[i, t] = 5.0
                if rule is not None and i == rule[0]:
                    logits[i, END_ID if rule[1] is None else ord(rule[1])] = 5.0 - rule[2]
        return TargetTrace(prompt_ids=[ord(c) for c in prompt], output_ids=ids, logits=logits, end_id=END_ID)

    def close(self):
        pass
