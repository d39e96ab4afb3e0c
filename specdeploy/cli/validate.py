"""`specdeploy validate` (a recipe's deployment, or any deployment described by options) and `run` (every stage,
then the verdict)."""

from __future__ import annotations

import sys

import click

from specdeploy.cli.common import RECIPE, SERVER_BINARY, handle_errors, pass_ctx
from specdeploy.client import deployment as _dep  # choices and defaults of validate's deployment options


def _print_validation(report, paths, verdict) -> None:
    from specdeploy.client.summary import summary_lines

    for line in summary_lines(report):
        click.echo(line, err=line.startswith(("warning", "error")))
    click.echo(f"report: {paths['markdown']}")
    click.secho(verdict.line, fg="green" if verdict.passed else "red", bold=True)


FOREIGN_OPTIONS = (
    "tokenizer",
    "layout",
    "speculative_model",
    "control_model",
    "control_url",
    "control_loading",
    "num_draft_tokens",
    "max_draft_len",
    "use_draft_logits",
    "price_per_hour",
)


# the gate's thresholds, the same option on validate and run
MIN_PARITY = click.option(
    "--min-parity",
    type=float,
    default=None,
    help="Least share of prompts with greedy parity [recipe validation.min_parity].",
)
MIN_SPEEDUP = click.option(
    "--min-speedup",
    type=float,
    default=None,
    help="Least speedup at the lowest concurrency; 0 disables [recipe validation.min_speedup].",
)


@click.command("validate")
@click.argument("recipe", type=click.Path(dir_okay=False), required=False)
@click.option(
    "--url",
    default=None,
    help=(
        "The deployment: Triton gRPC host:port (with RECIPE: [the server `serve --detach` started]); without RECIPE and"
        " --protocol openai: the OpenAI API's base URL."
    ),
)
@click.option(
    "--tokenizer",
    default=None,
    help="Without RECIPE: the target's tokenizer, a directory or a Hugging Face model name (required).",
)
@click.option(
    "--layout",
    type=click.Choice(_dep.LAYOUTS),
    default=_dep.Deployment.layout,
    show_default=True,
    help="Without RECIPE: the Triton layout of the deployment.",
)
@click.option(
    "--speculative-model",
    default=None,
    help=(
        "Without RECIPE: the speculative model's name [inflight_batcher_llm: tensorrt_llm_bls; llmapi: tensorrt_llm;"
        " openai: found in /v1/models]."
    ),
)
@click.option(
    "--control-model",
    default=None,
    help=(
        "Without RECIPE: the control (target alone) model's name [inflight_batcher_llm: ensemble; llmapi:"
        " tensorrt_llm_control, or tensorrt_llm with --control-url]."
    ),
)
@click.option(
    "--control-url", default=None, help="Without RECIPE: a second server (same protocol) that serves the control."
)
@click.option(
    "--control-loading",
    type=click.Choice(_dep.CONTROL_LOADINGS),
    default=_dep.Deployment.control_loading,
    show_default=True,
    help=(
        "Without RECIPE, llmapi: load_unload swaps the two models by Triton's explicit model control (one loaded at a"
        " time)."
    ),
)
@click.option(
    "--num-draft-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Without RECIPE: draft tokens per round sent to the speculative model [validate's default].",
)
@click.option(
    "--max-draft-len",
    type=click.IntRange(min=1),
    default=None,
    help="Without RECIPE: the target's max_draft_len (bounds --sweep-draft-tokens).",
)
@click.option(
    "--use-draft-logits/--no-draft-logits",
    default=None,
    help="Without RECIPE, inflight_batcher_llm: the BLS's use_draft_logits input (accept by draft logits) [not sent].",
)
@click.option(
    "--price-per-hour",
    type=click.FloatRange(min=0),
    default=None,
    help="Without RECIPE: what the serving machine costs per hour (adds cost per response).",
)
@click.option(
    "--baseline-url",
    default=None,
    help="A second deployment (e.g. the unquantized target) to compare outputs with; informative.",
)
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to write the report [engines/<recipe>/report/; without RECIPE: ./specdeploy-report/].",
)
@MIN_PARITY
@MIN_SPEEDUP
@click.option(
    "--sweep-draft-tokens",
    default=None,
    metavar="1..K",
    help="Also measure each draft length (e.g. 1..6), fit the speedup model, recommend k.",
)
@click.option(
    "--max-prompts",
    type=int,
    default=None,
    help="Use at most N prompts, spread over the categories [recipe validation.max_prompts].",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Tokens to generate per prompt [recipe validation.max_tokens].",
)
@click.option(
    "--max-input-len",
    type=click.IntRange(min=1),
    default=None,
    help=(
        "The deployment's max_input_len: a drawn ShareGPT prompt longer is skipped (another drawn in its place), a"
        " longer prompt of another set refused before any request [recipe engine.max_input_len; without RECIPE: not"
        " checked]."
    ),
)
@click.option(
    "--min-compared-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="A control output shorter than this is too short to compare [recipe validation.min_compared_tokens].",
)
@click.option(
    "--prompt-set",
    "--prompts",
    "prompt_set",
    default=None,
    help=(
        "'builtin', 'sharegpt[:SEED]' (the ShareGPT validation half, drawn with SEED) or a .jsonl file "
        "(prompt or messages, category, max_tokens) [recipe validation.prompt_set]."
    ),
)
@click.option(
    "--chat/--raw",
    "chat",
    default=None,
    help=(
        "Render prompts with the tokenizer's chat template when it has one, or send them as raw text [recipe"
        " validation.chat_template; auto]."
    ),
)
@click.option(
    "--concurrency",
    default=None,
    metavar="1,2,4",
    help="Concurrency levels of the latency phase [recipe validation.concurrency].",
)
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=None,
    help="Repeats of every latency run [recipe validation.repeats].",
)
@click.option("--top-k", type=int, default=None, help="Also compare sampled outputs statistically with this top-k.")
@click.option("--top-p", type=float, default=None, help="Also compare sampled outputs statistically with this top-p.")
@click.option(
    "--temperature", type=float, default=1.0, show_default=True, help="Temperature of the sampling comparison."
)
@click.option(
    "--samples",
    type=int,
    default=200,
    show_default=True,
    help="Seeded samples per side and prompt in the sampling comparison.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option(
    "--stream/--no-stream",
    "stream",
    default=None,
    help=(
        "Stream every timed request (TTFT, TPOT) and check each stream's text against the non-streamed one "
        "[an OpenAI server without RECIPE: stream; else the recipe's triton.decoupled]."
    ),
)
@click.option(
    "--quick",
    is_flag=True,
    help=(
        "A small stated plan: 8 prompts for parity, 4 of them timed at concurrency 1 over 2 repeats "
        "(size options given beside it win)."
    ),
)
@click.option(
    "--time-budget",
    type=click.FloatRange(min=0.0, min_open=True),
    default=None,
    metavar="MIN",
    help=(
        "Minutes the whole run should take: after the warm-up, the timed phases are cut (repeats, then timed "
        "prompts) to what fits at the mean request time so far; parity is never cut. The report says what was cut."
    ),
)
@click.option(
    "--protocol",
    type=click.Choice(_dep.PROTOCOLS),
    default=_dep.Deployment.protocol,
    show_default=True,
    help=(
        "Send the requests over Triton gRPC or through an OpenAI-compatible API (an API key: $SPECDEPLOY_API_KEY or"
        " $OPENAI_API_KEY)."
    ),
)
@click.option(
    "--openai-url",
    default=None,
    help=(
        "The OpenAI API, http://127.0.0.1:PORT (specdeploy's front: serve --openai-port PORT), for --protocol openai;"
        " with it, --url is the Triton under it."
    ),
)
@click.option(
    "--metrics-url",
    default=None,
    help=(
        "Triton's metrics endpoint HOST:PORT, checked against validate's counts [the detached server's; none "
        "with --url]; an OpenAI server without RECIPE: its runtime's metrics (vLLM, SGLang, trtllm-serve), "
        "read for acceptance."
    ),
)
@pass_ctx
@handle_errors
def validate(
    ctx,
    recipe,
    url,
    baseline_url,
    report_dir,
    min_parity,
    min_speedup,
    sweep_draft_tokens,
    max_prompts,
    prompt_set,
    top_k,
    top_p,
    temperature,
    samples,
    no_progress,
    protocol,
    openai_url,
    metrics_url,
    max_tokens,
    max_input_len,
    min_compared_tokens,
    chat,
    concurrency,
    repeats,
    stream,
    quick,
    time_budget,
    **foreign,
):
    """Check greedy parity and measure the speedup of a deployment against its unaccelerated control.

    With RECIPE: the recipe's deployment. Without: any deployment at --url (NVIDIA's inflight_batcher_llm or llmapi
    layout on Triton, or an OpenAI-compatible server with --protocol openai), described by --tokenizer and the model
    options; what it does not expose is listed in the report as not checked.

    Exit code 0 when every threshold holds; 1 incomplete run (server fault), 3 parity, 4 speedup, 5 metrics disagree.
    """
    from specdeploy.client import options as client_options
    from specdeploy.core.errors import ConfigError
    from specdeploy.speculation.sampling import SamplingParams

    overrides = dict(
        min_parity=min_parity,
        min_speedup=min_speedup,
        max_prompts=max_prompts,
        prompt_set=prompt_set,
        max_tokens=max_tokens,
        max_input_len=max_input_len,
        min_compared_tokens=min_compared_tokens,
        chat_template=None if chat is None else ("auto" if chat else "none"),
        repeats=repeats,
        concurrency=_levels(concurrency) if concurrency else None,
        sweep_draft_tokens=client_options.parse_range(sweep_draft_tokens) if sweep_draft_tokens else None,
        sampling=SamplingParams(temperature, top_k or 0, top_p or 0.0, seed=0) if (top_k or top_p) else None,
        samples_per_prompt=samples,
        stream=stream,
        time_budget_s=time_budget * 60 if time_budget else None,
    )
    if quick:
        overrides = client_options.sized(overrides, client_options.QUICK_SIZE)
    if recipe is None:
        report, paths, verdict = _validate_foreign(
            url, protocol, openai_url, metrics_url, baseline_url, report_dir, not no_progress, overrides, foreign
        )
    else:
        from specdeploy.deploy.recipe_deployment import validate_recipe

        defaults = {"layout": _dep.Deployment.layout, "control_loading": _dep.Deployment.control_loading}
        given = [
            f"--{k.replace('_', '-')}"
            for k in FOREIGN_OPTIONS
            if foreign.get(k) is not None and foreign.get(k) != defaults.get(k)
        ]
        if given:
            raise ConfigError(
                f"{', '.join(given)} {'describes' if len(given) == 1 else 'describe'} a deployment without a recipe;"
                f" {recipe} already describes its own",
                f"drop {', '.join(given)}, or drop RECIPE to validate the deployment at --url",
            )
        r = ctx.recipe(recipe)
        with ctx.locked(r, recipe):
            report, paths, verdict = validate_recipe(
                r,
                ctx.layout(r),
                url=url,
                baseline_url=baseline_url,
                report_dir=report_dir,
                progress=not no_progress,
                protocol=protocol,
                openai_url=openai_url,
                metrics_url=metrics_url,
                **overrides,
            )
    _print_validation(report, paths, verdict)
    sys.exit(verdict.exit_code)


def _levels(text: str) -> tuple[int, ...]:
    from specdeploy.core.errors import ConfigError

    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency {text!r} is not a list of levels", "write e.g. 1,2,4")
    return levels


def _validate_foreign(url, protocol, openai_url, metrics_url, baseline_url, report_dir, progress, overrides, foreign):
    """`validate --url ... --tokenizer ...`: a deployment described by the options alone."""
    from specdeploy.client import options as client_options
    from specdeploy.client import validate as val
    from specdeploy.client.deployment import Deployment
    from specdeploy.core.errors import ConfigError

    api_url, triton_url = (openai_url or url, url if openai_url else None) if protocol == "openai" else (url, None)
    if not api_url:
        raise ConfigError(
            "no RECIPE and no --url: nothing says which deployment to validate",
            "pass RECIPE, or --url HOST:PORT (Triton gRPC; the API's base URL with --protocol openai) and --tokenizer",
        )
    if not foreign.get("tokenizer"):
        raise ConfigError(
            "--url without RECIPE needs --tokenizer: the target's tokenizer renders the prompts and counts tokens",
            "pass --tokenizer DIR (the target model's directory) or a Hugging Face model name",
        )
    deployment = Deployment(
        api_url,
        foreign["tokenizer"],
        protocol=protocol,
        layout=foreign["layout"],
        speculative_model=foreign["speculative_model"],
        control_model=foreign["control_model"],
        control_url=foreign["control_url"],
        control_loading=foreign["control_loading"],
        triton_url=triton_url,
        metrics_url=metrics_url,
        price_per_hour=foreign["price_per_hour"] or 0.0,
        use_draft_logits=foreign["use_draft_logits"],
    )
    overrides = client_options.sized(overrides, client_options.FOREIGN_SIZE)  # no recipe: the default recipe's run size
    if protocol == "openai" and overrides.get("stream") is None:
        overrides = {**overrides, "stream": True}  # every OpenAI-compatible server streams (SSE): TTFT and TPOT need it
    knobs = {k: foreign[k] for k in ("num_draft_tokens", "max_draft_len")}
    if knobs["max_draft_len"] is None and knobs["num_draft_tokens"] is not None:
        knobs["max_draft_len"] = max(knobs["num_draft_tokens"], client_options.Options.max_draft_len)
    options = client_options.Options.build(
        exact_verification=False, **knobs, **overrides
    )  # another deployment's verification: triaged, not assumed exact
    return val.validate_deployment(deployment, options, report_dir or "specdeploy-report", progress, baseline_url)


@click.command("run")
@RECIPE
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to write the report [engines/<recipe>/report/].",
)
@MIN_PARITY
@MIN_SPEEDUP
@click.option(
    "--sweep-draft-tokens", default=None, metavar="1..K", help="Also measure each draft length and recommend k."
)
@click.option("--max-prompts", type=int, default=None, help="Use at most N prompts [recipe validation.max_prompts].")
@SERVER_BINARY
@click.option(
    "--also-prompt-set",
    "also",
    multiple=True,
    metavar="SET[=N]",
    help=(
        "Also validate on this prompt set (e.g. sharegpt=16: 16 prompts of it; N defaults to "
        "--max-prompts), on the same server; its report in a folder named after it beside the first. "
        "Repeatable."
    ),
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@pass_ctx
@handle_errors
def run_all(
    ctx, recipe, report_dir, min_parity, min_speedup, sweep_draft_tokens, max_prompts, also, server_binary, no_progress
):
    """Every stage in one go: quantize -> build -> repo -> serve -> validate -> stop; ends with the verdict.

    Exit code as `validate`: 0 when every threshold holds; 1 incomplete, 3 parity, 4 speedup, 5 metrics disagree
    (with --also-prompt-set: the first failing set's).
    """
    from specdeploy.client import options as client_options
    from specdeploy.deploy import pipeline

    r = ctx.recipe(recipe)
    default_count = max_prompts if max_prompts is not None else r.validation.max_prompts
    extra = tuple(_also_prompt_set(spec, default_count) for spec in also)
    with ctx.locked(r, recipe):
        results = pipeline.run(
            r,
            ctx.layout(r),
            recipe,
            echo=click.echo,
            progress=not no_progress,
            server_binary=server_binary,
            report_dir=report_dir,
            min_parity=min_parity,
            min_speedup=min_speedup,
            max_prompts=max_prompts,
            sweep_draft_tokens=client_options.parse_range(sweep_draft_tokens) if sweep_draft_tokens else None,
            also=extra,
        )
    for report, paths, verdict in results:
        _print_validation(report, paths, verdict)
    sys.exit(next((v.exit_code for _, _, v in results if v.exit_code), 0))


def _also_prompt_set(spec: str, default_max_prompts: int) -> tuple[str, int]:
    prompt_set, equals, count = spec.partition("=")
    if equals and not count.isdigit():
        raise click.BadParameter(
            f"{spec!r}: the count after '=' must be a non-negative integer", param_hint="--also-prompt-set"
        )
    return prompt_set, int(count) if equals else default_max_prompts
