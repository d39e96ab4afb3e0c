"""Scripted fakes for the validation core: a char-level codec and an in-memory endpoint."""

from __future__ import annotations

import threading

import numpy as np

from specdeploy.client.protocol import (
    SPECULATIVE_MODEL,
    GenerateResult,
    PerfMetrics,
    TargetTrace,
)
from specdeploy.errors import ClientError

VOCAB = 256


class CharCodec:
    def encode(self, text):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def continuation(prompt: str, n: int) -> str:
    """The fake target's greedy output: deterministic letters from the prompt."""
    seed = sum(map(ord, prompt))
    return "".join(chr(97 + (seed + 7 * i) % 26) for i in range(n))


class FakeEndpoint:
    """Control = `continuation`; speculative = the same, except where scripted to differ.

    corrupt: {prompt_text_prefix: (index, replacement_char, logit_gap)} changes one character/token.
    latency: (control_s, speculative_s) per request; ttft: seconds; fail_after: raise ClientError
    after that many generate calls (a server dying mid-run).
    """

    url = "fake:0"

    def __init__(self, corrupt=None, latency=(0.010, 0.005), ttft=0.002, fail_after=None, ready=True, accepted_share=0.75, k=4):
        self.corrupt = corrupt or {}
        self.latency = latency
        self.ttft = ttft
        self.fail_after = fail_after
        self.ready = ready
        self.accepted_share = accepted_share
        self.k = k
        self.calls = []
        self.lock = threading.Lock()

    def check_ready(self, models):
        if not self.ready:
            raise ClientError("cannot reach fake:0", "start the server")

    def is_decoupled(self, model):
        return False

    def _rule(self, prompt):
        for prefix, rule in self.corrupt.items():
            if prompt.startswith(prefix):
                return rule
        return None

    def generate(self, model, request, timeout_s):
        with self.lock:
            self.calls.append((model, request))
            if self.fail_after is not None and len(self.calls) > self.fail_after:
                raise ClientError("server at fake:0 went away (UNAVAILABLE)")
        text = continuation(request.prompt, request.max_tokens)
        perf = PerfMetrics()
        latency = self.latency[0]
        if model == SPECULATIVE_MODEL:
            latency = self.latency[1]
            rule = self._rule(request.prompt)
            if rule is not None:
                index, char, _ = rule
                text = text[:index] + char + text[index + 1 :]
            k = request.num_draft_tokens or self.k
            rounds = -(-len(text) // (k * self.accepted_share + 1))
            accepted = len(text) - int(rounds)
            perf = PerfMetrics(total_draft_tokens=int(rounds) * k, total_accepted_draft_tokens=accepted)
        if request.sampling is not None and request.sampling.seed is not None:
            rng = np.random.default_rng(request.sampling.seed)
            text = "".join(rng.choice(list("ab"), p=[0.7, 0.3]) for _ in range(request.max_tokens))
        return GenerateResult(text=text, latency_s=latency, ttft_s=self.ttft, ttft_source="server", perf=perf)

    def trace(self, prompt, max_tokens, timeout_s):
        text = continuation(prompt, max_tokens)
        ids = [ord(c) for c in text]
        logits = np.zeros((len(ids), VOCAB), dtype=np.float32)
        rule = self._rule(prompt)
        for i, t in enumerate(ids):
            logits[i, t] = 5.0
            if rule is not None and i == rule[0]:
                logits[i, ord(rule[1])] = 5.0 - rule[2]
        return TargetTrace(prompt_ids=[ord(c) for c in prompt], output_ids=ids, logits=logits)

    def close(self):
        pass
