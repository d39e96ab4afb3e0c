"""Latency of control vs speculative per concurrency level, and the draft-length sweep.

Definitions (as trtllm-bench and vLLM use them):
- TTFT and TPOT = (last token time - first token time) / (output tokens - 1), from one clock per
  request: the client's when streamed (decoupled deployments), else the model's perf outputs
  (arrival_time_ns, first_token_time_ns, last_token_time_ns). Each sample records its source.
- output tokens: the ids the server returned (`output_ids`), else the count the parity phase took
  from the target's own ids for the same text (greedy outputs repeat exactly), else the re-tokenized
  text; each sample records which.
- acceptance rate = accepted draft tokens / drafted tokens.
- acceptance length = output tokens / target iterations; every speculative round yields its
  accepted drafts plus one target token, so iterations = output tokens - accepted tokens.
- expected speedup (Leviathan et al. 2023, eq. 1 and thm. 3.8): with per-token acceptance alpha,
  draft length k and cost ratio c = draft step / target step, tokens per round
  = (1 - alpha^(k+1)) / (1 - alpha) and speedup = that / (k c + 1).
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import numpy as np

from specdeploy.client import runtime_counters
from specdeploy.client.prompts import Prompt
from specdeploy.client.protocol import (
    CONTROL_MODEL,
    SPECULATIVE_MODEL,
    Endpoint,
    GenerateRequest,
    GenerateResult,
    TokenCodec,
)
from specdeploy.core.errors import ClientError

CONTROL, SPECULATIVE = "control", "speculative"
# RequestSample.tokens_source
COUNT_IDS, COUNT_USAGE, COUNT_PARITY, COUNT_RETOKENIZED = "output_ids", "usage", "parity", "retokenized"
MODEL_OF_MODE = {CONTROL: CONTROL_MODEL, SPECULATIVE: SPECULATIVE_MODEL}
PERCENTILES = (50, 90, 99)


@dataclass
class RequestSample:
    mode: str
    concurrency: int
    repeat: int
    prompt_id: str
    category: str
    num_draft_tokens: int | None
    start_s: float  # since the start of its level run
    latency_s: float
    ttft_s: float | None
    ttft_source: str | None  # "stream" | "server": also the source of decode_s
    output_tokens: int
    drafted: int | None = None
    accepted: int | None = None
    decode_s: float | None = None  # first token -> last token
    tokens_source: str = COUNT_RETOKENIZED
    same_text: bool | None = None  # the text equals the parity phase's for this prompt and path (None: no reference)
    # per round, where the BLS returns them (speculative path): k, and seconds of the draft's work and the target call
    k_rounds: list[int] | None = None
    draft_s_rounds: list[float] | None = None
    target_s_rounds: list[float] | None = None
    acceptance_source: str | None = None  # which counters `drafted` / `accepted` come from

    @property
    def tpot_s(self) -> float | None:
        if self.decode_s is None or self.output_tokens < 2:
            return None
        return self.decode_s / (self.output_tokens - 1)


@dataclass
class LevelRun:
    """One pass of the prompts through one model at one concurrency."""

    mode: str
    concurrency: int
    repeat: int
    num_draft_tokens: int | None
    wall_s: float = 0.0
    samples: list[RequestSample] = field(default_factory=list)
    error: str | None = None  # set when the run stopped early; samples holds what finished
    counters: dict | None = None  # the runtime's metrics endpoint over this run (runtime_counters.CounterWindow)

    def to_dict(self) -> dict:
        d = asdict(self)
        for s, raw in zip(self.samples, d["samples"]):
            raw["tpot_s"] = s.tpot_s
        return d


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def acceptance(samples: Sequence[RequestSample]) -> tuple[float | None, float | None]:
    """(acceptance rate, acceptance length) over the samples that carry perf outputs."""
    with_perf = [s for s in samples if s.drafted is not None and s.accepted is not None]
    if not with_perf:
        return None, None
    drafted = sum(s.drafted for s in with_perf)
    accepted = sum(s.accepted for s in with_perf)
    tokens = sum(s.output_tokens for s in with_perf)
    iterations = sum(max(s.output_tokens - s.accepted, 1) for s in with_perf)
    return (accepted / drafted if drafted else None), tokens / iterations


def level_stats(runs: Sequence[LevelRun]) -> dict:
    """Statistics of one (mode, concurrency) over its repeats; rates are per repeat, then averaged."""
    samples = [s for r in runs for s in r.samples]
    out = {"requests": len(samples), "repeats": len(runs)}
    for name, values in (
        ("ttft_s", [s.ttft_s for s in samples]),
        ("tpot_s", [s.tpot_s for s in samples]),
        ("e2e_s", [s.latency_s for s in samples]),
    ):
        out[f"{name}_mean"] = _mean(values)
        for q in PERCENTILES:
            out[f"{name}_p{q}"] = percentile(values, q)
    tok_rates = [sum(s.output_tokens for s in r.samples) / r.wall_s for r in runs if r.wall_s > 0 and r.samples]
    req_rates = [len(r.samples) / r.wall_s for r in runs if r.wall_s > 0 and r.samples]
    out["output_tokens_per_s"] = _mean(tok_rates)
    out["output_tokens_per_s_per_repeat"] = tok_rates
    out["requests_per_s"] = _mean(req_rates)
    out["output_tokens"] = sum(s.output_tokens for s in samples)
    out["acceptance_rate"], out["acceptance_length"] = acceptance(samples)
    with_perf = [s for s in samples if s.drafted is not None]
    out["drafted"] = sum(s.drafted for s in with_perf) if with_perf else None  # None: the path returns no draft counts
    out["acceptance_source"] = next((s.acceptance_source for s in with_perf if s.acceptance_source), None)
    window = runtime_counters.merge([runtime_counters.CounterWindow(**r.counters) for r in runs if r.counters])
    if not with_perf and window is not None:  # no counts per response: the runtime's metrics endpoint over these runs
        out["acceptance_rate"], out["acceptance_length"] = window.acceptance_rate, window.acceptance_length
        out["drafted"], out["acceptance_source"] = window.drafted, window.source
        out["accepted_per_position"] = [n / window.drafts for n in window.accepted_per_pos] if window.drafts else None
    out["ttft_source"] = next((s.ttft_source for s in samples if s.ttft_source), None)
    out["tokens_source"] = sorted({s.tokens_source for s in samples})
    out["same_text"] = sum(s.same_text is True for s in samples)
    out["different_text"] = sum(s.same_text is False for s in samples)
    return out


def spread(values: Sequence[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "std": None, "per_repeat": []}
    return {
        "median": float(np.median(values)),
        "min": float(min(values)),
        "max": float(max(values)),
        "std": float(np.std(values)),
        "per_repeat": [float(v) for v in values],
    }


def speedup_of(control: Sequence[RequestSample], speculative: Sequence[RequestSample]) -> float | None:
    """Mean control latency over mean speculative latency, on the prompts both sides completed."""
    spec_by_prompt = {s.prompt_id: s.latency_s for s in speculative}
    pairs = [(c.latency_s, spec_by_prompt[c.prompt_id]) for c in control if c.prompt_id in spec_by_prompt]
    if not pairs:
        return None
    control_total, spec_total = map(sum, zip(*pairs))
    return control_total / spec_total if spec_total > 0 else None


def speedup_table(runs: Sequence[LevelRun]) -> list[dict]:
    """Rows (concurrency, category, spread of the per-repeat speedup, and the speculative path's acceptance rate and
    length over all repeats); category "all" first."""
    rows = []
    levels = sorted({r.concurrency for r in runs})
    for level in levels:
        pairs = _paired_runs(runs, level)
        categories = ["all"] + sorted({s.category for c, _ in pairs for s in c.samples})
        for category in categories:
            per_repeat, spec_samples = [], []
            for control, spec in pairs:
                pick = (lambda s: True) if category == "all" else (lambda s, g=category: s.category == g)
                per_repeat.append(
                    speedup_of([s for s in control.samples if pick(s)], [s for s in spec.samples if pick(s)])
                )
                spec_samples += [s for s in spec.samples if pick(s)]
            rate, length = acceptance(spec_samples)
            rows.append(
                {
                    "concurrency": level,
                    "category": category,
                    **spread(per_repeat),
                    "acceptance_rate": rate,
                    "acceptance_length": length,
                }
            )
    return rows


def paired_order(repeat: int) -> tuple[str, str]:
    """Which side runs first in a repeat: control first in even repeats, speculative first in odd ones (ABBA), so
    neither side always runs on the machine the other has just warmed or loaded, and a drift over the run hits
    both sides alike."""
    return (CONTROL, SPECULATIVE) if repeat % 2 == 0 else (SPECULATIVE, CONTROL)


def _paired_runs(runs: Sequence[LevelRun], level: int, k: int | None = None) -> list[tuple[LevelRun, LevelRun]]:
    control = {r.repeat: r for r in runs if r.mode == CONTROL and r.concurrency == level}
    spec = {
        r.repeat: r
        for r in runs
        if r.mode == SPECULATIVE and r.concurrency == level and (k is None or r.num_draft_tokens == k)
    }
    return [(control[rep], spec[rep]) for rep in sorted(control) if rep in spec]


def summarize_levels(runs: Sequence[LevelRun]) -> list[dict]:
    rows = []
    for level in sorted({r.concurrency for r in runs}):
        for mode in (CONTROL, SPECULATIVE):
            chosen = [r for r in runs if r.mode == mode and r.concurrency == level]
            if chosen:
                rows.append({"mode": mode, "concurrency": level, **level_stats(chosen)})
    return rows


def _timed_rounds(sample: RequestSample) -> bool:
    """The sample carries every round's k and seconds and is long enough for a decode phase."""
    k, d, t = sample.k_rounds, sample.draft_s_rounds, sample.target_s_rounds
    return (
        bool(k)
        and len(k) >= 2
        and len(k) == len(d or ()) == len(t or ())
        and sample.decode_s is not None
        and sample.output_tokens >= 2
    )


def _by_k_row(k: int, rounds: list[tuple[float, float]], step_s: float) -> dict:
    """The rounds of one k: (draft seconds, target seconds) each -> count and means, the target call in control
    steps."""
    target_s = _mean(t for _, t in rounds)
    return {
        "k": k,
        "rounds": len(rounds),
        "target_s": target_s,
        "draft_s": _mean(d for d, _ in rounds),
        "target_steps": target_s / step_s,
    }


def round_profile(runs: Sequence[LevelRun]) -> list[dict]:
    """Where the speculative path's decode time goes, per concurrency, from the server's own timings: each round's
    draft work and target call (`speculative_draft_seconds` / `speculative_target_seconds`) and the rest of the
    server's first-to-last-token time (the loop, scheduling, the Triton hop), against the control's time a token.

    A round is one target call: with draft.kind eagle3 (fused) one engine pass of k + 1 rows; on the BLS's other
    paths a Triton call, and a k = 0 round there may be a plain run of several tokens. Decode phase only, as TPOT:
    the rounds after the first (which holds the prefill) and the output tokens after the first. Then TPOT speedup =
    tokens a round / (draft + target call + rest, in control steps), exactly, since the three parts sum to the decode
    time. Rows by k: rounds, the target call's and the draft work's mean. At concurrency > 1 a pass shared with other
    requests counts whole for each. Levels whose speculative samples carry no round seconds are left out."""
    out = []
    for level in sorted({r.concurrency for r in runs}):
        spec = [
            s for r in runs if r.mode == SPECULATIVE and r.concurrency == level for s in r.samples if _timed_rounds(s)
        ]
        control = [
            s
            for r in runs
            if r.mode == CONTROL and r.concurrency == level
            for s in r.samples
            if s.decode_s is not None and s.output_tokens >= 2
        ]
        if not spec or not control:
            continue
        step_s = sum(s.decode_s for s in control) / sum(s.output_tokens - 1 for s in control)
        rounds = sum(len(s.k_rounds) - 1 for s in spec)
        tokens = sum(s.output_tokens - 1 for s in spec)
        draft_s = sum(sum(s.draft_s_rounds[1:]) for s in spec)
        target_s = sum(sum(s.target_s_rounds[1:]) for s in spec)
        rest_s = sum(s.decode_s for s in spec) - draft_s - target_s
        by_k: dict[int, list[tuple[float, float]]] = {}
        for s in spec:
            for k, d, t in zip(s.k_rounds[1:], s.draft_s_rounds[1:], s.target_s_rounds[1:]):
                by_k.setdefault(int(k), []).append((d, t))
        steps = {
            name: value / rounds / step_s
            for name, value in (("draft", draft_s), ("target", target_s), ("rest", rest_s))
        }
        out.append(
            {
                "concurrency": level,
                "requests": len(spec),
                "rounds": rounds,
                "tokens_per_round": tokens / rounds,
                "control_step_s": step_s,
                "draft_s_per_round": draft_s / rounds,
                "target_s_per_round": target_s / rounds,
                "rest_s_per_round": rest_s / rounds,
                "draft_steps": steps["draft"],
                "target_steps": steps["target"],
                "rest_steps": steps["rest"],
                "round_steps": sum(steps.values()),
                "tpot_speedup": tokens / rounds / sum(steps.values()),
                "by_k": [_by_k_row(k, v, step_s) for k, v in sorted(by_k.items())],
            }
        )
    return out


# ---------------------------------------------------------------- the expected-speedup model


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """(1 - alpha^(k+1)) / (1 - alpha): expected tokens a round yields (Leviathan et al. 2023, eq. 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Tokens per round over the cost of a round in target steps (k draft steps at c each, one target step)."""
    return expected_tokens_per_round(alpha, k) / (k * cost_ratio + 1.0)


def expected_acceptance_rate(alpha: float, k: int) -> float:
    """Expected accepted / drafted for draft length k: alpha (1 - alpha^k) / (k (1 - alpha))."""
    if alpha >= 1.0:
        return 1.0
    return alpha * (1.0 - alpha**k) / (k * (1.0 - alpha))


def fit_speedup_model(points: Sequence[dict]) -> tuple[float | None, float | None]:
    """Least-squares (alpha, c) from sweep points with `k`, `acceptance_rate` and `speedup`.

    alpha is fitted to the measured acceptance rates (accepted / drafted, exact server counts), or
    to the acceptance lengths where no rates exist; then c to the measured speedups given alpha.
    """
    from scipy.optimize import minimize_scalar

    by_rate = [p for p in points if p.get("acceptance_rate") is not None]
    by_length = [p for p in points if p.get("acceptance_length") is not None]
    if by_rate:

        def alpha_error(alpha):
            return sum((p["acceptance_rate"] - expected_acceptance_rate(alpha, p["k"])) ** 2 for p in by_rate)

    elif by_length:

        def alpha_error(alpha):
            return sum((p["acceptance_length"] - expected_tokens_per_round(alpha, p["k"])) ** 2 for p in by_length)

    else:
        return None, None
    alpha = float(minimize_scalar(alpha_error, bounds=(0.0, 0.9999), method="bounded").x)
    timed = [p for p in points if p.get("speedup") is not None]
    if not timed:
        return alpha, None

    def speedup_error(c):
        return float(sum((p["speedup"] - expected_speedup(alpha, p["k"], c)) ** 2 for p in timed))

    cost_ratio = float(minimize_scalar(speedup_error, bounds=(0.0, 10.0), method="bounded").x)
    return alpha, cost_ratio


def recommend_k(points: Sequence[dict], alpha: float | None, cost_ratio: float | None, max_k: int) -> dict:
    """The k to deploy: the argmax of the fitted model over 1..max_k (smooth against timing noise)."""
    measured = [p for p in points if p.get("speedup") is not None]
    best_measured = max(measured, key=lambda p: p["speedup"]) if measured else None
    out = {
        "best_measured_k": best_measured["k"] if best_measured else None,
        "best_measured_speedup": best_measured["speedup"] if best_measured else None,
    }
    if points and all(p.get("most_drafts") == 0 for p in points):  # the rounds say no k was drafted: nothing to fit
        out.update(
            recommended_k=None,
            predicted_speedup=None,
            predicted={},
            no_recommendation="no round of any k drafted (the deployment's policy or schedule kept them plain)",
        )
    elif alpha is not None and cost_ratio is not None:
        predicted = {k: expected_speedup(alpha, k, cost_ratio) for k in range(1, max_k + 1)}
        k = max(predicted, key=predicted.get)
        out.update(recommended_k=k, predicted_speedup=predicted[k], predicted=predicted)
    else:
        out.update(recommended_k=out["best_measured_k"], predicted_speedup=None, predicted={})
    return out


def sweep_points(runs: Sequence[LevelRun]) -> list[dict]:
    """Per k: acceptance rate/length and speedup vs the control (concurrency 1), with spread."""
    points = []
    for k in sorted({r.num_draft_tokens for r in runs if r.mode == SPECULATIVE}):
        pairs = _paired_runs(runs, 1, k)
        spec_samples = [s for _, sp in pairs for s in sp.samples]
        rate, length = acceptance(spec_samples)
        speed = spread([speedup_of(c.samples, sp.samples) for c, sp in pairs])
        # the most drafts any round held, where the server returns its rounds (speculative_k_history): below k, the
        # deployment capped the request's k (a schedule, the engine's max_draft_len) or the draft never proposed more
        histories = [s.k_rounds for s in spec_samples if s.k_rounds]
        most = max(max(h) for h in histories) if histories else None
        points.append(
            {
                "k": k,
                "acceptance_rate": rate,
                "acceptance_length": length,
                "speedup": speed["median"],
                "speedup_spread": speed,
                "most_drafts": most,
            }
        )
    return points


# ---------------------------------------------------------------- running requests


ProgressFn = Callable[[int], None]


Reference = dict  # prompt id -> (text, generated tokens or None): the parity phase's output


def count_tokens(
    result: GenerateResult, codec: TokenCodec, reference: tuple[str, int | None] | None
) -> tuple[int, str]:
    """(output tokens, where the count comes from): the returned ids, else the server's own count (an OpenAI
    server's `usage`), else the parity phase's exact count for the same text, else the re-tokenized text."""
    if result.token_ids is not None:
        return len(result.token_ids), COUNT_IDS
    if result.usage_tokens is not None:
        return result.usage_tokens, COUNT_USAGE
    if reference is not None and reference[1] is not None and result.text == reference[0]:
        return reference[1], COUNT_PARITY
    return len(codec.encode(result.text)), COUNT_RETOKENIZED


def run_level(
    endpoint: Endpoint,
    codec: TokenCodec,
    prompts: Sequence[Prompt],
    mode: str,
    concurrency: int,
    repeat: int,
    timeout_s: float,
    num_draft_tokens: int | None = None,
    stream: bool = False,
    progress: ProgressFn | None = None,
    reference: Reference | None = None,
) -> LevelRun:
    """Send every prompt once with `concurrency` requests in flight; the first failure stops the run.

    `reference`: the parity phase's output per prompt (text, generated tokens), to count tokens
    exactly and to check that the output repeats. Never raises ClientError: a failure is recorded
    in `LevelRun.error`, with the finished samples kept.
    """
    reference = reference or {}
    run = LevelRun(mode, concurrency, repeat, num_draft_tokens if mode == SPECULATIVE else None)
    model = MODEL_OF_MODE[mode]
    lock = threading.Lock()
    queue = list(prompts)
    start = time.perf_counter()

    def worker():
        while True:
            with lock:
                if run.error is not None or not queue:
                    return
                prompt = queue.pop(0)
            request = GenerateRequest(
                prompt.text, prompt.max_tokens, num_draft_tokens=run.num_draft_tokens, stream=stream
            )
            sent = time.perf_counter() - start
            try:
                result = endpoint.generate(model, request, timeout_s)
            except ClientError as exc:
                with lock:
                    run.error = run.error or exc.message
                return
            known = reference.get(prompt.id)
            tokens, tokens_source = count_tokens(result, codec, known)
            sample = RequestSample(
                mode,
                concurrency,
                repeat,
                prompt.id,
                prompt.category,
                run.num_draft_tokens,
                start_s=sent,
                latency_s=result.latency_s,
                ttft_s=result.ttft_s,
                ttft_source=result.ttft_source,
                output_tokens=tokens,
                drafted=result.perf.total_draft_tokens if mode == SPECULATIVE else None,
                accepted=result.perf.total_accepted_draft_tokens if mode == SPECULATIVE else None,
                decode_s=result.decode_s,
                tokens_source=tokens_source,
                same_text=None if known is None else result.text == known[0],
                k_rounds=result.k_history if mode == SPECULATIVE else None,
                draft_s_rounds=result.draft_s_history if mode == SPECULATIVE else None,
                target_s_rounds=result.target_s_history if mode == SPECULATIVE else None,
                acceptance_source=result.perf.source if mode == SPECULATIVE else None,
            )
            with lock:
                run.samples.append(sample)
            if progress is not None:
                progress(1)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(queue)))]
    for t in threads:
        t.start()
    for t in threads:
        # Every request has its own deadline, so workers end; the join bound is a last resort.
        t.join(timeout=timeout_s * (len(prompts) + 1))
    run.wall_s = time.perf_counter() - start
    if any(t.is_alive() for t in threads):
        run.error = run.error or "a request did not return within its deadline"
    return run


def warm_up(
    endpoint: Endpoint,
    prompts: Sequence[Prompt],
    num_draft_tokens: int,
    timeout_s: float,
    requests: int = 2,
    modes: Sequence[str] = (CONTROL, SPECULATIVE),
) -> None:
    """A few requests to each model (of `modes`) so first-call costs (loading, allocation) stay out of the numbers."""
    for mode in modes:
        for prompt in list(prompts)[:requests]:
            k = num_draft_tokens if mode == SPECULATIVE else None
            endpoint.generate(
                MODEL_OF_MODE[mode], GenerateRequest(prompt.text, prompt.max_tokens, num_draft_tokens=k), timeout_s
            )
