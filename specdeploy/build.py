"""`specdeploy build`: one builder per backend, chosen by `recipe.backend`."""

from __future__ import annotations

from specdeploy.errors import ConfigError


def _cpu(recipe, layout, force=False, echo=print):
    from specdeploy.engine import build_recipe

    return build_recipe(recipe, layout, force=force, echo=echo)


def _trtllm_engine(recipe, layout, force=False, echo=print, dry_run=False):
    from specdeploy.trtllm import build_engine_recipe

    return build_engine_recipe(recipe, layout, force=force, dry_run=dry_run, echo=echo)


def _trtllm_llmapi(recipe, layout, force=False, echo=print, dry_run=False):
    from specdeploy.trtllm import build_llmapi_recipe

    return build_llmapi_recipe(recipe, layout, force=force, dry_run=dry_run, echo=echo)


# backend -> builder(recipe, layout, force, echo). GPU backends are added here.
BUILDERS = {"cpu": _cpu, "trtllm-engine": _trtllm_engine, "trtllm-llmapi": _trtllm_llmapi}
# builders that also take dry_run=True (print the commands, write nothing)
DRY_RUN_BACKENDS = ("trtllm-engine", "trtllm-llmapi")


def build(recipe, layout, force: bool = False, echo=print, dry_run: bool = False):
    """Build the engines of `recipe` with the builder of its backend."""
    builder = BUILDERS.get(recipe.backend)
    if builder is None:
        raise ConfigError(
            f"backend {recipe.backend!r} has no builder yet",
            f"backends that build: {', '.join(sorted(BUILDERS))}",
        )
    if dry_run:
        if recipe.backend not in DRY_RUN_BACKENDS:
            raise ConfigError(
                f"--dry-run prints the external build commands of {', '.join(DRY_RUN_BACKENDS)}; "
                f"backend {recipe.backend!r} builds in-process",
                "run specdeploy check RECIPE to see its plan",
            )
        return builder(recipe, layout, force=force, echo=echo, dry_run=True)
    return builder(recipe, layout, force=force, echo=echo)
