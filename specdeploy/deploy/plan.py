"""`specdeploy check`: the resolved plan of a recipe, stage by stage, with what is already built."""

from __future__ import annotations

import difflib
from pathlib import Path

from specdeploy.core import model_store as models
from specdeploy.core.artifacts import Layout, Manifest
from specdeploy.core.errors import ConfigError
from specdeploy.recipe.config import Recipe


def _state(directory: Path) -> str:
    manifest = Manifest.read(directory)
    if manifest is None:
        return "missing"
    return f"present ({manifest.stage}, {manifest.created}, fingerprint {manifest.fingerprint})"


def _model_source(name: str) -> tuple[str, Path | None]:
    """Describe a recipe model without downloading anything; the path when it is available locally."""
    if name in models.BUNDLED:
        if models.is_fetched(name):
            return f"bundled {name}, fetched at {models.cached_path(name)}", models.cached_path(name)
        return f"bundled {name}, not fetched yet (specdeploy models fetch {name})", None
    if not Path(name).expanduser().exists():
        if (
            "/" not in name
        ):  # a bare name is a bundled model's or a folder here: neither, so quantize would refuse it now
            close = difflib.get_close_matches(name, list(models.BUNDLED), n=1)
            raise ConfigError(
                f"model {name!r} is neither a bundled model nor a folder here",
                (
                    f"did you mean {close[0]}?"
                    if close
                    else f"use one of: {', '.join(models.BUNDLED)}, or a model folder's path"
                ),
            )
        return f"local folder {name} (not on this machine; needed when a stage runs)", None
    return f"local folder {name}", models.resolve(name)


def _file_state(path: str) -> str:
    return (
        "here"
        if Path(path).expanduser().is_file()
        else "NOT on this machine (the stage that reads it fails without it)"
    )


def _head_line(recipe: Recipe, layout: Layout) -> str:
    """draft.kind eagle3: where the head comes from and whether it is there."""
    from specdeploy.recipe.config import EAGLE3_HEAD_TRAINED

    folder = layout.eagle3_head_source(recipe.draft.head)
    present = (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    if recipe.draft.head == EAGLE3_HEAD_TRAINED:
        made = "trained for this recipe (specdeploy draft data, then specdeploy draft train)"
    else:
        made = f"draft.head {recipe.draft.head}"
    return (
        f"  EAGLE-3 head: {made} -> {folder}:"
        f" {'present' if present else 'MISSING (the repo stage refuses the recipe without it)'}"
    )


def describe(recipe: Recipe, layout: Layout, recipe_path: str) -> str:
    """Check the model pairing that can be checked offline and render the plan as text."""
    sources = {role: _model_source(recipe.model(role).model) for role in recipe.model_roles}
    target_dir, draft_dir = sources["target"][1], sources.get("draft", ("", None))[1]
    if recipe.draft.is_ngram:
        pairing = "n-gram draft (prompt lookup, no weights)"
    elif recipe.draft.is_suffix:
        pairing = "suffix-automaton draft (the request's own text, no weights)"
    elif recipe.draft.is_auto:
        pairing = "AUTO: TensorRT-LLM picks a draft-model-free method (no weights)"
    elif recipe.draft.is_mtp:
        pairing = "MTP: the target's own multi-token-prediction heads (no draft model)"
    elif recipe.draft.kind in ("pard", "dflash"):
        pairing = f"{recipe.draft.kind} draft {recipe.draft.head}, loaded by TensorRT-LLM as it is"
    elif recipe.draft.is_eagle3:
        pairing = "EAGLE-3 head on the target's hidden states (no draft model)"
    elif target_dir is not None and draft_dir is not None:
        models.check_same_tokenizer(target_dir, draft_dir)
        pairing = "draft and target share one tokenizer"
    else:
        pairing = "tokenizer pairing is checked once both models are present"
    s, e = recipe.speculative, recipe.engine
    lines = [
        f"recipe {recipe.name} ({recipe_path}) is valid; backend {recipe.backend}",
        (
            f"  speculative: num_draft_tokens {s.num_draft_tokens} <= max_draft_len {s.max_draft_len}, "
            f"use_draft_logits {s.use_draft_logits}; {pairing}"
        ),
        (
            f"  engine limits: dtype {e.dtype}, max_batch_size {e.max_batch_size}, max_input_len {e.max_input_len}, "
            f"max_seq_len {e.max_seq_len}"
        ),
    ]
    if recipe.draft.is_eagle3:
        lines.append(_head_line(recipe, layout))
    lines += ["", "stages:"]
    for role in recipe.model_roles:
        m = recipe.model(role)
        q = m.quantization
        lines += [
            f"  1. quantize {role}: {sources[role][0]}",
            (
                f"       qformat {q.qformat}, kv_cache_dtype {q.kv_cache_dtype or 'null'}, calib {q.calib_dataset}"
                f" ({q.calib_size} x {q.calib_max_seq_length}"
                f" tokens{'' if q.calib_dataset == 'builtin' else ', ' + _file_state(q.calib_dataset)}), tp {m.tp_size}"
                f" pp {m.pp_size}"
            ),
            f"       -> {layout.checkpoint(role)}: {_state(layout.checkpoint(role))}",
        ]
    for role in recipe.model_roles:
        lines.append(f"  2. build {role} ({recipe.backend}) -> {layout.engine(role)}: {_state(layout.engine(role))}")
    lines += [
        f"  3. repo -> {layout.repo}: {_state(layout.repo)}",
        (
            f"  4. serve: tritonserver on grpc {recipe.triton.grpc_port or 'free port'}, "
            f"{recipe.triton.instance_count} instance(s), decoupled {recipe.triton.decoupled}"
        ),
        (
            "  5. validate: prompts"
            f" {recipe.validation.prompt_set}{_prompt_set_state(recipe.validation.prompt_set)},"
            f" max_tokens {recipe.validation.max_tokens}, concurrency {list(recipe.validation.concurrency)}, gate"
            f" parity >= {recipe.validation.min_parity}, speedup >= {recipe.validation.min_speedup} -> {layout.report}"
        ),
    ]
    return "\n".join(lines)


def _prompt_set_state(prompt_set: str) -> str:
    """Nothing for the built-in set, else the file's state in brackets."""
    return "" if prompt_set == "builtin" else f" ({_file_state(prompt_set)})"
