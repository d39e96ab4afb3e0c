"""A recipe's deployment as the validation client sees it: `deployment_of(recipe, layout, ...)` builds the
`client.deployment.Deployment` (addresses, protocol, model names, tokenizer, policy, quality, price) from the
recipe and its artifacts, and `validate_recipe` runs `specdeploy validate RECIPE` with it.

This is the pipeline/CLI layer: it reads the repository, the server state and the checkpoint manifests so that
the client (`specdeploy.client`) never imports a stage.
"""

from __future__ import annotations

from pathlib import Path

from specdeploy.client.deployment import PROTOCOLS, Deployment
from specdeploy.core.errors import ClientError, ConfigError


def tokenizer_dir(recipe, layout) -> Path:
    """The tokenizer the server uses (the `tokenizer_dir` of the repository's preprocessing model),
    else the target's source model."""
    from specdeploy.client.protocol import PREPROCESSING_MODEL

    config_path = Path(layout.repo) / PREPROCESSING_MODEL / "config.pbtxt"
    if config_path.is_file():
        from specdeploy.triton.model_config import check_config

        param = check_config(config_path.read_text()).parameters.get("tokenizer_dir")
        if param is not None and param.string_value:
            path = Path(param.string_value)
            path = path if path.is_absolute() else (config_path.parent / path).resolve()
            if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
                return path
    from specdeploy.core import model_store as models

    return models.resolve(recipe.target.model)


def server_url(layout) -> str:
    """The gRPC address of the server `serve --detach` (or `run`) started for this recipe."""
    from specdeploy.triton import server

    state, line = server.status(layout.server_state)
    if state is None or not state.running():  # a PID now held by another process is no server
        raise ClientError(
            f"no running server for this recipe: {line}",
            "start one with: specdeploy serve RECIPE --detach, or pass --url host:port",
        )
    return state.grpc_url


def recorded_metrics_url(layout) -> str | None:
    """The metrics endpoint of the server `serve --detach` recorded for this recipe, if any."""
    from specdeploy.triton.server_state import ServerState

    state = ServerState.read(layout.server_state)
    return state.metrics_url if state is not None else None


def read_quality(layout) -> dict:
    """The quantize stage's quality reports (`extra["quality"]` of each checkpoint manifest), by role."""
    from specdeploy.core.artifacts import Manifest
    from specdeploy.recipe.config import ROLES

    out = {}
    for role in ROLES:
        manifest = Manifest.read(layout.checkpoint(role))
        if manifest is not None and manifest.extra.get("quality") is not None:
            quality = manifest.extra["quality"]
            out[role] = {
                "qformat": manifest.settings.get("qformat"),
                **(quality if isinstance(quality, dict) else {"value": quality}),
            }
    return out


def recipe_policy(recipe) -> dict:
    """The speculation policy the recipe configures (the BLS's config parameters, as the repository writes them)."""
    from specdeploy.speculation.policy import PolicySettings

    return {
        **PolicySettings.from_recipe(recipe.speculative).to_parameters(),
        "num_draft_tokens": str(recipe.speculative.num_draft_tokens),
        "canary_control_percent": str(recipe.canary.control_percent),
        "draft_kind": getattr(recipe.draft, "kind", "model"),
    }


def deployment_of(
    recipe,
    layout,
    url: str | None = None,
    protocol: str = "triton",
    openai_url: str | None = None,
    metrics_url: str | None = None,
) -> Deployment:
    """The recipe's deployment: url its gRPC address (default: the server `serve --detach` started, which also gives
    the metrics endpoint); protocol openai: through specdeploy's front at openai_url; metrics_url: Triton's metrics
    port.
    """
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"--protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}",
            "use --protocol triton or --protocol openai",
        )
    if metrics_url is None and url is None:
        metrics_url = recorded_metrics_url(layout)
    common = dict(
        tokenizer=str(tokenizer_dir(recipe, layout)),
        metrics_url=metrics_url,
        name=recipe.name,
        foreign=False,
        policy=recipe_policy(recipe),
        quality=read_quality(layout),
        price_per_hour=recipe.cost.machine_price_per_hour,
        currency=recipe.cost.currency,
    )
    if protocol == "openai":
        if recipe.layout == "llmapi":
            raise ConfigError(
                "--protocol openai drives specdeploy's OpenAI front, which serves the inflight_batcher_llm layout",
                "validate the llmapi layout over Triton (--protocol triton)",
            )
        if not openai_url:
            raise ConfigError(
                "--protocol openai needs the front's address",
                "pass --openai-url http://127.0.0.1:PORT (specdeploy serve RECIPE --openai-port PORT)",
            )
        try:
            triton_url = url or server_url(layout)  # the control's exact tokens and the served configs
        except ClientError:
            triton_url = None
        return Deployment(
            openai_url,
            protocol="openai",
            speculative_model=f"{recipe.name}-speculative",
            control_model=f"{recipe.name}-control",
            canary_model=f"{recipe.name}-canary",
            fixed_num_draft_tokens=recipe.speculative.num_draft_tokens,
            triton_url=triton_url,
            **common,
        )
    control_loading = "load_unload" if recipe.layout == "llmapi" and recipe.control == "load_unload" else "side_by_side"
    return Deployment(url or server_url(layout), layout=recipe.layout, control_loading=control_loading, **common)


def recipe_options(recipe, protocol: str = "triton", **overrides):
    """validate's Options for `recipe` (`overrides` replace Options fields), its draft-length sweep checked against the
    layout `protocol` reaches (`specdeploy run` asks this before its first stage)."""
    from specdeploy.client.options import Options, check_sweep

    options = Options.from_recipe(recipe, **overrides)
    check_sweep(
        options,
        recipe.layout == "inflight_batcher_llm" and protocol == "triton",
        recipe.layout if protocol == "triton" else "OpenAI",
    )
    return options


def validate_recipe(
    recipe,
    layout,
    url: str | None = None,
    baseline_url: str | None = None,
    report_dir: str | Path | None = None,
    progress=True,
    protocol: str = "triton",
    openai_url: str | None = None,
    metrics_url: str | None = None,
    **overrides,
):
    """Validate the deployment of `recipe` and write the report; returns (report, paths, verdict).

    Server faults do not raise: the verdict then fails with exit code 1 and the report is marked
    incomplete. `overrides` replace Options fields (min_parity, min_speedup, max_prompts, ...).
    """
    from specdeploy.client.validate import validate_deployment

    options = recipe_options(recipe, protocol, **overrides)
    deployment = deployment_of(recipe, layout, url, protocol, openai_url, metrics_url)
    return validate_deployment(deployment, options, report_dir or layout.report, progress, baseline_url)
