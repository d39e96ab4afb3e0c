"""One validation run: readiness -> greedy parity -> (sampling) -> warm-up -> latency -> (draft-length sweep).

Transport-free: it drives an `Endpoint` (Triton gRPC in production, a scripted fake in tests) and
returns the report as a plain dict. A fault (server unreachable, model not ready, timeout, server
gone) never escapes as an exception: it ends the run, and the report keeps what finished, marked
incomplete, with the error. `validate_deployment` runs it end to end on a `Deployment` (metrics check, gate,
cost, the `not_checked` list of what the deployment does not expose, the report files).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from specdeploy.config import SpeculativeConfig, ValidationConfig, exact_verification
from specdeploy.client import latency as lat
from specdeploy.client import metrics_check
from specdeploy.client import parity as par
from specdeploy.client.deployment import Deployment
from specdeploy.client.prompts import HFChatTemplate, Prompt, load_prompt_set, render_prompts, spread_over_categories
from specdeploy.client.protocol import (
    CONTROL_MODEL,
    REQUIRED_MODELS,
    SPECULATIVE_MODEL,
    TRIAGE_MODELS,
    Endpoint,
    GenerateRequest,
    Sampling,
    TokenCodec,
)
from specdeploy.errors import ClientError, ConfigError

REPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Options:
    """Everything a run needs; `from_recipe` takes the recipe's `validation`/`speculative` sections."""

    # Defaults are the recipe's (specdeploy.config), written once there.
    prompt_set: str = ValidationConfig.prompt_set
    max_prompts: int = ValidationConfig.max_prompts
    max_tokens: int = ValidationConfig.max_tokens
    concurrency: tuple[int, ...] = ValidationConfig.concurrency
    repeats: int = ValidationConfig.repeats
    min_parity: float = ValidationConfig.min_parity
    min_speedup: float = ValidationConfig.min_speedup
    near_tie_margin: float = ValidationConfig.near_tie_margin
    request_timeout_s: float = ValidationConfig.request_timeout_s
    chat_template: str = ValidationConfig.chat_template
    min_compared_tokens: int = ValidationConfig.min_compared_tokens
    min_compared_share: float = ValidationConfig.min_compared_share
    latency_prompts: int = ValidationConfig.latency_prompts
    exact_verification: bool = True  # from the recipe's backend (specdeploy.config.exact_verification)
    num_draft_tokens: int = SpeculativeConfig.num_draft_tokens
    max_draft_len: int = SpeculativeConfig.max_draft_len
    stream: bool = False  # decoupled deployments: stream for a client-side TTFT
    sweep_draft_tokens: tuple[int, ...] = ()
    sampling: Sampling | None = None  # set: also run the statistical sampling comparison
    samples_per_prompt: int = 200
    sample_prompts: int = 4
    sample_max_tokens: int = 2
    warmup_requests: int = 2

    @classmethod
    def from_recipe(cls, recipe, **overrides) -> "Options":
        v, s = recipe.validation, recipe.speculative
        base = dict(
            prompt_set=v.prompt_set,
            max_prompts=v.max_prompts,
            max_tokens=v.max_tokens,
            concurrency=tuple(v.concurrency),
            repeats=v.repeats,
            min_parity=v.min_parity,
            min_speedup=v.min_speedup,
            near_tie_margin=v.near_tie_margin,
            request_timeout_s=v.request_timeout_s,
            chat_template=v.chat_template,
            min_compared_tokens=v.min_compared_tokens,
            min_compared_share=v.min_compared_share,
            latency_prompts=v.latency_prompts,
            exact_verification=exact_verification(recipe.backend),
            num_draft_tokens=s.num_draft_tokens,
            max_draft_len=s.max_draft_len,
            stream=recipe.triton.decoupled,
        )
        return cls.build(**{**base, **{k: v for k, v in overrides.items() if v is not None}})

    @classmethod
    def build(cls, **fields) -> "Options":
        """Options from fields (None: the default), checked: a run that could compare nothing is refused."""
        options = cls(**{k: v for k, v in fields.items() if v is not None})
        if options.min_compared_tokens > options.max_tokens:
            raise ConfigError(
                f"min_compared_tokens ({options.min_compared_tokens}) is larger than max_tokens ({options.max_tokens}): no output could be compared",
                f"raise --max-tokens (validation.max_tokens) to at least {options.min_compared_tokens}, or lower --min-compared-tokens",
            )
        for k in options.sweep_draft_tokens:
            if not 1 <= k <= options.max_draft_len:
                raise ConfigError(
                    f"--sweep-draft-tokens asks for k={k}, outside 1..{options.max_draft_len} (speculative.max_draft_len)",
                    f"sweep within 1..{options.max_draft_len}; the target engine is built for at most that many draft tokens",
                )
        return options


def parse_range(text: str) -> tuple[int, ...]:
    """'1..6' -> (1, ..., 6); '1,2,4' -> (1, 2, 4)."""
    try:
        if ".." in text:
            low, high = (int(x) for x in text.split("..", 1))
            values = tuple(range(low, high + 1))
        else:
            values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise ConfigError(f"--sweep-draft-tokens {text!r} is not a range", "write e.g. 1..6 or 1,2,4") from exc
    if not values:
        raise ConfigError(f"--sweep-draft-tokens {text!r} is empty", "write e.g. 1..6")
    return values


class HFCodec:
    """The target's Hugging Face tokenizer (encode without special tokens, decode skipping them)."""

    def __init__(self, tokenizer_dir: str | Path):
        from transformers import AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        except (OSError, ValueError) as exc:  # no such directory / repository, or no tokenizer files in it
            raise ConfigError(f"cannot load a tokenizer from {str(tokenizer_dir)!r}: {str(exc).splitlines()[0][:300]}",
                              "pass --tokenizer a directory with tokenizer.json / tokenizer_config.json (the target model's), "
                              "or a Hugging Face model name already in the local cache") from None  # fmt: skip

    def chat_renderer(self):
        # The repository's preprocessing encodes with add_special_tokens (NVIDIA's default).
        return HFChatTemplate(self.tokenizer) if HFChatTemplate.available(self.tokenizer) else None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class _Progress:
    """A tqdm bar on stderr (progress=True), a callback per finished request (a callable), or nothing."""

    def __init__(self, total: int, enabled):
        self.bar = None
        self.callback = enabled if callable(enabled) else None
        if enabled is True:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="validate", unit="req", dynamic_ncols=True, leave=False)

    def phase(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_description(name)

    def __call__(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)
        if self.callback is not None:
            self.callback(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def validate(
    endpoint: Endpoint,
    codec: TokenCodec,
    options: Options,
    recipe_name: str = "",
    baseline: Endpoint | None = None,
    quality: dict | None = None,
    progress=True,
) -> dict:
    """Run every phase against `endpoint` and return the report dict (never raises on a server fault)."""
    prompts, template = prepare_prompts(options, codec)
    report = _new_report(recipe_name, endpoint, baseline, options, prompts, quality)
    report["settings"]["chat_template_used"] = template
    bar = _Progress(_total_steps(options, prompts, baseline is not None), progress)
    started = time.perf_counter()
    try:
        _run_phases(report, endpoint, codec, options, prompts, baseline, bar)
    except ClientError as exc:
        _fail(report, f"{exc.message} (hint: {exc.hint})" if exc.hint else exc.message)
    except KeyboardInterrupt:
        _fail(report, "interrupted (Ctrl-C)")
    finally:
        bar.close()
        report["duration_s"] = time.perf_counter() - started
    return report


def prepare_prompts(options: Options, codec: TokenCodec) -> tuple[list[Prompt], bool]:
    """The prompt set, rendered with the tokenizer's chat template (chat_template auto and one exists);
    and whether it was."""
    prompts = load_prompt_set(options.prompt_set, options.max_tokens, options.max_prompts)
    renderer = codec.chat_renderer() if options.chat_template == "auto" else None
    return render_prompts(prompts, renderer), renderer is not None


def latency_subset(options: Options, prompts: list[Prompt]) -> list[Prompt]:
    """The prompts each latency run sends: `latency_prompts` of them spread over the categories (0: all)."""
    return spread_over_categories(prompts, options.latency_prompts) if options.latency_prompts > 0 else list(prompts)


def _run_phases(report, endpoint, codec, options, prompts, baseline, bar) -> None:
    bar.phase("connect")
    endpoint.check_ready(REQUIRED_MODELS)
    if baseline is not None:
        baseline.check_ready((CONTROL_MODEL,))
    decoupled = options.stream or endpoint.is_decoupled(CONTROL_MODEL)
    report["settings"]["stream"] = decoupled

    bar.phase("parity")
    try:
        endpoint.check_ready(TRIAGE_MODELS)
        triage = True
    except ClientError as exc:
        triage = False
        report["warnings"].append(f"divergences cannot be triaged: {exc.message}")
    _parity(report, endpoint, codec, options, prompts, triage, decoupled, bar)
    if baseline is not None:
        _baseline_parity(report, endpoint, baseline, codec, options, prompts, bar)
    if options.sampling is not None:
        bar.phase("sampling")
        _sampling(report, endpoint, options, prompts, bar)

    timed = latency_subset(options, prompts)
    report["settings"]["latency_prompt_ids"] = [p.id for p in timed]
    if not one_model_at_a_time(endpoint):  # else each mode warms up after its model is loaded (_latency)
        bar.phase("warm-up")
        lat.warm_up(endpoint, timed, options.num_draft_tokens, options.request_timeout_s, options.warmup_requests)
    bar.phase("latency")
    _latency(report, endpoint, codec, options, timed, decoupled, bar)
    if options.sweep_draft_tokens:
        bar.phase("sweep")
        _sweep(report, endpoint, codec, options, timed, decoupled, bar)
    _speed_warnings(report, options)
    if one_model_at_a_time(endpoint):
        report["settings"]["control_loading"] = {
            "mode": "load_unload",
            "swaps": [{"loaded": name, "seconds": round(seconds, 3)} for name, seconds in endpoint.swaps],
            "note": "one model loaded at a time: the control and the speculative path were measured one after the "
                    "other (not interleaved), each after its own warm-up",
        }  # fmt: skip


def one_model_at_a_time(endpoint) -> bool:
    """The deployment holds one of its two models at a time (llmapi layout, triton.control load_unload)."""
    return bool(getattr(endpoint, "one_model_at_a_time", False))


class _ReplayControl:
    """Forwards everything, except that the control's requests come from results recorded before (load_unload:
    the control answered them while it was loaded)."""

    def __init__(self, inner, recorded: dict):
        self.inner, self.recorded = inner, recorded

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def generate(self, model, request, timeout_s, *args, **kwargs):
        if model == CONTROL_MODEL:
            return self.recorded[(request.prompt, request.stream)]
        return self.inner.generate(model, request, timeout_s, *args, **kwargs)


def _new_report(recipe_name, endpoint, baseline, options, prompts, quality) -> dict:
    settings = dataclasses.asdict(options)
    return {
        "schema_version": REPORT_SCHEMA_VERSION,
        "recipe": recipe_name,
        "url": endpoint.url,
        "baseline_url": baseline.url if baseline is not None else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "complete": True,
        "errors": [],
        "warnings": [],
        "settings": settings,
        "prompts": [dataclasses.asdict(p) for p in prompts],
        "parity": None,
        "baseline_parity": None,
        "sampling": None,
        "latency": None,
        "sweep": None,
        "quality": quality or {},
    }


def _fail(report: dict, message: str) -> None:
    report["complete"] = False
    report["errors"].append(message)


def _total_steps(options: Options, prompts: list[Prompt], with_baseline: bool) -> int:
    n = len(prompts)
    steps = n * (2 if with_baseline else 1)
    if options.sampling is not None:
        steps += options.sample_prompts * options.samples_per_prompt
    timed = len(latency_subset(options, prompts))
    steps += 2 * timed * len(options.concurrency) * options.repeats
    steps += timed * (1 + len(options.sweep_draft_tokens)) * options.repeats
    return steps


def greedy_policy(options: Options) -> par.GreedyPolicy:
    return par.GreedyPolicy(options.exact_verification, options.near_tie_margin, options.min_compared_tokens)


def _parity(report, endpoint, codec, options, prompts, triage: bool, decoupled: bool, bar) -> None:
    items: list[par.PromptParity] = []
    policy = greedy_policy(options)
    report["parity"] = {
        "items": [],
        "summary": {},
        "exact_verification": policy.exact,
        "near_tie_margin": options.near_tie_margin,
        "min_compared_tokens": options.min_compared_tokens,
        "min_compared_share": options.min_compared_share,
        "num_draft_tokens": options.num_draft_tokens,
        "streams_checked": decoupled,
    }

    def publish():
        report["parity"]["items"] = [dataclasses.asdict(i) for i in items]
        report["parity"]["summary"] = {k: v.to_dict() for k, v in par.summarize(items).items()}

    if one_model_at_a_time(endpoint):  # the control's answers first, while it is loaded; then the speculative model
        recorded = {}
        for prompt in prompts:
            for stream in (False, True) if decoupled else (False,):
                request = GenerateRequest(prompt.text, prompt.max_tokens, stream=stream)
                recorded[(prompt.text, stream)] = endpoint.generate(CONTROL_MODEL, request, options.request_timeout_s)
        endpoint = _ReplayControl(endpoint, recorded)
    try:
        for prompt in prompts:
            items.append(
                par.check_prompt(
                    endpoint, prompt, codec, options.num_draft_tokens, policy, options.request_timeout_s, triage, check_streams=decoupled
                )
            )
            publish()
            bar(1)
    finally:
        publish()


def _baseline_parity(report, endpoint, baseline, codec, options, prompts, bar) -> None:
    """Speculative output against a separate deployment's control (e.g. an unquantized target); informative."""
    items: list[par.PromptParity] = []
    report["baseline_parity"] = {"items": [], "summary": {}}
    control_texts = {i["prompt_id"]: i["speculative_text"] for i in report["parity"]["items"]}
    try:
        for prompt in prompts:
            base = baseline.generate(CONTROL_MODEL, GenerateRequest(prompt.text, prompt.max_tokens), options.request_timeout_s)
            policy = par.GreedyPolicy(False, options.near_tie_margin, options.min_compared_tokens)  # another deployment: never exact
            items.append(par.compare_greedy(prompt, base.text, control_texts[prompt.id], codec, None, policy))
            bar(1)
    finally:
        report["baseline_parity"]["items"] = [dataclasses.asdict(i) for i in items]
        report["baseline_parity"]["summary"] = {k: v.to_dict() for k, v in par.summarize(items).items()}


def _sampling(report, endpoint, options, prompts, bar) -> None:
    s = options.sampling
    section = report["sampling"] = {
        "settings": dataclasses.asdict(s),
        "samples_per_prompt": options.samples_per_prompt,
        "max_tokens": options.sample_max_tokens,
        "alpha": par.SAMPLING_ALPHA,
        "tests": [],
        "combined_p_value": None,
    }
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    chosen = [p for group in by_category.values() for p in group][: options.sample_prompts]
    try:
        for i, prompt in enumerate(chosen):
            test = par.check_prompt_sampling(
                endpoint,
                prompt,
                s,
                options.samples_per_prompt,
                options.sample_max_tokens,
                options.num_draft_tokens,
                options.request_timeout_s,
                seed_base=(s.seed or 0) + i * 1_000_003,
                progress=bar,
            )
            section["tests"].append(dataclasses.asdict(test))
    finally:
        section["combined_p_value"] = par.combine_p_values([t["p_value"] for t in section["tests"]]) if section["tests"] else None


def _references(report) -> dict[str, dict]:
    """Per latency mode: prompt id -> (text, generated tokens) from the parity phase."""
    out = {lat.CONTROL: {}, lat.SPECULATIVE: {}}
    for i in (report.get("parity") or {}).get("items", []):
        out[lat.CONTROL][i["prompt_id"]] = (i["control_text"], i["generated_tokens"])
        same = i["speculative_text"] == i["control_text"] and i["verdict"] in (par.MATCH, par.TOO_SHORT)
        out[lat.SPECULATIVE][i["prompt_id"]] = (i["speculative_text"], i["generated_tokens"] if same else None)
    return out


def _run_levels(report, report_section, endpoint, codec, options, prompts, decoupled, bar, plan) -> None:
    """Run (mode, concurrency, repeat, k) in order; stop at the first failed run (its samples are kept)."""
    references = _references(report)
    for mode, level, repeat, k in plan:
        run = lat.run_level(
            endpoint, codec, prompts, mode, level, repeat, options.request_timeout_s, k, decoupled, progress=bar,
            reference=references[mode],  # greedy: the same text for every k
        )
        report_section["runs"].append(run)
        if run.error is not None:
            raise ClientError(f"{mode} run at concurrency {level} stopped: {run.error}")


def _latency(report, endpoint, codec, options, prompts, decoupled, bar) -> None:
    section = {"runs": []}
    plan = [
        (mode, level, repeat, options.num_draft_tokens)
        for repeat in range(options.repeats)
        for level in options.concurrency
        for mode in lat.paired_order(repeat)  # interleaved so drift hits both sides alike
    ]
    try:
        if not one_model_at_a_time(endpoint):
            _run_levels(report, section, endpoint, codec, options, prompts, decoupled, bar, plan)
        for mode in (lat.CONTROL, lat.SPECULATIVE) if one_model_at_a_time(endpoint) else ():  # a model swap between them
            lat.warm_up(endpoint, prompts, options.num_draft_tokens, options.request_timeout_s, options.warmup_requests, (mode,))
            _run_levels(report, section, endpoint, codec, options, prompts, decoupled, bar, [p for p in plan if p[0] == mode])
    finally:
        runs = section["runs"]
        report["latency"] = {
            "runs": [r.to_dict() for r in runs],
            "levels": lat.summarize_levels(runs),
            "speedups": lat.speedup_table(runs),
        }


def _sweep(report, endpoint, codec, options, prompts, decoupled, bar) -> None:
    section = {"runs": []}
    plan = []
    for repeat in range(options.repeats):
        plan.append((lat.CONTROL, 1, repeat, None))
        plan += [(lat.SPECULATIVE, 1, repeat, k) for k in options.sweep_draft_tokens]
    try:
        _run_levels(report, section, endpoint, codec, options, prompts, decoupled, bar, plan)
    finally:
        runs = section["runs"]
        points = lat.sweep_points(runs)
        alpha, cost_ratio = lat.fit_speedup_model(points)
        report["sweep"] = {
            "runs": [r.to_dict() for r in runs],
            "points": points,
            "alpha": alpha,
            "cost_ratio": cost_ratio,
            "recommendation": lat.recommend_k(points, alpha, cost_ratio, options.max_draft_len),
        }


def _speed_warnings(report: dict, options: Options) -> None:
    for level in (report["latency"] or {}).get("levels", []):
        ttft, e2e = level.get("ttft_s_p50"), level.get("e2e_s_p50")
        if level.get("ttft_source") == "server" and ttft is not None and e2e and ttft > 0.9 * e2e:
            report["warnings"].append(
                f"TTFT of the {level['mode']} path comes from the server's perf outputs and is close to the whole latency: "
                "the server seems to stamp first_token_time_ns when the output is complete, so its TTFT and TPOT are not "
                "real; deploy in decoupled mode (triton.decoupled: true) to measure them on the stream"
            )
            break
    for level in (report["latency"] or {}).get("levels", []):
        if level.get("different_text"):
            report["warnings"].append(
                f"{level['different_text']} of {level['requests']} {level['mode']} outputs at concurrency {level['concurrency']} "
                "differ from the same prompt's output in the parity phase (greedy outputs should repeat exactly)"
            )
    rows = [r for r in (report["latency"] or {}).get("speedups", []) if r["category"] == "all" and r["median"] is not None]
    lowest = min(options.concurrency)
    for row in rows:
        if row["median"] < 1.0:
            why = (
                " (expected at high concurrency: the target is then busy with other requests' tokens, so the"
                " draft's work and the rejected tokens cost real throughput)"
                if row["concurrency"] > lowest
                else ""
            )
            report["warnings"].append(
                f"speculation is slower than the control at concurrency {row['concurrency']}: "
                f"{row['median']:.2f}x{why}"
            )
    sweep = report.get("sweep")
    if sweep and sweep["recommendation"].get("recommended_k") is not None:
        rec = sweep["recommendation"]
        best = rec.get("best_measured_speedup")
        if best is not None and best < 1.0:
            report["warnings"].append(f"no draft length made speculation faster (best {best:.2f}x at k={rec['best_measured_k']})")
        if rec["recommended_k"] != options.num_draft_tokens:
            report["warnings"].append(
                f"the sweep recommends num_draft_tokens={rec['recommended_k']} (recipe: {options.num_draft_tokens})"
            )


# ---------------------------------------------------------------- one deployment, end to end


def validate_deployment(deployment: Deployment, options: Options, report_dir: str | Path, progress=True,
                        baseline_url: str | None = None):  # fmt: skip
    """Validate `deployment` (a `client.deployment.Deployment`) and write the report; returns (report, paths, verdict).

    Server faults do not raise: the verdict then fails with exit code 1 and the report is marked incomplete.
    What the deployment does not expose is listed in the report's `not_checked` section, never skipped silently.
    """
    from specdeploy.client import gate
    from specdeploy.client.deployment import open_endpoint
    from specdeploy.client.report import write_report
    from specdeploy.client.triton_adapter import TritonEndpoint
    from specdeploy.cost import cost_section  # cost per response / per 1k tokens at the machine's price

    check_sweep(options, deployment.per_request_draft_tokens, deployment.layout if deployment.protocol == "triton" else "OpenAI")
    codec = HFCodec(deployment.tokenizer)
    check = metrics_check.MetricsCheck(open_endpoint(deployment), deployment.metrics_url, control_here=deployment.control_url is None)
    endpoint = check.endpoint
    baseline = TritonEndpoint(baseline_url) if baseline_url else None
    try:
        report = validate(endpoint, codec, options, deployment.title, baseline, deployment.quality, progress)
        report["deployment"] = deployment.describe()
        check.finish(report, metrics_check.served_policy(endpoint, deployment.policy))
        report["not_checked"] = not_checked(report, deployment, endpoint)
    finally:
        endpoint.close()
        if baseline is not None:
            baseline.close()
    verdict = gate.evaluate(report, options.min_parity, options.min_speedup, options.min_compared_share)
    report["gate"] = verdict.to_dict()
    report["cost"] = cost_section((report.get("latency") or {}).get("levels", []), deployment.price_per_hour, deployment.currency)
    paths = write_report(report, Path(report_dir))
    return report, paths, verdict


def check_sweep(options: Options, per_request_draft_tokens: bool, kind: str) -> None:
    """Refuse a draft-length sweep on a deployment whose requests cannot carry their own draft length."""
    if options.sweep_draft_tokens and not per_request_draft_tokens:
        raise ConfigError(f"--sweep-draft-tokens needs a draft length per request, and the {kind} deployment fixes it per "
                          "deployment (the llmapi layout: speculative_config.max_draft_len in model.yaml; an OpenAI server: its settings)",
                          "sweep on the inflight_batcher_llm layout over Triton, or change the draft length and redeploy")  # fmt: skip


def not_checked(report: dict, deployment: Deployment, endpoint) -> list[dict]:
    """What this run could not check on this deployment, each with the reason: [{"what", "because"}]."""
    out: list[dict] = []

    def add(what: str, because: str) -> None:
        out.append({"what": what, "because": because})

    items = (report.get("parity") or {}).get("items") or []
    if any(i.get("token_source") == par.IDS_RETOKENIZED for i in items):
        add("exact token ids of the outputs",
            "the deployment returns no output_ids and has no target-only model (preprocessing + tensorrt_llm) to trace: "
            "outputs were compared as text and tokens counted by re-tokenizing it with the given tokenizer")
    if any("divergences cannot be triaged" in w for w in report.get("warnings", [])) and not (report.get("parity") or {}).get("exact_verification"):
        add("near-tie triage of divergences",
            "the deployment has no target-only model returning generation logits: a divergence counts as a mismatch")
    counts = getattr(endpoint, "counts", {}).get(SPECULATIVE_MODEL)
    if counts is not None and counts.requests and counts.perf_missing == counts.requests:
        add("acceptance rate and acceptance length (draft tokens proposed / accepted)",
            "the speculative model returned no total_draft_tokens / total_accepted_draft_tokens with its responses")
    levels = (report.get("latency") or {}).get("levels") or []
    if levels and not any(level.get("ttft_source") for level in levels):
        add("TTFT and TPOT", "the deployment neither streams (not decoupled) nor returns arrival/first/last_token_time_ns: "
            "only end-to-end latency and throughput were measured")
    dropped = getattr(endpoint, "dropped_inputs", {}) or {}
    spec_name = deployment.names().get(SPECULATIVE_MODEL, SPECULATIVE_MODEL)
    if "num_draft_tokens" in dropped.get(spec_name, set()) or (deployment.foreign and not deployment.per_request_draft_tokens):
        add(f"the draft length the report names (num_draft_tokens={report['settings'].get('num_draft_tokens')})",
            "the speculative path takes no per-request num_draft_tokens: it ran with the deployment's own draft length")
    for model, names in sorted(dropped.items()):
        rest = sorted(n for n in names if n != "num_draft_tokens")
        if rest:
            add(f"request inputs {', '.join(rest)} of {model}", f"model '{model}' does not declare them, so they were not sent")
    spec = report.get("speculation") or {}
    if spec.get("source") is None:
        add("speculation rounds (with / without a draft) and the draft length per round",
            "the deployment returns no speculative_k_history and exports no specdeploy_spec_decode_rounds_total")
    if not spec.get("policy"):
        add("the speculation policy", "the speculative model's config carries no policy parameters and no recipe describes it")
    check = report.get("metrics_check") or {}
    if not check.get("checked"):
        add("the metrics endpoint against validate's own counts", "; ".join(check.get("notes") or ["not read"]))
    else:
        for note in check.get("notes") or []:
            if "not checked" in note or "exports no" in note:
                add("part of the metrics endpoint", note)
    if deployment.foreign:
        add("quantization quality", "no checkpoint manifests: the deployment was not built by specdeploy")
    if deployment.price_per_hour <= 0:
        add("cost per response and per 1k tokens", "no machine price given (--price-per-hour, or cost.machine_price_per_hour in a recipe)")
    return out


def summary_lines(report: dict) -> list[str]:
    """A few lines for the terminal: parity, speed per concurrency, sweep recommendation, warnings, errors."""
    lines = []
    parity = (report.get("parity") or {}).get("summary", {}).get("all")
    if parity:
        lines.append(
            f"parity: {parity['compared']}/{parity['prompts']} prompts compared ({parity['tokens']} tokens; "
            f"{parity['too_short']} too short), {parity['exact']} exact, {parity['near_ties']} near-ties, "
            f"{parity['mismatches']} mismatches, token agreement {parity['token_agreement']:.1%}"
        )
    levels = {(r["mode"], r["concurrency"]): r for r in (report.get("latency") or {}).get("levels", [])}
    for (mode, level), row in sorted(levels.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        if row.get("ttft_s_p50") is not None:
            tpot = row.get("tpot_s_p50")
            lines.append(
                f"concurrency {level} {mode}: TTFT p50 {row['ttft_s_p50'] * 1000:.1f} ms, TPOT p50 "
                + (f"{tpot * 1000:.1f} ms" if tpot is not None else "–")
                + f" ({row.get('ttft_source')}), {row['output_tokens_per_s'] or 0:.1f} tok/s"
            )
    for row in (report.get("latency") or {}).get("speedups", []):
        if row["category"] != "all" or row["median"] is None:
            continue
        spec = levels.get(("speculative", row["concurrency"]), {})
        rate = spec.get("acceptance_rate")
        lines.append(
            f"concurrency {row['concurrency']}: speedup {row['median']:.2f}x (repeats {row['min']:.2f}..{row['max']:.2f})"
            + (f", acceptance rate {rate:.2f}, acceptance length {spec['acceptance_length']:.2f}" if rate is not None else "")
        )
    sweep = report.get("sweep")
    if sweep and sweep["recommendation"].get("recommended_k") is not None:
        rec = sweep["recommendation"]
        lines.append(
            f"sweep: alpha {sweep['alpha']:.3f}, c {sweep['cost_ratio'] or 0:.3f}; recommended num_draft_tokens {rec['recommended_k']}"
        )
    lines += metrics_check.summary_lines(report)  # policy, rounds on/off, metrics check
    lines += [f"not checked: {n['what']} ({n['because']})" for n in report.get("not_checked") or []]
    lines += [f"warning: {w}" for w in report.get("warnings", [])]
    lines += [f"error: {e}" for e in report.get("errors", [])]
    return lines
