"""The `specdeploy` command line. The only place that turns SpecDeployError into exit codes."""

from __future__ import annotations

import contextlib
import functools
import sys
import traceback

import click

from specdeploy import config as cfg
from specdeploy.errors import SpecDeployError

RECIPE = click.argument("recipe", type=click.Path(dir_okay=False))


class Context:
    def __init__(self, verbose: bool, root: str | None, lock_timeout_s: float | None = None):
        self.verbose = verbose
        self.root = root
        self.lock_timeout_s = lock_timeout_s

    def recipe(self, path: str) -> cfg.Recipe:
        return cfg.load_recipe(path)

    def layout(self, recipe: cfg.Recipe):
        from specdeploy.artifacts import Layout

        return Layout.of(recipe, self.root)

    def locked(self, recipe: cfg.Recipe, recipe_path: str):
        """The recipe's lock (specdeploy.lock), taken by every command that writes its outputs, so that
        two runs on one recipe take turns."""
        from specdeploy import lock

        command = f"{click.get_current_context().command_path} {recipe_path}"
        timeout = lock.LOCK_TIMEOUT_S if self.lock_timeout_s is None else self.lock_timeout_s
        return lock.recipe_lock(self.layout(recipe).engines, recipe.name, command, timeout, echo=lambda m: click.echo(m, err=True))


def handle_errors(fn):
    """Print a SpecDeployError as one line plus its hint and exit with its code; --verbose adds the traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecDeployError as exc:
            ctx = click.get_current_context().find_object(Context)
            if ctx is not None and ctx.verbose:
                traceback.print_exc()
            click.secho(f"error: {exc.message}", fg="red", err=True)
            if exc.hint:
                click.echo(f"hint: {exc.hint}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--verbose", "-v", is_flag=True, help="Show tracebacks and debug output.")
@click.option(
    "--root",
    type=click.Path(file_okay=False),
    default=None,
    help="Project root holding engines/ and triton_repo/ (default: $SPECDEPLOY_ROOT or the current directory).",
)
@click.option(
    "--lock-timeout",
    type=click.FloatRange(min=0),
    default=__import__("specdeploy.lock").lock.LOCK_TIMEOUT_S,
    show_default=True,
    help="Seconds to wait while another specdeploy run holds the recipe (engines/<recipe>/.lock); 0: fail at once.",
)
@click.version_option(package_name="specdeploy")
@click.pass_context
def main(ctx, verbose, root, lock_timeout):
    """Quantize, build, serve and validate speculative-decoding deployments on Triton."""
    ctx.obj = Context(verbose, root, lock_timeout)


pass_ctx = click.make_pass_decorator(Context)


# ---------------------------------------------------------------- recipe and environment


@main.command()
@RECIPE
@pass_ctx
@handle_errors
def check(ctx, recipe):
    """Validate RECIPE and print the resolved plan: every stage, its inputs, outputs and state."""
    from specdeploy import plan

    r = ctx.recipe(recipe)
    click.echo(plan.describe(r, ctx.layout(r), recipe))


@main.command()
@click.option("--clean-shm", is_flag=True, help="Remove Triton python-backend shared-memory regions no process uses.")
@handle_errors
def doctor(clean_shm):
    """One line per check of this machine: Python, torch, GPU, TensorRT-LLM, ModelOpt, tritonserver, shared
    memory, ports, cache."""
    from specdeploy import doctor as doc

    if clean_shm:
        click.echo(doc.clean_shm())
    for line in doc.report_lines():
        click.echo(line)


@main.group()
def models():
    """Bundled pretrained models."""


@models.command("list")
@handle_errors
def models_list():
    """List the bundled models and whether they are fetched."""
    from specdeploy import models as mdl

    for line in mdl.list_lines():
        click.echo(line)


@models.command("fetch")
@click.argument("name", type=click.Choice(sorted(__import__("specdeploy.models").models.BUNDLED)))
@handle_errors
def models_fetch(name):
    """Download and convert a bundled model into the cache (instant when done before)."""
    from specdeploy import models as mdl

    path = mdl.fetch(name)
    click.echo(f"{name}: {path}")


# ---------------------------------------------------------------- stages
# Each stage adds its command below, in pipeline order.


# ---- quantize (specdeploy.quantize)


@main.command()
@RECIPE
@click.option("--force", is_flag=True, help="Quantize again even when the checkpoints are up to date.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@pass_ctx
@handle_errors
def quantize(ctx, recipe, force, no_progress):
    """Quantize the draft and target into TensorRT-LLM checkpoints with ModelOpt and print their quality."""
    from specdeploy import quantize as quant

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        quant.quantize_recipe(r, ctx.layout(r), force=force, echo=click.echo, progress=not no_progress)


# ---- draft: the EAGLE-3 head (draft.kind eagle3)


@main.group("draft")
def draft_group():
    """The EAGLE-3 head of a draft.kind eagle3 recipe: its training data, then its training."""


@draft_group.command("train")
@RECIPE
@click.option("--force", is_flag=True, help="Train again even when the head is up to date (discards an unfinished run's checkpoint).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@pass_ctx
@handle_errors
def draft_train(ctx, recipe, force, no_progress):
    """Train the recipe's EAGLE-3 head with ModelOpt on `draft data`'s set; export it (EAGLE-3 checkpoint layout).

    An interrupted run continues from its last checkpoint (engines/<recipe>/eagle3-head.partial) when rerun."""
    from specdeploy import draft_train as train

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        train.train_recipe(r, ctx.layout(r), force=force, echo=click.echo, progress=not no_progress)


# ---- build (BackendStages.build: one builder per backend)


@main.command()
@RECIPE
@click.option("--force", is_flag=True, help="Build again even when the engines are up to date.")
@click.option("--dry-run", is_flag=True, help="GPU backends: print the pre-flight checks and build commands; write nothing.")
@pass_ctx
@handle_errors
def build(ctx, recipe, force, dry_run):
    """Build the draft and target engines from the quantized checkpoints (target with max_draft_len)."""
    from specdeploy import backend_stages

    r = ctx.recipe(recipe)
    with contextlib.nullcontext() if dry_run else ctx.locked(r, recipe):
        backend_stages.of(r).build(r, ctx.layout(r), force=force, echo=click.echo, dry_run=dry_run)


# ---- repo / serve / stop / status (specdeploy.triton)


@main.command()
@RECIPE
@click.option("--force", is_flag=True, help="Regenerate even when the repository is up to date.")
@pass_ctx
@handle_errors
def repo(ctx, recipe, force):
    """Generate the Triton model repository (triton_repo/<recipe>/) wiring the draft and target engines."""
    from specdeploy import backend_stages

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        path, written = backend_stages.of(r).write_repository(r, ctx.layout(r), recipe_path=recipe, force=force)
    click.echo(f"{'wrote' if written else 'up to date:'} {path}")


@main.command()
@RECIPE
@click.option("--detach", is_flag=True, help="Leave the server running in the background (see `stop`, `status`).")
@click.option(
    "--server-binary",
    type=click.Path(dir_okay=False),
    default=None,
    help="A tritonserver binary (default: $SPECDEPLOY_TRITONSERVER, else the one in the nvidia-pytriton wheel).",
)
@click.option("--print-only", is_flag=True, help="GPU backends: print the launch and its docker equivalent; start nothing.")
@click.option("--print-k8s", is_flag=True, help="GPU backends: print Kubernetes manifests (Deployment, Service, HPA).")
@click.option("--image", default=None, help="GPU backends: the NGC base image the generated Dockerfile installs specdeploy into (--print-only), or the image the pods run (--print-k8s).")
@click.option("--openai-port", type=click.IntRange(1, 65535), default=None, help="Also serve an OpenAI-compatible API (/v1/...) on 127.0.0.1:PORT over the deployment.")
@click.option("--openai-host", default="127.0.0.1", show_default=True, help="--openai-port: the address the front binds; beyond loopback it needs --api-key.")
@click.option("--api-key", envvar="SPECDEPLOY_API_KEY", default=None, show_envvar=True, help="--openai-port: every route but /health wants 'Authorization: Bearer KEY'.")
@pass_ctx
@handle_errors
def serve(ctx, recipe, detach, server_binary, print_only, print_k8s, image, openai_port, openai_host, api_key):
    """Serve the recipe's model repository on tritonserver (loopback; ports from the recipe or free ones)."""
    from specdeploy import backend_stages

    r = ctx.recipe(recipe)
    layout = ctx.layout(r)
    if openai_port is not None:
        _serve_openai(ctx, r, layout, recipe, detach, server_binary, openai_port, openai_host, api_key or None)
        return
    serve_here = functools.partial(backend_stages.of(r).serve, r, layout, detach=detach, server_binary=server_binary, recipe_path=recipe,
                                   echo=click.echo, print_only=print_only, print_k8s=print_k8s, image=image)  # fmt: skip
    if print_only or print_k8s:  # prints (and writes the image context); starts nothing, takes no lock
        serve_here()
        return
    if detach:
        with ctx.locked(r, recipe):  # a detached start holds the lock until the server is ready
            serve_here()
        return
    with ctx.locked(r, recipe):  # a foreground serve only waits for writers (it must not hold the lock)
        pass
    serve_here()


def _serve_openai(ctx, r, layout, recipe, detach, server_binary, port, host, api_key):
    """`serve --openai-port`: tritonserver (detached, recorded for `stop`) plus the OpenAI front, in the
    background with --detach, else in the foreground until Ctrl-C, which then stops both."""
    from specdeploy import backend_stages, backends, openai_api
    from specdeploy.errors import ConfigError
    from specdeploy.triton import server

    if backends.of(r).gpu:
        raise ConfigError("--openai-port starts the front beside a local CPU deployment",
                          f"for a GPU deployment run: python -m specdeploy.openai_api {recipe} --grpc-url HOST:PORT --port N")  # fmt: skip
    if r.layout == "llmapi":
        raise ConfigError("--openai-port fronts the inflight_batcher_llm layout (ensemble and tensorrt_llm_bls); this recipe "
                          "serves the llmapi layout", "serve without --openai-port, or set triton.layout: inflight_batcher_llm")  # fmt: skip
    openai_api.check_bind(host, api_key)  # before starting anything
    with ctx.locked(r, recipe):
        state = backend_stages.of(r).serve(r, layout, detach=True, server_binary=server_binary, recipe_path=recipe, echo=click.echo)
    try:
        if detach:
            openai_api.start_detached(recipe, ctx.root, state.grpc_url, port, layout.server_state, echo=click.echo, host=host, api_key=api_key)
            return
        front = openai_api.build_front(r, layout, state.grpc_url, api_key=api_key)
        openai_api.serve_foreground(front, port, echo=click.echo, host=host)
    except BaseException:
        click.echo(server.stop(layout.server_state))
        raise
    click.echo(server.stop(layout.server_state))


# ---- draft data (the group is defined above, with draft train)


@draft_group.command("data")
@RECIPE
@click.option("--force", is_flag=True, help="Start over: discard an interrupted run's work and an up-to-date output.")
@pass_ctx
@handle_errors
def draft_data(ctx, recipe, force):
    """Have the target write the head's training set (draft.data): rerun to resume after an interruption."""
    from specdeploy import draft_data as dd

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        dd.make_draft_data(r, ctx.layout(r), recipe_path=recipe, force=force, echo=lambda m: click.echo(m, err=True))


@main.command()
@RECIPE
@pass_ctx
@handle_errors
def stop(ctx, recipe):
    """Stop the server that `serve --detach` started for RECIPE (and its OpenAI front, if any)."""
    from specdeploy import backend_stages, openai_api

    r = ctx.recipe(recipe)
    front = openai_api.stop_detached(ctx.layout(r).server_state)
    if front:
        click.echo(front)
    click.echo(backend_stages.of(r).stop(ctx.layout(r)))


@main.command()
@RECIPE
@pass_ctx
@handle_errors
def status(ctx, recipe):
    """Say whether the detached server of RECIPE is running and ready, and where."""
    from specdeploy.triton import server

    r = ctx.recipe(recipe)
    _, line = server.status(ctx.layout(r).server_state)
    click.echo(line)


@main.command()
@RECIPE
@click.option("--prompt", required=True, help="Text to continue (sent as is, like the Triton preprocessing model).")
@click.option("--no-spec", is_flag=True, help="Run the target alone (the unaccelerated control).")
@click.option("--num-draft-tokens", type=int, default=None, help="Draft tokens per round [recipe speculative.num_draft_tokens].")
@click.option("--max-tokens", type=int, default=None, help="Tokens to generate [recipe validation.max_tokens].")
@click.option("--temperature", type=float, default=None, help="Sampling temperature; ignored unless --top-k or --top-p is set (TensorRT-LLM semantics).")
@click.option("--top-k", type=int, default=None, help="Top-k sampling (0: not set).")
@click.option("--top-p", type=float, default=None, help="Top-p sampling (0: not set).")
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option("--use-draft-logits/--no-draft-logits", default=None, help="Accept by rejection sampling on draft logits [recipe speculative.use_draft_logits].")
@click.option("--chat/--raw", default=True, help="Wrap the prompt in the tokenizer's chat template (default), or send it as is like the Triton preprocessing model.")
@pass_ctx
@handle_errors
def generate(ctx, recipe, prompt, no_spec, num_draft_tokens, max_tokens, temperature, top_k, top_p, seed, use_draft_logits, chat):
    """Generate from RECIPE's built CPU engines in-process: stream the text, then print statistics."""
    from specdeploy import backends
    from specdeploy import generate as gen
    from specdeploy.errors import ConfigError
    from specdeploy.speculative import SamplingParams

    r = ctx.recipe(recipe)
    backends.of(r).require_local("'specdeploy generate'", r)
    k = r.speculative.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
    if not no_spec and not 1 <= k <= r.speculative.max_draft_len:
        raise ConfigError(f"--num-draft-tokens {k} is outside 1..{r.speculative.max_draft_len} (speculative.max_draft_len)", "pick a smaller k, or rebuild with a larger max_draft_len")
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
    mode = "target only" if no_spec else f"speculative, {r.draft.kind} draft, k<={k}, policy {session.deployment.describe()}"
    click.secho(f"-- {mode}", bold=True, err=True)
    for line in gen.stats_lines(result, speculative=not no_spec):
        click.echo(line, err=True)


# ---- validate / run (specdeploy.client)


def _print_validation(report, paths, verdict) -> None:
    from specdeploy.client.validate import summary_lines

    for line in summary_lines(report):
        click.echo(line, err=line.startswith(("warning", "error")))
    click.echo(f"report: {paths['markdown']}")
    click.secho(verdict.line, fg="green" if verdict.passed else "red", bold=True)


from specdeploy.client import deployment as _dep  # noqa: E402  (choices and defaults of validate's deployment options)

FOREIGN_OPTIONS = ("tokenizer", "layout", "speculative_model", "control_model", "control_url", "control_loading", "num_draft_tokens",
                   "max_draft_len", "use_draft_logits", "price_per_hour")  # fmt: skip


@main.command()
@click.argument("recipe", type=click.Path(dir_okay=False), required=False)
@click.option("--url", default=None, help="The deployment: Triton gRPC host:port (with RECIPE: [the server `serve --detach` started]); without RECIPE and --protocol openai: the OpenAI API's base URL.")
@click.option("--tokenizer", default=None, help="Without RECIPE: the target's tokenizer, a directory or a Hugging Face model name (required).")
@click.option("--layout", type=click.Choice(_dep.LAYOUTS), default=_dep.Deployment.layout, show_default=True, help="Without RECIPE: the Triton layout of the deployment.")
@click.option("--speculative-model", default=None, help="Without RECIPE: the speculative model's name [inflight_batcher_llm: tensorrt_llm_bls; llmapi: tensorrt_llm; openai: found in /v1/models].")
@click.option("--control-model", default=None, help="Without RECIPE: the control (target alone) model's name [inflight_batcher_llm: ensemble; llmapi: tensorrt_llm_control, or tensorrt_llm with --control-url].")
@click.option("--control-url", default=None, help="Without RECIPE: a second server (same protocol) that serves the control.")
@click.option("--control-loading", type=click.Choice(_dep.CONTROL_LOADINGS), default=_dep.Deployment.control_loading, show_default=True, help="Without RECIPE, llmapi: load_unload swaps the two models by Triton's explicit model control (one loaded at a time).")
@click.option("--num-draft-tokens", type=click.IntRange(min=1), default=None, help="Without RECIPE: draft tokens per round sent to the speculative model [validate's default].")
@click.option("--max-draft-len", type=click.IntRange(min=1), default=None, help="Without RECIPE: the target's max_draft_len (bounds --sweep-draft-tokens).")
@click.option("--use-draft-logits/--no-draft-logits", default=None, help="Without RECIPE, inflight_batcher_llm: the BLS's use_draft_logits input (accept by draft logits) [not sent].")
@click.option("--price-per-hour", type=click.FloatRange(min=0), default=None, help="Without RECIPE: what the serving machine costs per hour (adds cost per response).")
@click.option("--baseline-url", default=None, help="A second deployment (e.g. the unquantized target) to compare outputs with; informative.")
@click.option("--report-dir", type=click.Path(file_okay=False), default=None, help="Where to write the report [engines/<recipe>/report/; without RECIPE: ./specdeploy-report/].")
@click.option("--min-parity", type=float, default=None, help="Least share of prompts with greedy parity [recipe validation.min_parity].")
@click.option("--min-speedup", type=float, default=None, help="Least speedup at the lowest concurrency; 0 disables [recipe validation.min_speedup].")
@click.option("--sweep-draft-tokens", default=None, metavar="1..K", help="Also measure each draft length (e.g. 1..6), fit the speedup model, recommend k.")
@click.option("--max-prompts", type=int, default=None, help="Use at most N prompts, spread over the categories [recipe validation.max_prompts].")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Tokens to generate per prompt [recipe validation.max_tokens].")
@click.option("--min-compared-tokens", type=click.IntRange(min=1), default=None, help="A control output shorter than this is too short to compare [recipe validation.min_compared_tokens].")
@click.option("--prompt-set", "--prompts", "prompt_set", default=None, help="'builtin' or a .jsonl file (prompt or messages, category, max_tokens) [recipe validation.prompt_set].")
@click.option("--chat/--raw", "chat", default=None, help="Render prompts with the tokenizer's chat template when it has one, or send them as raw text [recipe validation.chat_template; auto].")
@click.option("--concurrency", default=None, metavar="1,2,4", help="Concurrency levels of the latency phase [recipe validation.concurrency].")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Repeats of every latency run [recipe validation.repeats].")
@click.option("--top-k", type=int, default=None, help="Also compare sampled outputs statistically with this top-k.")
@click.option("--top-p", type=float, default=None, help="Also compare sampled outputs statistically with this top-p.")
@click.option("--temperature", type=float, default=1.0, show_default=True, help="Temperature of the sampling comparison.")
@click.option("--samples", type=int, default=200, show_default=True, help="Seeded samples per side and prompt in the sampling comparison.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--protocol", type=click.Choice(_dep.PROTOCOLS), default=_dep.Deployment.protocol, show_default=True, help="Send the requests over Triton gRPC or through an OpenAI-compatible API.")
@click.option("--openai-url", default=None, help="The OpenAI API, http://127.0.0.1:PORT (specdeploy's front: serve --openai-port PORT), for --protocol openai; with it, --url is the Triton under it.")
@click.option("--metrics-url", default=None, help="Triton's metrics endpoint HOST:PORT, checked against validate's counts [the detached server's; none with --url].")
@pass_ctx
@handle_errors
def validate(ctx, recipe, url, baseline_url, report_dir, min_parity, min_speedup, sweep_draft_tokens, max_prompts, prompt_set, top_k, top_p,
             temperature, samples, no_progress, protocol, openai_url, metrics_url, max_tokens, min_compared_tokens, chat, concurrency, repeats,
             **foreign):  # fmt: skip
    """Check greedy parity and measure the speedup of a deployment against its unaccelerated control.

    With RECIPE: the recipe's deployment. Without: any deployment at --url (NVIDIA's inflight_batcher_llm or llmapi
    layout on Triton, or an OpenAI-compatible server with --protocol openai), described by --tokenizer and the model
    options; what it does not expose is listed in the report as not checked.

    Exit code 0 when every threshold holds; 1 incomplete run (server fault), 3 parity, 4 speedup, 5 metrics disagree.
    """
    from specdeploy.client import validate as val
    from specdeploy.client.protocol import Sampling
    from specdeploy.errors import ConfigError

    overrides = dict(
        min_parity=min_parity, min_speedup=min_speedup, max_prompts=max_prompts, prompt_set=prompt_set, max_tokens=max_tokens,
        min_compared_tokens=min_compared_tokens,
        chat_template=None if chat is None else ("auto" if chat else "none"), repeats=repeats,
        concurrency=_levels(concurrency) if concurrency else None,
        sweep_draft_tokens=val.parse_range(sweep_draft_tokens) if sweep_draft_tokens else None,
        sampling=Sampling(temperature, top_k or 0, top_p or 0.0, seed=0) if (top_k or top_p) else None, samples_per_prompt=samples,
    )  # fmt: skip
    if recipe is None:
        report, paths, verdict = _validate_foreign(url, protocol, openai_url, metrics_url, baseline_url, report_dir, not no_progress,
                                                   overrides, foreign)  # fmt: skip
    else:
        from specdeploy.recipe_deployment import validate_recipe

        defaults = {"layout": _dep.Deployment.layout, "control_loading": _dep.Deployment.control_loading}
        given = [f"--{k.replace('_', '-')}" for k in FOREIGN_OPTIONS if foreign.get(k) is not None and foreign.get(k) != defaults.get(k)]
        if given:
            raise ConfigError(f"{', '.join(given)} describe a deployment without a recipe; {recipe} already describes its own",
                              f"drop {', '.join(given)}, or drop RECIPE to validate the deployment at --url")  # fmt: skip
        r = ctx.recipe(recipe)
        with ctx.locked(r, recipe):
            report, paths, verdict = validate_recipe(r, ctx.layout(r), url=url, baseline_url=baseline_url, report_dir=report_dir,
                                                     progress=not no_progress, protocol=protocol, openai_url=openai_url,
                                                     metrics_url=metrics_url, **overrides)  # fmt: skip
    _print_validation(report, paths, verdict)
    sys.exit(verdict.exit_code)


def _levels(text: str) -> tuple[int, ...]:
    from specdeploy.errors import ConfigError

    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        raise ConfigError(f"--concurrency {text!r} is not a list of levels", "write e.g. 1,2,4")
    return levels


def _validate_foreign(url, protocol, openai_url, metrics_url, baseline_url, report_dir, progress, overrides, foreign):
    """`validate --url ... --tokenizer ...`: a deployment described by the options alone."""
    from specdeploy.client import validate as val
    from specdeploy.client.deployment import Deployment
    from specdeploy.errors import ConfigError

    api_url, triton_url = (openai_url or url, url if openai_url else None) if protocol == "openai" else (url, None)
    if not api_url:
        raise ConfigError("no RECIPE and no --url: nothing says which deployment to validate",
                          "pass RECIPE, or --url HOST:PORT (Triton gRPC; the API's base URL with --protocol openai) and --tokenizer")  # fmt: skip
    if not foreign.get("tokenizer"):
        raise ConfigError("--url without RECIPE needs --tokenizer: the target's tokenizer renders the prompts and counts tokens",
                          "pass --tokenizer DIR (the target model's directory) or a Hugging Face model name")  # fmt: skip
    deployment = Deployment(
        api_url, foreign["tokenizer"], protocol=protocol, layout=foreign["layout"], speculative_model=foreign["speculative_model"],
        control_model=foreign["control_model"], control_url=foreign["control_url"], control_loading=foreign["control_loading"],
        triton_url=triton_url, metrics_url=metrics_url, price_per_hour=foreign["price_per_hour"] or 0.0,
        use_draft_logits=foreign["use_draft_logits"],
    )  # fmt: skip
    knobs = {k: foreign[k] for k in ("num_draft_tokens", "max_draft_len")}
    if knobs["max_draft_len"] is None and knobs["num_draft_tokens"] is not None:
        knobs["max_draft_len"] = max(knobs["num_draft_tokens"], val.Options.max_draft_len)
    options = val.Options.build(exact_verification=False, **knobs, **overrides)  # another deployment's verification: triaged, not assumed exact
    return val.validate_deployment(deployment, options, report_dir or "specdeploy-report", progress, baseline_url)


@main.command("run")
@RECIPE
@click.option("--report-dir", type=click.Path(file_okay=False), default=None, help="Where to write the report [engines/<recipe>/report/].")
@click.option("--min-parity", type=float, default=None, help="Least share of prompts with greedy parity [recipe validation.min_parity].")
@click.option("--min-speedup", type=float, default=None, help="Least speedup at the lowest concurrency; 0 disables [recipe validation.min_speedup].")
@click.option("--sweep-draft-tokens", default=None, metavar="1..K", help="Also measure each draft length and recommend k.")
@click.option("--max-prompts", type=int, default=None, help="Use at most N prompts [recipe validation.max_prompts].")
@click.option(
    "--server-binary",
    type=click.Path(dir_okay=False),
    default=None,
    help="A tritonserver binary (default: $SPECDEPLOY_TRITONSERVER, else the one in the nvidia-pytriton wheel).",
)
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@pass_ctx
@handle_errors
def run_all(ctx, recipe, report_dir, min_parity, min_speedup, sweep_draft_tokens, max_prompts, server_binary, no_progress):
    """Every stage in one go: quantize -> build -> repo -> serve -> validate -> stop; ends with the verdict.

    Exit code as `validate`: 0 when every threshold holds; 1 incomplete, 3 parity, 4 speedup, 5 metrics disagree.
    """
    from specdeploy import pipeline
    from specdeploy.client import validate as val

    r = ctx.recipe(recipe)
    with ctx.locked(r, recipe):
        report, paths, verdict = pipeline.run(
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
            sweep_draft_tokens=val.parse_range(sweep_draft_tokens) if sweep_draft_tokens else None,
        )
    _print_validation(report, paths, verdict)
    sys.exit(verdict.exit_code)


# ---- operations: monitor / canary (specdeploy.monitor, specdeploy.canary, specdeploy.metrics)


def _metrics_url(ctx, r, url: str | None, recipe_path: str) -> str:
    if url:
        return url
    from specdeploy.errors import ServerError
    from specdeploy.triton.server import ServerState

    state = ServerState.read(ctx.layout(r).server_state)
    if state is None:
        raise ServerError(f"no detached server is recorded for {r.name}", f"start one (specdeploy serve {recipe_path} --detach) or pass --url HOST:METRICS_PORT")
    return state.metrics_url


@main.command()
@RECIPE
@click.option("--url", default=None, help="Triton's metrics endpoint, HOST:PORT or a /metrics URL [the server `serve --detach` started].")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="Seconds between frames.")
@click.option("--once", is_flag=True, help="Print one frame (after one interval) and exit.")
@pass_ctx
@handle_errors
def monitor(ctx, recipe, url, interval, once):
    """Live view of the deployment: acceptance, tokens per round, TPOT p50/p99, speculation on/off, in flight, cost."""
    from specdeploy import monitor as mon

    r = ctx.recipe(recipe)
    mon.run(_metrics_url(ctx, r, url, recipe), r.cost, interval_s=interval, once=once, echo=click.echo, title=r.name)


@main.command()
@RECIPE
@click.option("--url", default=None, help="Triton's metrics endpoint, HOST:PORT or a /metrics URL [the server `serve --detach` started].")
@click.option("--window", type=click.FloatRange(min=0.1), default=None, help="Seconds of live traffic to compare [recipe canary.window_s].")
@click.option("--min-requests", type=click.IntRange(min=1), default=None, help="Requests each arm needs in the window [recipe canary.min_requests].")
@click.option("--drive", type=click.Choice(["triton", "openai"]), default=None, help="Also send the recipe's validation prompts down the canary path during the window, over Triton gRPC or the OpenAI front.")
@click.option("--grpc-url", default=None, help="--drive triton: the deployment's gRPC HOST:PORT [the detached server].")
@click.option("--openai-url", default=None, help="--drive openai: the OpenAI front, http://127.0.0.1:PORT.")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True, help="--drive: requests in flight.")
@click.option("--until-enough", is_flag=True, help="End the window as soon as each arm has --min-requests (--window is then the most).")
@pass_ctx
@handle_errors
def canary(ctx, recipe, url, window, min_requests, drive, grpc_url, openai_url, concurrency, until_enough):
    """Compare the speculative and control arms on live traffic; promote (exit 0), roll back (3) or inconclusive (1).

    The control arm exists when the recipe sets canary.control_percent > 0 (the BLS then sends that share down
    the plain path).
    """
    import dataclasses

    from specdeploy import canary as can

    r = ctx.recipe(recipe)
    config = r.canary if min_requests is None else dataclasses.replace(r.canary, min_requests=min_requests)
    if r.canary.control_percent <= 0:
        click.echo(f"warning: canary.control_percent is 0 in {recipe}: the deployment has no control arm", err=True)
    traffic = can.traffic_for(r, ctx.layout(r), drive, grpc_url, openai_url, concurrency).start() if drive else None
    try:
        verdict = can.watch(_metrics_url(ctx, r, url, recipe), config, window or config.window_s, echo=lambda s: click.echo(s, err=True),
                            tick_s=2.0 if until_enough else 5.0, until_enough=until_enough)  # fmt: skip
    finally:
        if traffic is not None:
            sent, failed, error = traffic.stop()
            click.echo(f"drove {sent} requests over {drive} ({failed} failed{': ' + error if error else ''})", err=True)
    for line in can.lines(verdict):
        click.echo(line)
    click.secho(verdict.line, fg={"promote": "green", "rollback": "red"}.get(verdict.decision, "yellow"), bold=True)
    sys.exit(verdict.exit_code)
