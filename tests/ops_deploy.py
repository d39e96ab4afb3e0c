"""A tiny REAL CPU deployment for the operations tests: quantize (full_prec) -> build -> repo -> tritonserver.

The target is a random tiny Llama with a chat template; the draft is the same model, so every draft
token is accepted unless a canary sends a request down the plain path. Servers bind 127.0.0.1 and
are always stopped.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml
from tiny_models import SERVER_READY_TIMEOUT_S

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def chat_text(messages, generation_prompt: bool = True) -> str:
    """CHAT_TEMPLATE applied by hand (independent of transformers' renderer)."""
    return "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + (
        "<|assistant|>" if generation_prompt else ""
    )


_MODEL: list[Path] = []  # made once per test process


def make_model(root: Path) -> Path:
    """The tiny model (with CHAT_TEMPLATE) under root, or the one made earlier in this process."""
    from transformers import AutoTokenizer

    if _MODEL and _MODEL[0].is_dir():
        return _MODEL[0]

    from tiny_models import make_tiny_model, make_tokenizer

    tok_dir, model_dir = root / "tokenizer", root / "model"
    make_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(tok_dir))
    make_tiny_model(model_dir, tok_dir, seed=0)
    _MODEL[:] = [model_dir]
    return model_dir


_BUILT: dict = {}  # (model_dir, name) -> a root whose engines/ was built once in this test process


def build(root: Path, model_dir: Path, name: str, **sections):
    """(recipe, layout, recipe_path) of a built CPU deployment under root (quantize, build and repo ran).

    Deployments of one model and name differ only in their serving sections here, so the quantized
    checkpoints and engines of the first are copied (stages then say "up to date") to save a minute.
    """
    import shutil

    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy import backend_stages
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe
    from specdeploy.recipe.load import parse_recipe

    raw = {
        "name": name,
        "target": {"model": str(model_dir)},
        "draft": {"model": str(model_dir)},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        "engine": {"dtype": "float32", "max_batch_size": 4, "max_input_len": 256, "max_seq_len": 320},
        "validation": {"max_tokens": 16, "request_timeout_s": 60.0},
        "triton": {"startup_timeout_s": SERVER_READY_TIMEOUT_S},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    recipe = parse_recipe(raw)
    root.mkdir(parents=True, exist_ok=True)
    recipe_path = root / f"{name}.yaml"
    recipe_path.write_text(yaml.safe_dump(raw))
    layout = Layout.of(recipe, root)
    done = _BUILT.get((str(model_dir), name))
    if done is not None and done != root:
        source = Layout.of(recipe, done)
        for part in (
            source.checkpoint("target"),
            source.checkpoint("draft"),
            source.engine("target"),
            source.engine("draft"),
        ):
            shutil.copytree(part, layout.engines / part.relative_to(source.engines))
    _BUILT.setdefault((str(model_dir), name), root)
    quiet = lambda *a, **k: None  # noqa: E731
    quantize_recipe(recipe, layout, echo=quiet, progress=False)
    build_recipe(recipe, layout, echo=quiet)
    backend_stages.of(recipe).write_repository(recipe, layout, recipe_path=str(recipe_path))
    return recipe, layout, recipe_path


@contextlib.contextmanager
def running(layout, startup_s: float = SERVER_READY_TIMEOUT_S):
    """A tritonserver on the layout's repository (free loopback ports); stopped on exit, also on failure."""
    from specdeploy.triton import ports, server

    srv = server.start(layout.repo, ports.Ports.pick(), Path(layout.server_state) / "tritonserver.log")
    try:
        server.wait_ready(srv, startup_s)
        yield srv
    finally:
        srv.stop()
