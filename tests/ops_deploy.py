"""A tiny REAL CPU deployment for the operations tests: quantize (full_prec) -> build -> repo -> tritonserver.

The target is a random tiny Llama with a chat template; the draft is the same model, so every draft
token is accepted unless a canary sends a request down the plain path. Servers bind 127.0.0.1 and
are always stopped.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_text(messages, generation_prompt: bool = True) -> str:
    """CHAT_TEMPLATE applied by hand (independent of transformers' renderer)."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + ("<|assistant|>" if generation_prompt else "")


def make_model(root: Path) -> Path:
    from transformers import AutoTokenizer

    from specdeploy.testing import make_tiny_model, make_tokenizer

    tok_dir, model_dir = root / "tokenizer", root / "model"
    make_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(tok_dir))
    make_tiny_model(model_dir, tok_dir, seed=0)
    return model_dir


def build(root: Path, model_dir: Path, name: str, **sections):
    """(recipe, layout, recipe_path) of a built CPU deployment under root (quantize, build and repo ran)."""
    from specdeploy.artifacts import Layout
    from specdeploy.config import parse_recipe
    from specdeploy.engine.build import build_recipe
    from specdeploy.quantize import quantize_recipe
    from specdeploy.triton import repository

    raw = {
        "name": name,
        "target": {"model": str(model_dir)},
        "draft": {"model": str(model_dir)},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        "engine": {"dtype": "float32", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 320},
        "validation": {"max_tokens": 16, "request_timeout_s": 60.0},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    recipe = parse_recipe(raw)
    recipe_path = root / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    layout = Layout.of(recipe, root)
    quiet = lambda *a, **k: None  # noqa: E731
    quantize_recipe(recipe, layout, echo=quiet, progress=False)
    build_recipe(recipe, layout, echo=quiet)
    repository.generate_repository(recipe, layout, recipe_path=str(recipe_path))
    return recipe, layout, recipe_path


@contextlib.contextmanager
def running(layout, startup_s: float = 240):
    """A tritonserver on the layout's repository (free loopback ports); stopped on exit, also on failure."""
    from specdeploy.triton import server

    srv = server.start(layout.repo, server.Ports.pick(), Path(layout.server_state) / "tritonserver.log")
    try:
        server.wait_ready(srv, startup_s)
        yield srv
    finally:
        srv.stop()
