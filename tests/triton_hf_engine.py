"""A stand-in for specdeploy.engine.model.CpuEngine in the Triton tests: a tiny Hugging Face model with the
same engine API (spec, new_cache, forward), run by the real Executor inside tritonserver.

Each logits row is computed by a one-token step over the KV of its prefix, so a row depends only on its
prefix: scoring k + 1 positions at once gives exactly the rows of k + 1 one-token steps, which is
the property CpuEngine guarantees and greedy parity needs. Loaded via the repository's
`executor_factory` parameter (only in tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

SPEC_FILE = "engine_spec.json"  # written by the test fixture beside the HF model


class _Cache:
    """A Hugging Face DynamicCache with the position-pointer API of specdeploy's KVCache."""

    def __init__(self):
        from transformers import DynamicCache

        self.kv = DynamicCache()
        self.length = 0

    def truncate(self, n: int) -> None:
        from transformers import DynamicCache

        if n == 0:
            self.kv = DynamicCache()
        elif n < self.length:
            self.kv.crop(n - self.length)  # transformers 5: a negative count removes that many positions
        self.length = min(n, self.length)


class HfEngine:
    def __init__(self, model_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        spec = json.loads((Path(model_dir) / SPEC_FILE).read_text())
        self.spec = SimpleNamespace(vocab_size=self.model.config.vocab_size, **spec)

    def new_cache(self, max_len: int) -> _Cache:
        return _Cache()

    @torch.no_grad()
    def forward(self, cache: _Cache, token_ids: torch.Tensor) -> torch.Tensor:
        # One position per model call, always: a row (and the KV it leaves) then depends only on its
        # prefix, however many tokens a call brings (prefill, one decode step or k + 1 to verify).
        rows = []
        for token in token_ids.tolist():
            out = self.model(
                input_ids=torch.tensor([[int(token)]]),
                position_ids=torch.tensor([[cache.length]]),
                past_key_values=cache.kv,
                use_cache=True,
            )
            cache.length += 1
            rows.append(out.logits[0, -1].float())
        return torch.stack(rows)  # [n, vocab]


def load_executor(engine_dir: str):
    from specdeploy.engine.executor import Executor

    torch.set_num_threads(1)  # the test machine is shared: one thread per model instance
    return Executor(HfEngine(engine_dir), max_cached_sequences=4)


def make_engines(root, target_dir, draft_dir, max_draft_len: int = 4, **recipe_overrides):
    """A recipe and fake 'build' outputs (HF model + tokenizer + engine_spec.json + manifest) under root."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": "tiny",
        "target": {"model": str(target_dir)},
        "draft": {"model": str(draft_dir)},
        "speculative": {"max_draft_len": max_draft_len, "num_draft_tokens": 3},
        "engine": {"dtype": "float32", "max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128},
        "validation": {"max_tokens": 16},
        # the HF stand-in executor cannot step requests together, so its models serve one request at a time and the
        # BLS gets triton.instance_count instances (the auto rule for engines that do not batch in flight)
        "triton": {"inflight_batching": False},
    }
    for key, value in recipe_overrides.items():
        raw[key] = {**raw.get(key, {}), **value}
    recipe = parse_recipe(raw)
    layout = Layout.of(recipe, root)
    for role, src in (("target", target_dir), ("draft", draft_dir)):
        write_engine(layout.engine(role), src, recipe, role, max_draft_len if role == "target" else 0)
    return recipe, layout


def write_engine(dest, src, recipe, role, max_draft_len, fingerprint=None):
    import shutil

    from specdeploy.core.artifacts import Manifest

    dest = Path(dest)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    e = recipe.engine
    spec = {"max_seq_len": e.max_seq_len, "max_input_len": e.max_input_len, "max_draft_len": max_draft_len}
    (dest / SPEC_FILE).write_text(json.dumps(spec))
    Manifest(
        stage="build",
        recipe_name=recipe.name,
        fingerprint=fingerprint or f"test-{role}",
        settings=dict(spec),
    ).write(dest)
