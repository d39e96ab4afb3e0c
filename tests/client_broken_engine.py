"""A test-only executor factory for tritonserver: specdeploy's CPU engine (the default executor), plus a
hook that corrupts one token of the speculative path.

$SPECDEPLOY_TEST_CORRUPT names a JSON file {"prompt_ids": [...], "index": i, "token": t}, read at
every request (the test writes it once the server runs). A target call that carries draft tokens
(i.e. a verification round of tensorrt_llm_bls) for that prompt replaces the token at generated
index i with t and drops what followed it in that round. The
control (ensemble -> tensorrt_llm without draft tokens) is untouched, so the speculative output
diverges from the control exactly at that index.
"""

from __future__ import annotations

import json
import os

from specdeploy.triton.models.common import load_cpu_executor

ENV = "SPECDEPLOY_TEST_CORRUPT"


class CorruptingExecutor:
    in_flight_batching = False  # the corruption hooks generate(): no in-flight batching around it

    def __init__(self, inner, path: str):
        self.inner = inner
        self.path = path

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _rule(self):
        try:
            with open(self.path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def generate(self, request):
        rule = self._rule() if request.draft_tokens is not None else None
        position = None
        if rule is not None and list(request.input_ids[: len(rule["prompt_ids"])]) == rule["prompt_ids"]:
            position = len(rule["prompt_ids"]) + rule["index"]
        for chunk in self.inner.generate(request):
            offset = None if position is None else position - len(request.input_ids)
            if offset is not None and 0 <= offset < len(chunk.token_ids):
                chunk.token_ids = chunk.token_ids[:offset] + [rule["token"]]
                if chunk.logits is not None:
                    chunk.logits = chunk.logits[: offset + 1]
            yield chunk


def load_executor(engine_dir: str):
    inner = load_cpu_executor(engine_dir)
    path = os.environ.get(ENV)
    return CorruptingExecutor(inner, path) if path else inner
