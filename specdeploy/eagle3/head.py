"""The EAGLE-3 head a recipe drafts with, as the later stages take it: its folder (trained, bundled or a path), the
files a deployment needs from it and their hash; a missing head or counts file is refused with the command that
makes it. `specdeploy run` asks here before its first stage, and the repository stage when it copies the head."""

from __future__ import annotations

from pathlib import Path

from specdeploy.core.artifacts import fingerprint
from specdeploy.core.errors import BuildError
from specdeploy.recipe.config import EAGLE3_HEAD_TRAINED, EAGLE3_VOCAB_COUNTS, Recipe

# the files of the head (copied into the repository, their hash in its fingerprint)
EAGLE3_HEAD_FILES = ("config.json", "model.safetensors")


def eagle3_head_files(recipe: Recipe) -> tuple[str, ...]:
    """The head's files the repository holds: EAGLE3_HEAD_FILES, and its draft-token counts when the CPU engine cuts
    its vocabulary to the most counted (draft.serve_vocab_size)."""
    return EAGLE3_HEAD_FILES + ((EAGLE3_VOCAB_COUNTS,) if recipe.draft.serve_vocab_size else ())


def require_head(recipe: Recipe, layout, recipe_path: str) -> tuple[Path, str]:
    """draft.kind eagle3: (the head folder, the hash of its files). BuildError when there is none, with the command
    that trains it or the key that names another."""
    from specdeploy.core.artifacts import file_hash

    head_dir = layout.eagle3_head_source(recipe.draft.head).resolve()
    missing = [name for name in EAGLE3_HEAD_FILES if not (head_dir / name).is_file()]
    if missing:
        fix = (
            f"train it with: specdeploy draft train {recipe_path}"
            if recipe.draft.head == EAGLE3_HEAD_TRAINED
            else "set draft.head to an exported EAGLE-3 checkpoint folder"
        )
        raise BuildError(f"no EAGLE-3 head at {head_dir} (no {', '.join(missing)})", fix)
    if recipe.draft.serve_vocab_size and not (head_dir / EAGLE3_VOCAB_COUNTS).is_file():
        raise BuildError(
            f"draft.serve_vocab_size is {recipe.draft.serve_vocab_size}, but the EAGLE-3 head at {head_dir} has no "
            f"{EAGLE3_VOCAB_COUNTS} (how often the target wrote each draft token)",
            vocab_counts_fix(recipe, head_dir, layout),
        )
    return head_dir, fingerprint(**{name: file_hash(head_dir / name) for name in eagle3_head_files(recipe)})


def vocab_counts_fix(recipe: Recipe, head: Path, layout) -> str:
    """How to give an eagle3 recipe's head its counts file: `draft vocab-counts` over the recipe's training data
    folder (Layout.train_data) where it has one."""
    own = layout.train_data(recipe.draft.train.data_dir)
    data = (
        str(own)
        if (own / "train.jsonl").is_file()
        else "DRAFT_DATA_DIR (a `specdeploy draft data` folder of this target's answers)"
    )
    return f"count them: specdeploy draft vocab-counts {head} --data {data}, or remove draft.serve_vocab_size"
