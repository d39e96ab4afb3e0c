"""The stage commands that write a recipe's artifacts: `quantize`, `draft data` / `draft train` (the EAGLE-3 head),
`build`, `repo`."""

from __future__ import annotations

import contextlib
from pathlib import Path

import click

from specdeploy.cli.common import RECIPE, handle_errors, pass_ctx

# ---- quantize (specdeploy.quantize.stage)


@click.command("quantize")
@RECIPE
@click.option("--force", is_flag=True, help="Quantize again even when the checkpoints are up to date.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@pass_ctx
@handle_errors
def quantize(ctx, recipe, force, no_progress):
    """Quantize the draft and target into TensorRT-LLM checkpoints with ModelOpt and print their quality."""
    from specdeploy.quantize import stage as quant

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        quant.quantize_recipe(r, ctx.layout(r), force=force, echo=click.echo, progress=not no_progress)


# ---- draft: the EAGLE-3 head (draft.kind eagle3)


@click.group("draft")
def draft_group():
    """The EAGLE-3 head of a draft.kind eagle3 recipe: its training data, then its training."""


@draft_group.command("train")
@RECIPE
@click.option(
    "--force",
    is_flag=True,
    help="Train again even when the head is up to date (discards an unfinished run's checkpoint).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--time-limit",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="MINUTES",
    help="End within this many minutes: the planned steps are cut to what fits (a lent GPU's time).",
)
@pass_ctx
@handle_errors
def draft_train(ctx, recipe, force, no_progress, time_limit):
    """Train the recipe's EAGLE-3 head with ModelOpt on `draft data`'s set; export it (EAGLE-3 checkpoint layout).

    An interrupted run continues from its last checkpoint (engines/<recipe>/eagle3-head.partial) when rerun."""
    from specdeploy.eagle3 import train

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        train.train_recipe(
            r,
            ctx.layout(r),
            force=force,
            echo=click.echo,
            progress=not no_progress,
            time_limit_s=None if time_limit is None else 60.0 * time_limit,
        )


@draft_group.command("vocab-counts")
@click.argument("head_dir", type=click.Path(file_okay=False, path_type=str))
@click.option(
    "--data",
    "data_dir",
    required=True,
    type=click.Path(file_okay=False, path_type=str),
    help="A `draft data` folder (its train.jsonl; the held-out prompts are not counted).",
)
@handle_errors
def draft_vocab_counts(head_dir, data_dir):
    """Count how often the target wrote each of an exported head's draft tokens in DATA's answers, into the head's
    draft_vocab_counts.json: draft.serve_vocab_size keeps the most counted (`draft train` writes it for its own)."""
    from specdeploy.eagle3 import train

    click.echo(train.count_head_vocab(head_dir, data_dir))


# ---- draft data


@draft_group.command("data")
@RECIPE
@click.option("--force", is_flag=True, help="Start over: discard an interrupted run's work and an up-to-date output.")
@pass_ctx
@handle_errors
def draft_data(ctx, recipe, force):
    """Have the target write the head's training set (draft.data): rerun to resume after an interruption."""
    from specdeploy.eagle3 import data as dd

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        dd.make_draft_data(r, ctx.layout(r), recipe_path=recipe, force=force, echo=lambda m: click.echo(m, err=True))


# ---- build (BackendStages.build: one builder per backend)


@click.command("build")
@RECIPE
@click.option("--force", is_flag=True, help="Build again even when the engines are up to date.")
@click.option(
    "--dry-run", is_flag=True, help="GPU backends: print the pre-flight checks and build commands; write nothing."
)
@pass_ctx
@handle_errors
def build(ctx, recipe, force, dry_run):
    """Build the draft and target engines from the quantized checkpoints (target with max_draft_len)."""
    from specdeploy.deploy import backend_stages

    r = ctx.recipe(recipe)
    with contextlib.nullcontext() if dry_run else ctx.locked(r, recipe):
        backend_stages.of(r).build(r, ctx.layout(r), force=force, echo=click.echo, dry_run=dry_run)


# ---- repo / serve / stop / status (specdeploy.triton)


@click.command("repo")
@RECIPE
@click.option("--force", is_flag=True, help="Regenerate even when the repository is up to date.")
@click.option(
    "--trtllm-src",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help=(
        "trtllm-llmapi: a TensorRT-LLM checkout of the image's release to copy the llmapi model's model.py "
        "and helpers.py from (without it the container copies the image's own when it starts)."
    ),
)
@pass_ctx
@handle_errors
def repo(ctx, recipe, force, trtllm_src):
    """Generate the Triton model repository (triton_repo/<recipe>/) wiring the draft and target engines."""
    from specdeploy.deploy import backend_stages

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        path, written = backend_stages.of(r).write_repository(
            r, ctx.layout(r), recipe_path=recipe, force=force, trtllm_src=trtllm_src
        )
    click.echo(f"{'wrote' if written else 'up to date:'} {path}")
