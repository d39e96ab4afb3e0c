"""The Triton model repository: typed model configs -> checked `config.pbtxt` files -> `triton_repo/<recipe>/`.

Layout and tensor names are those of NVIDIA's `inflight_batcher_llm` (tensorrtllm_backend's
all_models/inflight_batcher_llm) so that clients written for a TensorRT-LLM deployment work unchanged:

    preprocessing ─▶ tensorrt_llm ─▶ postprocessing      = ensemble (the unaccelerated control)
    tensorrt_llm_bls: tokenize, then rounds of tensorrt_llm_draft (k tokens) + tensorrt_llm
                      (draft_input_ids, k + 1 tokens), then detokenize

preprocessing, postprocessing, ensemble and tensorrt_llm_bls are the same on every backend; the
two engine models (`tensorrt_llm`, `tensorrt_llm_draft`) are handed in by the recipe's backend
(`specdeploy.deploy.backend_stages`: `cpu_engine_models` here, the GPU ones in gpu_models.py, which imports this
module). Every config is rendered from typed objects and parsed with Triton's own `ModelConfig` protobuf before anything
is written. The parts, one module each: `triton.model_config` (ModelSpec, render, check_config), `triton.tensors` (the
layout's model names and tensors), `triton.layout_models` (the models as ModelSpecs), `triton.repo_inputs` (the
engines, tokenizer and head it is generated from). This module is the stage: fingerprint, write, require.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from specdeploy.core.artifacts import Manifest, atomic_output, fingerprint, require, tool_versions
from specdeploy.recipe.config import Recipe, to_plain

# The parts, one module each; the names other modules and the tests use stay importable from here.
from specdeploy.triton.layout_models import EAGLE3_HEAD_SUBDIR, TOKENIZER_SUBDIR, model_specs
from specdeploy.triton.model_config import _check_ensemble, check_config, render
from specdeploy.triton.repo_inputs import RepoInputs, check_eagle3_head, find_tokenizer, repo_inputs, stage_eagle3_head
from specdeploy.triton.tensors import PREPROCESSING, TARGET_MODEL

STAGE = "repo"
MODEL_SOURCES = Path(__file__).parent / "models"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


# ---------------------------------------------------------------- the stage


def _sources_hash() -> str:
    from specdeploy.core.artifacts import file_hash

    return fingerprint(**{p.name: file_hash(p) for p in sorted(MODEL_SOURCES.glob("*.py"))})


def _eagle3_served(r: Recipe) -> dict:
    """The draft keys of an eagle3 recipe that the repository carries (model parameters, model.yaml): how the head's
    linears are held, the draft tokens it scores, the suffix lookup. Its data and train keys reach it only through the
    head's files (eagle3_head_hash)."""
    return {
        "head_weights": r.draft.head_weights,
        "serve_vocab_size": r.draft.serve_vocab_size,
        "sa_config": to_plain(r.draft.sa_config) if r.draft.sa_config is not None else None,
    }


def repo_fingerprint(inp: RepoInputs) -> str:
    r = inp.recipe
    return fingerprint(
        engines={role: m.fingerprint for role, m in inp.engine_manifests.items()},
        engine_dirs={role: str(d) for role, d in inp.engine_dirs.items()},
        backend=r.backend,
        speculative=to_plain(r.speculative),
        draft=to_plain(r.draft) if r.draft.is_ngram or r.draft.is_suffix else None,
        **({"eagle3_head": inp.eagle3_head_hash, "eagle3_served": _eagle3_served(r)} if r.draft.is_eagle3 else {}),
        engine=to_plain(r.engine),
        triton={
            k: getattr(r.triton, k)
            for k in (
                "instance_count",
                "decoupled",
                "max_queue_delay_microseconds",
                "request_timeout_s",
                "inflight_batching",
            )
        }
        | {"bls_instance_count": r.bls_instance_count},
        layout=r.layout,
        **({"control": r.control} if r.layout == "llmapi" else {}),
        executor_factory=inp.executor_factory,
        sources=_sources_hash(),
        **({"canary_control_percent": r.canary.control_percent} if r.canary.control_percent else {}),
    )


def generate_layout_repository(
    recipe: Recipe,
    layout,
    engine_models,
    recipe_path: str = "RECIPE",
    force: bool = False,
    executor_factory: str | None = None,
    finish_models=None,
) -> tuple[Path, bool]:
    """The inflight_batcher_llm layout (cpu, trtllm-engine): `layout.repo`, or (path, False) when up to date.
    `engine_models(inp)` gives the backend's `tensorrt_llm` and `tensorrt_llm_draft`, `finish_models` its renames
    (model_specs).

    Refuses missing or mismatched engines (hint: `specdeploy build`). Each config.pbtxt is checked
    with Triton's ModelConfig schema before anything is written; the write is atomic.
    """
    inp = repo_inputs(recipe, layout, recipe_path, executor_factory)
    fp = repo_fingerprint(inp)
    dest = Path(layout.repo)
    current = Manifest.read(dest)
    if not force and current is not None and current.stage == STAGE and current.fingerprint == fp:
        return dest, False

    if inp.eagle3_head_dir is not None:
        check_eagle3_head(inp)
    specs = model_specs(inp, engine_models, finish_models)
    by_name = {s.name: s for s in specs}
    texts = {}
    for spec in specs:
        text = render(spec)
        check_config(text, spec.name)
        if spec.steps:
            _check_ensemble(spec, by_name)
        texts[spec.name] = text
    tokenizer_src = find_tokenizer(inp.engine_dirs["target"], inp.engine_manifests["target"], recipe.target.model)

    with atomic_output(dest) as tmp:
        for spec in specs:
            model_dir = tmp / spec.name
            (model_dir / "1").mkdir(parents=True)
            (model_dir / "config.pbtxt").write_text(texts[spec.name])
            if spec.source:
                shutil.copyfile(MODEL_SOURCES / spec.source, model_dir / "1" / "model.py")
        if inp.eagle3_head_dir is not None:
            stage_eagle3_head(inp, tmp / TARGET_MODEL / EAGLE3_HEAD_SUBDIR)
        tok_dir = tmp / PREPROCESSING / TOKENIZER_SUBDIR
        tok_dir.mkdir()
        for name in TOKENIZER_FILES:
            if (tokenizer_src / name).is_file():
                shutil.copyfile(tokenizer_src / name, tok_dir / name)
        Manifest(
            stage=STAGE,
            recipe_name=recipe.name,
            fingerprint=fp,
            settings={
                "backend": recipe.backend,
                "models": [s.name for s in specs],
                "decoupled": recipe.triton.decoupled,
                "instance_count": recipe.triton.instance_count,
                "num_draft_tokens": recipe.speculative.num_draft_tokens,
                "max_draft_len": inp.target_max_draft_len,
                "max_input_len": inp.max_input_len,
                "max_seq_len": inp.max_seq_len,
            },
            inputs={f"{role}_engine": m.fingerprint for role, m in inp.engine_manifests.items()}
            | ({"eagle3_head": inp.eagle3_head_hash} if inp.eagle3_head_dir is not None else {}),
            tool_versions=tool_versions("tritonclient", "transformers"),
            extra={
                "engine_dirs": {r: str(d) for r, d in inp.engine_dirs.items()},
                "tokenizer_source": str(tokenizer_src),
            }
            | ({"eagle3_head_source": str(inp.eagle3_head_dir)} if inp.eagle3_head_dir is not None else {}),
        ).write(tmp)
    return dest, True


def require_repository(recipe: Recipe, layout, recipe_path: str = "RECIPE") -> Manifest:
    """The repository's manifest if it matches the engines and recipe now; StaleArtifactError otherwise."""
    from specdeploy.core.errors import StaleArtifactError

    manifest = require(layout.repo, STAGE, f"specdeploy repo {recipe_path}")
    try:
        inp = repo_inputs(recipe, layout, recipe_path, _recorded_factory(layout.repo))
    except StaleArtifactError as exc:
        raise StaleArtifactError(f"the repository's engines are not usable: {exc.message}", exc.hint) from exc
    if manifest.fingerprint != repo_fingerprint(inp):
        raise StaleArtifactError(
            f"{layout.repo} is stale: the engines, the recipe or specdeploy changed since it was generated",
            f"run: specdeploy repo {recipe_path}",
        )
    return manifest


def _recorded_factory(repo: Path) -> str | None:
    config = Path(repo) / TARGET_MODEL / "config.pbtxt"
    if not config.is_file():
        return None
    parsed = check_config(config.read_text())
    param = parsed.parameters.get("executor_factory")
    return param.string_value if param is not None and param.string_value else None
