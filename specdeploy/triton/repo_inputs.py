"""What the repository is generated from (`RepoInputs`): the recipe, the built engines and their manifests, the
tokenizer and, for draft.kind eagle3, the head; each refused with a hint that names the command to re-run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdeploy.core.artifacts import Manifest, require
from specdeploy.core.errors import RepoError
from specdeploy.eagle3.head import eagle3_head_files, require_head
from specdeploy.recipe.config import Recipe

CPU_EXECUTOR_FACTORY = "specdeploy.triton.models.common:load_cpu_executor"


@dataclass(frozen=True)
class RepoInputs:
    """What the per-backend builders need: the recipe, the engines and their manifests."""

    recipe: Recipe
    engine_dirs: dict[str, Path]  # role -> absolute engine dir
    engine_manifests: dict[str, Manifest]
    executor_factory: str  # "module:callable" that loads an Executor from an engine dir
    eagle3_head_dir: Path | None = None  # draft.kind eagle3: the head folder draft.head names (absolute)
    eagle3_head_hash: str = ""  # the hash of its files (eagle3.head.eagle3_head_files)

    def engine_setting(self, role: str, key: str, default):
        """A build setting from the engine's manifest (top level or its `engine` section), else `default`."""
        settings = self.engine_manifests[role].settings
        value = settings.get(key)
        if value is None and isinstance(settings.get("engine"), dict):
            value = settings["engine"].get(key)
        return default if value is None else value

    @property
    def target_max_draft_len(self) -> int:
        return int(self.engine_setting("target", "max_draft_len", self.recipe.speculative.max_draft_len))

    @property
    def max_input_len(self) -> int:
        return int(self.engine_setting("target", "max_input_len", self.recipe.engine.max_input_len))

    @property
    def max_seq_len(self) -> int:
        return int(self.engine_setting("target", "max_seq_len", self.recipe.engine.max_seq_len))


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()


def find_tokenizer(engine_dir: Path, manifest: Manifest, model: str | None = None) -> Path:
    """The tokenizer saved with the engine or its checkpoint, else the source model's (the recipe's
    `model`, resolved like the quantize stage does: a bundled name or a local HF folder)."""
    candidates = [Path(engine_dir), Path(engine_dir) / "tokenizer"]
    for section in (manifest.settings, manifest.extra, manifest.inputs):
        for key in ("tokenizer_dir", "checkpoint", "source_dir", "model_dir", "hf_dir", "source_model_dir"):
            value = section.get(key) if isinstance(section, dict) else None
            if isinstance(value, str):
                candidates.append(Path(value))
    for path in candidates:
        if _has_tokenizer(path):
            return path
    model = manifest.extra.get("model") if isinstance(manifest.extra.get("model"), str) else model
    if model:
        from specdeploy.core import model_store as models

        source = Path(models.resolve(model))
        if _has_tokenizer(source):
            return source
        candidates.append(source)
    raise RepoError(
        f"no tokenizer found for engine {engine_dir} (looked in {', '.join(map(str, candidates))})",
        "rebuild the engine so that it saves the tokenizer beside it: specdeploy build RECIPE --force",
    )


def repo_inputs(recipe: Recipe, layout, recipe_path: str = "RECIPE", executor_factory: str | None = None) -> RepoInputs:
    """Read the engines' manifests (StaleArtifactError with a `specdeploy build` hint when missing)."""
    dirs, manifests = {}, {}
    for role in recipe.model_roles:  # an n-gram draft has no engine
        engine_dir = Path(layout.engine(role)).resolve()
        manifests[role] = require(engine_dir, "build", f"specdeploy build {recipe_path}")
        if manifests[role].recipe_name != recipe.name:
            from specdeploy.core.errors import StaleArtifactError

            raise StaleArtifactError(
                f"{engine_dir} was built for recipe {manifests[role].recipe_name!r}, not {recipe.name!r}",
                f"run: specdeploy build {recipe_path}",
            )
        expected = _expected_engine_fingerprint(recipe, layout, role)
        if expected is not None and manifests[role].fingerprint != expected:
            from specdeploy.core.errors import StaleArtifactError

            raise StaleArtifactError(
                f"the {role} engine {engine_dir} is stale: its checkpoint or the recipe's engine settings changed",
                f"run: specdeploy build {recipe_path}",
            )
        dirs[role] = engine_dir
    head_dir, head_hash = require_head(recipe, layout, recipe_path) if recipe.draft.is_eagle3 else (None, "")
    inp = RepoInputs(recipe, dirs, manifests, executor_factory or CPU_EXECUTOR_FACTORY, head_dir, head_hash)
    if recipe.speculative.num_draft_tokens > inp.target_max_draft_len:
        raise RepoError(
            f"speculative.num_draft_tokens ({recipe.speculative.num_draft_tokens}) is larger than the target "
            f"engine's max_draft_len ({inp.target_max_draft_len})",
            f"rebuild the target with a larger max_draft_len: specdeploy build {recipe_path} --force",
        )
    return inp


def stage_eagle3_head(inp: RepoInputs, dest: Path) -> None:
    """Copy the head's files (eagle3_head_files) into `dest` (a model folder's head subfolder), made here."""
    import shutil

    dest.mkdir()
    for name in eagle3_head_files(inp.recipe):
        shutil.copyfile(inp.eagle3_head_dir / name, dest / name)


def check_eagle3_head(inp: RepoInputs) -> None:
    """Load the head against the target engine (engine.eagle3.Eagle3Head.load's checks: hidden size, vocabulary,
    aux layers, shapes), so a head that does not fit is refused by `specdeploy repo`, not by tritonserver."""
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.engine.model import CpuEngine

    Eagle3Head.load(
        inp.eagle3_head_dir,
        CpuEngine.load(str(inp.engine_dirs["target"])),
        serve_vocab_size=inp.recipe.draft.serve_vocab_size,
    )


def _expected_engine_fingerprint(recipe: Recipe, layout, role: str) -> str | None:
    """What the CPU build (deploy/cpu_build.py) would record for the engine of `role` now. None on the GPU backends:
    trtllm.build_engine_recipe checks its own fingerprints, and the LLM API has no engine to check."""
    from specdeploy.core import backends

    if backends.of(recipe).gpu:
        return None
    from specdeploy.deploy.cpu_build import engine_fingerprint

    checkpoint = Manifest.read(layout.checkpoint(role))
    if checkpoint is None:
        return None
    max_draft_len = recipe.speculative.max_draft_len if role == "target" else None
    return engine_fingerprint(recipe, role, checkpoint, max_draft_len)
