"""`specdeploy build` for backend cpu: compile both checkpoints of a recipe into engines, with manifests."""

from __future__ import annotations

from specdeploy.core import artifacts
from specdeploy.core.errors import BuildError, StaleArtifactError
from specdeploy.deploy.cpu_compile import compile_checkpoint, read_checkpoint_config
from specdeploy.engine.spec import FORMAT_VERSION
from specdeploy.recipe.config import Recipe, checkpoint_quantization, checkpoint_settings

STAGE = "build"
QUANTIZE_RERUN = "specdeploy quantize RECIPE"
# Engine settings that change a CPU engine (the GPU memory fraction does not).
ENGINE_KEYS = ("dtype", "max_batch_size", "max_input_len", "max_seq_len")


def build_recipe(recipe: Recipe, layout, force: bool = False, echo=print) -> dict:
    """Compile `layout.checkpoint(role)` into `layout.engine(role)` for the target and the draft.

    The target is built with `speculative.max_draft_len`. Both checkpoints are checked before anything is
    written; an engine whose inputs and settings are unchanged is not rebuilt. Returns {role: EngineSpec or
    None when up to date}.
    """
    plans = []
    for role in recipe.model_roles:  # an n-gram draft has no engine
        ckpt = layout.checkpoint(role)
        manifest = artifacts.require(ckpt, stage="quantize", rerun=QUANTIZE_RERUN)
        _check_checkpoint_matches(recipe, role, manifest, ckpt)
        max_draft_len = recipe.speculative.max_draft_len if role == "target" else None
        plans.append((role, ckpt, manifest, max_draft_len, engine_fingerprint(recipe, role, manifest, max_draft_len)))
    vocab = {role: read_checkpoint_config(ckpt).get("vocab_size") for role, ckpt, *_ in plans}
    if len(set(vocab.values())) != 1:
        raise BuildError(
            f"draft and target vocabularies differ ({vocab}); draft tokens would mean different text",
            "pick a draft model that shares the target's tokenizer",
        )

    built = {}
    for role, ckpt, manifest, max_draft_len, fp in plans:
        dest = layout.engine(role)
        if not force and artifacts.is_up_to_date(dest, fp):
            echo(f"{role}: up to date ({dest})")
            built[role] = None
            continue
        echo(f"{role}: compiling {ckpt} for cpu" + (f" (max_draft_len {max_draft_len})" if max_draft_len else ""))
        with artifacts.atomic_output(dest) as tmp:
            spec = compile_checkpoint(ckpt, tmp, recipe.engine, max_draft_len, _per_token(recipe, role))
            artifacts.Manifest(
                stage=STAGE,
                recipe_name=recipe.name,
                fingerprint=fp,
                settings={
                    "backend": "cpu",
                    "role": role,
                    "engine": {k: getattr(recipe.engine, k) for k in ENGINE_KEYS},
                    "max_draft_len": spec.max_draft_len,
                    "row_bucket": spec.row_bucket,
                    "batch_invariant": spec.batch_invariant,
                },
                inputs={"checkpoint": str(ckpt), "checkpoint_fingerprint": manifest.fingerprint},
                tool_versions=artifacts.tool_versions("torch", "safetensors"),
                extra={
                    "quant_algo": spec.quant_algo,
                    "kv_cache_quant_algo": spec.kv_cache_quant_algo,
                    "model": recipe.model(role).model,
                },
            ).write(tmp)
        echo(f"{role}: wrote {dest} ({spec.quant_algo or 'full precision'}, {spec.dtype})")
        built[role] = spec
    if recipe.engine.dtype == "bfloat16":  # compile the native kernels now, not in the first server process
        from specdeploy.engine import native

        echo("native CPU kernels: " + ("ready" if native.ops() is not None else "unavailable, engines use torch ops"))
    return built


def engine_fingerprint(recipe: Recipe, role: str, checkpoint_manifest, max_draft_len: int | None) -> str:
    return artifacts.fingerprint(
        stage=STAGE,
        backend="cpu",
        role=role,
        checkpoint=checkpoint_manifest.fingerprint,
        engine={k: getattr(recipe.engine, k) for k in ENGINE_KEYS},
        max_draft_len=max_draft_len,
        format_version=FORMAT_VERSION,
        **({"per_token": True} if _per_token(recipe, role) else {}),  # absent when off: earlier engines stay up to date
    )


def _per_token(recipe: Recipe, role: str) -> bool:
    return recipe.model(role).quantization.per_token


def _check_checkpoint_matches(recipe: Recipe, role: str, manifest, ckpt) -> None:
    """The checkpoint must come from the model and quantization the recipe asks for now."""
    wanted = checkpoint_settings(recipe.model(role))
    have = {k: manifest.settings.get(k) for k in wanted}
    if isinstance(have.get("quantization"), dict):  # older manifests also recorded the build-only keys
        have["quantization"] = checkpoint_quantization(have["quantization"])
    if manifest.settings.get("role", role) != role or have != wanted:
        raise StaleArtifactError(
            f"{ckpt} was quantized with other settings than the recipe's {role} asks for now",
            f"run: {QUANTIZE_RERUN}",
        )
