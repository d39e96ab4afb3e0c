"""The draft-train stage: `specdeploy draft train RECIPE` trains an EAGLE-3 head for the recipe's target with
NVIDIA ModelOpt (`modelopt.torch.speculative`) and exports the standard EAGLE-3 checkpoint.

`train_recipe` runs the parts, one module each, top to bottom:
  1. `draft_samples.read_draft_data`: the training set `specdeploy draft data RECIPE` wrote (train.jsonl,
     heldout.jsonl, manifest.json), checked against the target's vocabulary.
  2. `draft_train_plan.plan_training` / `check_plan`: steps, time and memory, refused up front over
     draft.train.max_train_hours.
  3. `modelopt_eagle3.choose_draft_vocab`: the head's vocabulary, the most frequent answer tokens, as ModelOpt's
     d2t map.
  4. `modelopt_eagle3.build_model`: the target converted with `mtsp.convert(model, [("eagle", cfg)])`, the head
     sized like the target (one decoder layer with its hidden size, heads and intermediate size), not ModelOpt's 8B
     default.
  5. `draft_train_loop.train_head`: seeded, resumable training (training-time test over draft.train.ttt_steps
     positions, soft labels from the target, loss on answer positions only), held-out acceptance per epoch.
  6. `draft_train_loop.heldout_acceptance`: the share of answer positions where the head's chained greedy draft j
     equals the target's greedy token, j = 1..ttt_steps.
  7. `modelopt_eagle3.export_head`: ModelOpt's exporter, then config.json made to state what was trained.
  8. `train_recipe` (here): the stage (cached by fingerprint, written with atomic_output and a manifest).

ModelOpt 0.47 on CPU has four traps (docs/eagle3-train.md); each workaround says which (`modelopt_eagle3`,
`draft_train_loop`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

from specdeploy.core.errors import ConfigError, ModelError
from specdeploy.eagle3.decode_torch import device_name
from specdeploy.eagle3.modelopt import (
    accept_draft_space_logits,
    aux_layer_ids,
    build_model,
    choose_draft_vocab,
    draft_target_ids,
    export_head,
    load_exported_head,
    use_loss,
    write_vocab_counts,
)
from specdeploy.eagle3.samples import read_draft_data
from specdeploy.eagle3.train_loop import TrainResult, train_head
from specdeploy.eagle3.train_plan import check_disk, check_plan, plan_training
from specdeploy.recipe.config import Eagle3TrainConfig, Recipe, to_plain

STAGE = "eagle3-head"
TRAIN_LOG = "train_log.jsonl"
TOOL_DISTRIBUTIONS = ("nvidia-modelopt", "torch", "transformers", "safetensors")


def train_precision(t: Eagle3TrainConfig, device: str) -> str:
    """draft.train.precision resolved: "auto" is bfloat16 on a GPU or on a CPU that multiplies bf16 in hardware
    (faster there with the same loss: docs/eagle3-train.md "Inputs"), else float32."""
    if t.precision != "auto":
        return t.precision
    from specdeploy.engine.native import bf16_native

    return "bfloat16" if device == "cuda" or bf16_native() else "float32"


def _available_memory(device: str) -> int | None:
    import torch

    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError):
        return None


# draft.train keys added after heads were shipped: at their defaults they stay out of the fingerprint, so those
# heads stay up to date
_LATER_KEYS = {
    "features": "target",
    "init_head": "",
    "length_grouping": False,
    "data_dir": "",
    "label_top_k": 0,
    "heldout_samples": 0,
    "loss": "kl",
}


# draft.train keys that change how fast a head is made, never its bits: not in the fingerprint (a run resumes and a
# head stays up to date across them)
_SAME_HEAD_KEYS = {"feature_cache"}


def stage_fingerprint(
    recipe: Recipe,
    target_hash: str,
    data_fingerprint: str,
    time_limit_s: float | None = None,
    inputs: dict | None = None,
) -> str:
    """A time limit is part of a head's identity (it may cut the steps); without one the fingerprint is as before.
    `inputs`: the other things the head is made from (the engine that gives the features, the head it starts from)."""
    from specdeploy.core.artifacts import fingerprint

    limit = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
    train = {
        k: v
        for k, v in to_plain(recipe.draft.train).items()
        if _LATER_KEYS.get(k, object()) != v and k not in _SAME_HEAD_KEYS
    }
    return fingerprint(stage=STAGE, target=target_hash, data=data_fingerprint, train=train, **limit, **(inputs or {}))


def heldout_subset(data, t):
    """`data` with its held-out samples cut to draft.train.heldout_samples (the first N in the seed's order)."""
    import random
    from dataclasses import replace

    if not t.heldout_samples or len(data.heldout) <= t.heldout_samples:
        return data
    order = list(range(len(data.heldout)))
    random.Random(t.seed).shuffle(order)
    return replace(data, heldout=tuple(data.heldout[i] for i in sorted(order[: t.heldout_samples])))


def init_head_folder(recipe: Recipe, layout, aux_ids: list[int]) -> Path | None:
    """draft.train.init_head resolved (a folder or a bundled head's name), checked to feed from the same layers."""
    from specdeploy.engine.eagle3 import Eagle3HeadConfig

    name = recipe.draft.train.init_head
    if not name:
        return None
    folder = layout.eagle3_head_source(name)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise ConfigError(
            f"draft.train.init_head: {folder} is not an exported EAGLE-3 head (config.json, model.safetensors)",
            "name a head folder that `specdeploy draft train` exported, or a bundled head (specdeploy/data/heads)",
        )
    ids = (
        json.loads((folder / "config.json").read_text()).get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    )
    if ids is not None and sorted(ids) != sorted(aux_ids):
        raise ConfigError(
            f"draft.train.init_head: {folder} reads target layers {ids}, this recipe trains on {aux_ids}",
            f"set draft.train.aux_layers: {list(ids)}, or start from a fresh head (remove init_head)",
        )
    config = Eagle3HeadConfig.read(folder)  # a readable head config, else its own error
    # its d2t and LM head would not load (a size mismatch); a draft vocabulary at least the target's is the whole of it
    wanted = min(recipe.draft.train.draft_vocab_size, config.vocab_size)
    if config.draft_vocab_size != wanted:
        raise ConfigError(
            f"draft.train.init_head: {folder} drafts over {config.draft_vocab_size} tokens, this recipe's "
            f"draft.train.draft_vocab_size is {recipe.draft.train.draft_vocab_size}",
            f"set draft.train.draft_vocab_size: {config.draft_vocab_size}, or start from a fresh head (remove"
            " init_head)",
        )
    return folder


def engine_features(recipe: Recipe, layout, aux_ids: list[int]):
    """draft.train.features: engine: the recipe's built CPU engine (specdeploy.eagle3.features)."""
    from specdeploy.core import artifacts
    from specdeploy.eagle3.features import EngineFeatures

    engine_dir = layout.engine("target")
    manifest = artifacts.require(
        engine_dir,
        stage="build",
        rerun=(
            "specdeploy quantize RECIPE && specdeploy build RECIPE "
            "(draft.train.features engine computes the target's features with it)"
        ),
    )
    return EngineFeatures.load(engine_dir, aux_ids, manifest.fingerprint)


def count_head_vocab(head_dir, data_dir) -> str:
    """`specdeploy draft vocab-counts`: write an exported head's EAGLE3_VOCAB_COUNTS from the answers of a `draft data`
    folder's training samples (the head's own data, or the target's answers to other prompts: never the validation
    prompts, which the data stage refuses). Returns a line saying what it wrote."""
    from specdeploy.engine.eagle3 import Eagle3HeadConfig

    config = Eagle3HeadConfig.read(Path(head_dir))  # ModelError when it is not an exported head
    if not (Path(head_dir) / "model.safetensors").is_file():
        raise ModelError(f"{head_dir} has no model.safetensors", "point at an exported EAGLE-3 head folder")
    data = read_draft_data(Path(data_dir), config.vocab_size)
    path, body = write_vocab_counts(Path(head_dir), data.train, str(data_dir))
    return (
        f"{path}: {body['counted']:,} of {body['answer_tokens']:,} answer tokens of {len(data.train):,} samples "
        f"in the head's {config.draft_vocab_size:,} draft tokens"
    )


def pad_id_of(target_config: dict) -> int:
    """The target's pad token where it names a valid one, else 0 (padding is masked out either way)."""
    pad_id = target_config.get("pad_token_id")
    return pad_id if isinstance(pad_id, int) and 0 <= pad_id < target_config["vocab_size"] else 0


def resume_dir(dest: Path) -> Path:
    """Where an unfinished run keeps its checkpoint (beside the output; removed when the head is exported)."""
    return dest.parent / f"{dest.name}.partial"


def feature_cache_dir(dest: Path) -> Path:
    """Where draft.train.feature_cache keeps the training samples' features (beside the output; kept after the export,
    for the next run on the same samples and engine; its key says what it holds)."""
    return dest.parent / f"{dest.name}.features"


def cached_step_features(step_features, data, t: Eagle3TrainConfig, dest: Path, echo=print):
    """draft.train.feature_cache: the training steps' features through the cache beside `dest`, after checking that
    its files fit on the disk."""
    from specdeploy.core.artifacts import free_bytes, tree_bytes
    from specdeploy.core.errors import DiskFullError
    from specdeploy.eagle3.feature_cache import CachedFeatures, cache_bytes

    folder = feature_cache_dir(dest)
    full = step_features.full
    itemsize = full.engine.dtype.itemsize
    needed = cache_bytes(data.train, t.seq_len, len(full.aux_ids) * full.hidden, t.label_top_k, itemsize)
    free = free_bytes(dest.parent) + (tree_bytes(folder) if folder.exists() else 0)
    if needed > free:
        raise DiskFullError(
            f"draft.train.feature_cache needs {needed / 2**30:.1f} GiB in {folder}, {free / 2**30:.1f} GiB are free",
            "free some space, or set draft.train.feature_cache: false (every epoch then runs the engine)",
        )
    cached = CachedFeatures(step_features, folder, data.train, t.seq_len, {})
    echo(f"  features kept in {folder} ({needed / 2**30:.1f} GiB when all were used: draft.train.feature_cache)")
    return cached


def train_recipe(
    recipe: Recipe, layout, force: bool = False, echo=print, progress: bool = True, time_limit_s: float | None = None
) -> TrainResult | None:
    """Train and export the recipe's EAGLE-3 head into layout.eagle3_head; None when it is up to date.
    `time_limit_s`: the training ends within it, with fewer steps where the plan does not fit (train_head)."""
    import shutil

    from specdeploy.core import model_store as models
    from specdeploy.core.artifacts import (
        Manifest,
        atomic_output,
        dir_hash,
        free_bytes,
        head_hash,
        is_up_to_date,
        tool_versions,
        tree_bytes,
    )

    if not recipe.draft.is_eagle3:
        raise ConfigError(
            f"draft.kind is {recipe.draft.kind}, not eagle3: there is no head to train",
            "set draft.kind: eagle3 (with draft.head: trained) to train one",
        )
    t = recipe.draft.train
    target_dir = models.resolve(recipe.target.model)
    target_config = json.loads((target_dir / "config.json").read_text())
    vocab = target_config["vocab_size"]
    data = heldout_subset(read_draft_data(layout.train_data(recipe.draft.train.data_dir), vocab), t)
    target_hash = dir_hash(target_dir)
    aux_ids = aux_layer_ids(target_config, t)
    init = init_head_folder(recipe, layout, aux_ids)
    features = engine_features(recipe, layout, aux_ids) if t.features == "engine" else None
    inputs = {}
    if init is not None:
        inputs["init_head"] = head_hash(init)
    if features is not None:
        inputs["features_engine"] = features.identity
    fp = stage_fingerprint(recipe, target_hash, data.fingerprint, time_limit_s, inputs)
    dest = layout.eagle3_head
    if not force and is_up_to_date(dest, fp):
        echo(f"eagle3 head: up to date ({dest})")
        return None
    draft_ids = choose_draft_vocab(data.train, vocab, t.draft_vocab_size)
    draft_vocab_size = len(draft_ids) if draft_ids is not None else vocab
    device = device_name()
    precision = train_precision(t, device)
    plan = plan_training(
        target_config,
        data,
        t,
        device,
        _available_memory(device),
        draft_vocab_size,
        len(aux_ids),
        precision,
        engine_features=features is not None,
    )
    check_plan(plan, t)
    echo(f"eagle3 head for {recipe.target.model}: {plan.summary()}")
    echo(
        f"  aux layers {aux_ids}, draft vocabulary {draft_vocab_size} of {vocab}, {len(data.train)} training and "
        f"{len(data.heldout)} held-out samples from {data.folder}"
    )
    work = resume_dir(dest)
    if force and work.exists():
        shutil.rmtree(work)
    check_disk(
        plan, t, dest.parent, free_bytes(dest.parent) + tree_bytes(work)
    )  # the work folder's checkpoint is replaced
    model = build_model(target_dir, t, draft_ids, aux_ids, device, offline=features is not None)
    use_loss(model, t.loss)
    if t.loss != "kl":
        echo(f'  loss: {t.loss} (draft.train.loss; docs/eagle3-train.md "The loss")')
    if init is not None:
        load_exported_head(model, init)  # its weights and its d2t
        echo(f"  starting from the head in {init}")
    if features is not None:
        echo(
            f"  the target's features and distribution from the CPU engine {layout.engine('target')} (ModelOpt's"
            " offline mode)"
        )
    step_features = features
    if features is not None and t.label_top_k:
        # the head's d2t (a fresh vocabulary's or init_head's): the draft ids whose labels are kept
        head_ids = draft_target_ids(model).tolist()
        step_features = features.top_k(t.label_top_k, head_ids)
        accept_draft_space_logits(model)
        echo(f"  labels: the target's top {t.label_top_k} draft tokens (draft.train.label_top_k)")
        if t.feature_cache:
            step_features = cached_step_features(step_features, data, t, dest, echo)
    pad_id = pad_id_of(target_config)
    echo(f"  forward passes in {precision} (draft.train.precision {t.precision})")
    result = train_head(
        model,
        data,
        t,
        work,
        fingerprint=fp,
        progress=progress,
        echo=echo,
        device=device,
        pad_id=pad_id,
        precision=precision,
        time_limit_s=time_limit_s,
        features=features,
        step_features=step_features,
    )
    head_params = sum(p.numel() for p in model.eagle_module.parameters())
    with atomic_output(dest) as tmp:
        export_head(model, tmp, aux_ids, t.export_dtype)
        write_vocab_counts(tmp, data.train, str(data.folder))  # draft.serve_vocab_size ranks by them
        (tmp / TRAIN_LOG).write_text("".join(json.dumps(entry) + "\n" for entry in result.log))
        Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "train": to_plain(t),
                "aux_layers": aux_ids,
                "draft_vocab_size": draft_vocab_size,
                "device": device,
                "precision": precision,
                "seed": t.seed,
                "time_limit_s": time_limit_s,
            },
            inputs={
                "target_dir": str(target_dir),
                "target_hash": target_hash,
                "data_dir": str(data.folder),
                "data_fingerprint": data.fingerprint,
                **({"init_head": str(init), "init_head_hash": inputs["init_head"]} if init else {}),
                **(
                    {"features_engine": str(layout.engine("target")), "features_engine_fingerprint": features.identity}
                    if features
                    else {}
                ),
            },
            tool_versions=tool_versions(*TOOL_DISTRIBUTIONS),
            extra={
                "heldout_acceptance": asdict(result.acceptance),
                "untrained_acceptance": asdict(result.initial_acceptance),
                "mean_accepted": result.acceptance.mean_accepted,
                "head_parameters": head_params,
                "steps": result.steps,
                "planned_steps": result.planned_steps,
                "resumed_from_step": result.resumed_from_step,
                "train_seconds": round(result.seconds, 1),
                "train_tokens_per_s": round(result.tokens_per_s, 1),
                "seconds_per_step": round(result.step_seconds / max(1, result.steps - result.resumed_from_step), 2),
                "command": " ".join(sys.argv) or f"specdeploy draft train {recipe.name}",
            },
        ).write(tmp)
    shutil.rmtree(work, ignore_errors=True)
    echo(f"eagle3 head: {result.acceptance.line()}")
    echo(f"eagle3 head: wrote {dest}")
    return result
