"""`specdeploy generate`: the recipe's built CPU engines in-process, streamed text then statistics."""

from __future__ import annotations

import click

from specdeploy.cli.common import RECIPE, handle_errors, pass_ctx


@click.command("generate")
@RECIPE
@click.option("--prompt", required=True, help="The user turn (with --raw: the text to continue, as is).")
@click.option("--no-spec", is_flag=True, help="Run the target alone (the unaccelerated control).")
@click.option(
    "--num-draft-tokens", type=int, default=None, help="Draft tokens per round [recipe speculative.num_draft_tokens]."
)
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate [recipe validation.max_tokens].")
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="Sampling temperature; ignored unless --top-k or --top-p is set (TensorRT-LLM semantics).",
)
@click.option("--top-k", type=int, default=None, help="Top-k sampling (0: not set).")
@click.option("--top-p", type=float, default=None, help="Top-p sampling (0: not set).")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option(
    "--use-draft-logits/--no-draft-logits",
    default=None,
    help="Accept by rejection sampling on draft logits [recipe speculative.use_draft_logits].",
)
@click.option(
    "--chat/--raw",
    default=True,
    help=(
        "Wrap the prompt in the tokenizer's chat template (default), or send it as is like the Triton preprocessing"
        " model."
    ),
)
@pass_ctx
@handle_errors
def generate(
    ctx, recipe, prompt, no_spec, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed, use_draft_logits, chat
):
    """Generate from RECIPE's built CPU engines in-process: stream the text, then print statistics."""
    from specdeploy.core import backends
    from specdeploy.core.errors import ConfigError
    from specdeploy.engine import generate as gen
    from specdeploy.speculation.sampling import SamplingParams

    r = ctx.recipe(recipe)
    backends.of(r).require_local("'specdeploy generate'", r)
    k = r.speculative.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    if not no_spec and not 1 <= k <= r.speculative.max_draft_len:
        raise ConfigError(
            f"--num-draft-tokens {k} is outside 1..{r.speculative.max_draft_len} (speculative.max_draft_len)",
            "pick a smaller k, or rebuild with a larger max_draft_len",
        )
    default = SamplingParams()
    sampling = SamplingParams(
        temperature=default.temperature if temperature is None else temperature,
        top_k=default.top_k if top_k is None else top_k,
        top_p=default.top_p if top_p is None else top_p,
        seed=seed,
    )
    session = gen.Session.from_recipe(r, ctx.layout(r), speculative=not no_spec, recipe_path=recipe)
    result = gen.generate(
        session,
        prompt,
        max_tokens or r.validation.max_tokens,
        0 if no_spec else k,
        sampling,
        r.speculative.use_draft_logits if use_draft_logits is None else use_draft_logits,
        on_text=lambda piece: click.echo(piece, nl=False),
        chat=chat,
    )
    click.echo("\n")
    mode = (
        "target only"
        if no_spec
        else f"speculative, {r.draft.kind} draft, k<={k}, policy {session.deployment.describe()}"
    )
    click.secho(f"-- {mode}", bold=True, err=True)
    for line in gen.stats_lines(result, speculative=not no_spec):
        click.echo(line, err=True)
