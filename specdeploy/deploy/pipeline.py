"""`specdeploy run`: quantize -> build -> repo -> serve -> validate -> stop, on any backend.

Each stage is its own module's function (an unchanged artifact is not redone); the serve step asks the
recipe's backend to start its server (`BackendStages.start`: the embedded CPU tritonserver, or the GPU launch
plan with its pre-flight checks), and that server is always stopped, also on failure or Ctrl-C.
"""

from __future__ import annotations


def run(
    recipe,
    layout,
    recipe_path: str,
    echo=print,
    progress=True,
    server_binary: str | None = None,
    report_dir=None,
    also: tuple[tuple[str, int], ...] = (),
    **overrides,
):
    """Every stage in order; returns validate_recipe's (report, paths, verdict) for each prompt set validated: the
    recipe's, then each (prompt set, max prompts) of `also` on the same server, its report in a folder named after
    the set beside the first's. `overrides` replace validate's Options fields."""
    from pathlib import Path

    from specdeploy.deploy import backend_stages
    from specdeploy.deploy.recipe_deployment import validate_recipe
    from specdeploy.quantize.stage import quantize_recipe

    stages = backend_stages.of(recipe)
    if not stages.backend.gpu:  # the GPU backends' build runs every pre-flight check; the cpu one, this one up front
        from specdeploy.deploy import preflight

        preflight.enforce(preflight.check_served_vocabulary(recipe, layout), echo)
    _check_before_work(recipe, layout, recipe_path, overrides)
    for prompt_set, max_prompts in also:
        _check_before_work(
            recipe, layout, recipe_path, {**overrides, "prompt_set": prompt_set, "max_prompts": max_prompts}
        )
    echo(f"== quantize ({stages.backend.name})")
    quantize_recipe(recipe, layout, echo=echo, progress=progress is True)
    echo("== build")
    stages.build(recipe, layout, echo=echo)
    echo("== repo")
    path, written = stages.write_repository(recipe, layout, recipe_path=recipe_path)
    echo(f"{'wrote' if written else 'up to date:'} {path}")
    echo("== serve")
    running = stages.start(recipe, layout, server_binary=server_binary, echo=echo)
    try:
        echo(f"ready: {running.description}")
        echo("== validate")
        served = dict(url=running.grpc_url, progress=progress, metrics_url=running.metrics_url)
        results = [validate_recipe(recipe, layout, report_dir=report_dir, **served, **overrides)]
        for prompt_set, max_prompts in also:
            echo(f"== validate ({prompt_set}, {max_prompts} prompts)")
            folder = Path(report_dir or layout.report) / prompt_set.replace(":", "-")
            options = {**overrides, "prompt_set": prompt_set, "max_prompts": max_prompts}
            results.append(validate_recipe(recipe, layout, report_dir=folder, **served, **options))
        return results
    finally:
        echo("== stop")
        running.stop()
        echo("stopped tritonserver")


def _check_before_work(recipe, layout, recipe_path: str, overrides: dict) -> None:
    """What the last stages would refuse, asked before the first of the module that owns it: validate's options and
    prompt set (each prompt within engine.max_input_len, counted with the target's tokenizer where it loads; a target
    that does not load is the quantize stage's error, with its own hint), the EAGLE-3 head (eagle3.head, whose files
    the repository copies), and a detached server of the recipe (the pipeline's own would write over its log, and two
    servers on one machine skew the speedup measured)."""
    from specdeploy.client.hf_codec import HFCodec
    from specdeploy.client.prompts import load_prompt_set
    from specdeploy.client.validate import prepare_prompts
    from specdeploy.core.errors import ConfigError
    from specdeploy.deploy.recipe_deployment import recipe_options, tokenizer_dir
    from specdeploy.triton import server_state

    options = recipe_options(recipe, **overrides)
    try:
        codec = HFCodec(tokenizer_dir(recipe, layout))
    except ConfigError:
        codec = None
    if codec is None:
        load_prompt_set(options.prompt_set, options.max_tokens, options.max_prompts)
    else:
        prepare_prompts(options, codec)
    if recipe.draft.is_eagle3:
        from specdeploy.eagle3.head import require_head

        require_head(recipe, layout, recipe_path)
    detached = server_state.ServerState.read(layout.server_state)
    if detached is not None and detached.running():
        raise ConfigError(
            f"a server of this recipe runs detached (pid {detached.pid}, grpc {detached.grpc_url}); `run` starts"
            " its own",
            f"stop it first (specdeploy stop {recipe_path}), or validate it as it is (specdeploy validate"
            f" {recipe_path})",
        )
