"""Canary rollout: compare the speculative arm with the control arm from live metrics, promote or roll back.

With `canary.control_percent: P` the speculative entry point (`tensorrt_llm_bls`) sends P % of its
requests down the plain path (one target call, no draft) and labels every metric with its arm
(`specdeploy.metrics`). Both arms see the same traffic mix, so over a window their figures compare
directly:

- speedup = (control seconds per output token) / (speculative seconds per output token), each the
  window's summed end-to-end latency over its output tokens (exact, from counters);
- p99 ratio = speculative e2e p99 / control e2e p99 (from the histograms, Prometheus interpolation);
- acceptance rate and error shares of the speculative arm.

Verdict: `promote` (exit 0) when speedup >= min_speedup, the p99 ratio <= max_p99_ratio, acceptance
>= min_acceptance_rate and the speculative arm fails no more often than the control; `rollback`
(exit 3) otherwise; `inconclusive` (exit 1) while either arm has fewer than min_requests in the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from specdeploy.core.metrics import names, reader
from specdeploy.recipe.config import CanaryConfig

PROMOTE, ROLLBACK, INCONCLUSIVE = "promote", "rollback", "inconclusive"
EXIT_CODES = {PROMOTE: 0, ROLLBACK: 3, INCONCLUSIVE: 1}


@dataclass(frozen=True)
class Verdict:
    decision: str
    reasons: tuple[str, ...]
    speculative: reader.ArmStats
    control: reader.ArmStats
    window_s: float
    speedup: float | None = None
    p99_ratio: float | None = None
    checks: dict = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.decision]

    @property
    def line(self) -> str:
        return f"{self.decision.upper()}: " + "; ".join(self.reasons)


def decide(window: reader.Snapshot, config: CanaryConfig, window_s: float, model: str | None = None) -> Verdict:
    """The verdict for one window (a Snapshot difference) under the recipe's canary thresholds."""
    spec = reader.arm_stats(window, names.SPECULATIVE_ARM, model)
    ctrl = reader.arm_stats(window, names.CONTROL_ARM, model)
    few = [a for a in (spec, ctrl) if a.requests + a.errors < config.min_requests]
    if few:
        reasons = tuple(
            f"{a.arm} arm had {a.requests + a.errors:.0f} requests in {window_s:.0f} s, fewer than"
            f" {config.min_requests}"
            for a in few
        )
        if ctrl in few and config.control_percent <= 0:  # no traffic reaches the control arm however long one waits
            fix = (
                "the BLS sends no requests down the control arm: set canary.control_percent (e.g. 10) in the recipe, "
                "then `specdeploy repo` and `specdeploy serve` it again"
            )
        else:
            fix = "wait longer (--window) or send more traffic"
        return Verdict(INCONCLUSIVE, reasons + (fix,), spec, ctrl, window_s)
    spt_spec, spt_ctrl = arm_spt(spec), arm_spt(ctrl)
    speedup = spt_ctrl / spt_spec if spt_spec and spt_ctrl else None
    p99_ratio = spec.e2e_p99_s / ctrl.e2e_p99_s if spec.e2e_p99_s and ctrl.e2e_p99_s else None
    err_spec = spec.errors / (spec.requests + spec.errors)
    err_ctrl = ctrl.errors / (ctrl.requests + ctrl.errors)
    checks = {
        "speedup": (speedup, config.min_speedup, speedup is not None and speedup >= config.min_speedup),
        "p99_ratio": (p99_ratio, config.max_p99_ratio, p99_ratio is None or p99_ratio <= config.max_p99_ratio),
        "acceptance_rate": (
            spec.acceptance_rate,
            config.min_acceptance_rate,
            (spec.acceptance_rate or 0.0) >= config.min_acceptance_rate,
        ),
        "error_share": (err_spec, err_ctrl, err_spec <= err_ctrl),
    }
    failed = [name for name, (_, _, ok) in checks.items() if not ok]
    reasons = []
    for name in failed or checks:
        value, limit, ok = checks[name]
        reasons.append(_describe(name, value, limit, ok))
    return Verdict(ROLLBACK if failed else PROMOTE, tuple(reasons), spec, ctrl, window_s, speedup, p99_ratio, checks)


def _describe(name: str, value, limit, ok: bool) -> str:
    shown = "n/a" if value is None else f"{value:.3f}"
    if name == "speedup":
        return f"speedup {shown}x {'>=' if ok else '<'} {limit:.2f}x (seconds per output token, control / speculative)"
    if name == "p99_ratio":
        return f"e2e p99 speculative/control {shown} {'<=' if ok else '>'} {limit:.2f}"
    if name == "acceptance_rate":
        return f"acceptance rate {shown} {'>=' if ok else '<'} {limit:.2f}"
    return f"error share speculative {value:.3f} {'<=' if ok else '>'} control {limit:.3f}"


def watch(
    url: str,
    config: CanaryConfig,
    window_s: float,
    model: str | None = None,
    echo=print,
    tick_s: float = 5.0,
    sleep=time.sleep,
    until_enough: bool = False,
) -> Verdict:
    """Scrape the metrics endpoint at the start and end of a window of live traffic and decide.

    until_enough: end the window early, at a tick where each arm has `config.min_requests` (window_s is then the most).
    """
    before = reader.scrape(url)
    start = time.monotonic()
    echo(f"watching {reader.metrics_url(url)} for {window_s:.0f} s ...")
    latest = before
    while (left := window_s - (time.monotonic() - start)) > 0:
        sleep(min(tick_s, left))
        scraped = reader.scrape(url)
        if reset := scraped.resets(latest):
            return _restarted(reset, time.monotonic() - start)
        latest = scraped
        now = scraped.minus(before)
        elapsed = time.monotonic() - start
        spec_n, control_n = (
            now.sum(names.REQUESTS.name, arm=names.SPECULATIVE_ARM),
            now.sum(names.REQUESTS.name, arm=names.CONTROL_ARM),
        )
        echo(f"  {elapsed:5.0f} s: speculative {spec_n:.0f} requests, control {control_n:.0f}")
        if until_enough and min(spec_n, control_n) >= config.min_requests:
            break
    after = reader.scrape(url)
    if reset := after.resets(latest):
        return _restarted(reset, time.monotonic() - start)
    return decide(after.minus(before), config, time.monotonic() - start, model)


def _restarted(series: list[str], window_s: float) -> Verdict:
    """The server restarted inside the window: its counters began again from 0, so the two arms cannot be compared over
    it (a restart after the speculative arm crashed it must not read as a fast speculative arm)."""
    empty = (
        reader.arm_stats(reader.Snapshot({}), names.SPECULATIVE_ARM),
        reader.arm_stats(reader.Snapshot({}), names.CONTROL_ARM),
    )
    return Verdict(
        INCONCLUSIVE,
        (
            f"the server restarted during the window ({', '.join(series[:3])} went back)",
            "look at why it restarted (specdeploy status RECIPE, its log), then watch a new window",
        ),
        *empty,
        window_s,
    )


def lines(verdict: Verdict) -> list[str]:
    out = [
        f"{'arm':<12} {'requests':>8} {'errors':>6} {'tok/s':>8} {'s/token':>8} {'e2e p50':>8} {'e2e p99':>8}"
        f" {'accept':>7} {'tok/round':>9}"
    ]
    for arm in (verdict.speculative, verdict.control):
        spt = arm_spt(arm)
        out.append(
            f"{arm.arm:<12} {arm.requests:>8.0f} {arm.errors:>6.0f} {_f(arm.tokens_per_s(verdict.window_s), 1):>8}"
            f" {_f(spt, 4):>8} {_f(arm.e2e_p50_s, 3):>8} {_f(arm.e2e_p99_s, 3):>8} {_f(arm.acceptance_rate, 3):>7}"
            f" {_f(arm.tokens_per_round, 2):>9}"
        )
    return out


def arm_spt(arm: reader.ArmStats) -> float | None:
    """Seconds per output token over the window: summed e2e latency / output tokens."""
    return (
        arm.e2e_mean_s * arm.requests / arm.output_tokens if arm.e2e_mean_s is not None and arm.output_tokens else None
    )


def _f(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------- driving traffic for a window


class Traffic:
    """Load for a canary window: `concurrency` threads send the prompts, round robin, down the canary path
    (`tensorrt_llm_bls` without num_draft_tokens, so the deployment's control share applies) of an Endpoint:
    Triton gRPC (`client.triton_adapter.TritonEndpoint`) or the OpenAI front (`client.openai_adapter`, model
    `<recipe>-canary`). `start()`, then `stop()` returns (requests sent, requests failed, first error)."""

    def __init__(self, endpoint, prompts: list[str], max_tokens: int, concurrency: int = 1, timeout_s: float = 120.0):
        import threading

        if not prompts:
            raise ValueError("Traffic needs at least one prompt")
        self.endpoint, self.prompts, self.max_tokens, self.timeout_s = endpoint, list(prompts), max_tokens, timeout_s
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.sent, self.failed, self.error, self.next = 0, 0, None, 0
        self.threads = [
            threading.Thread(target=self._work, name=f"canary-traffic-{i}", daemon=True) for i in range(concurrency)
        ]

    def _work(self) -> None:
        from specdeploy.client.protocol import SPECULATIVE_MODEL, GenerateRequest
        from specdeploy.core.errors import ClientError

        while not self.stopping.is_set():
            with self.lock:
                prompt = self.prompts[self.next % len(self.prompts)]
                self.next += 1
            try:
                self.endpoint.generate(SPECULATIVE_MODEL, GenerateRequest(prompt, self.max_tokens), self.timeout_s)
                with self.lock:
                    self.sent += 1
            except ClientError as exc:
                with self.lock:
                    self.sent += 1
                    self.failed += 1
                    self.error = self.error or exc.message
                self.stopping.wait(1.0)  # a failing deployment is not hammered

    def start(self) -> "Traffic":
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> tuple[int, int, str | None]:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=self.timeout_s)
        return self.sent, self.failed, self.error


DRIVES = ("triton", "openai")


def traffic_for(
    recipe, layout, drive: str, grpc_url: str | None = None, openai_url: str | None = None, concurrency: int = 1
) -> Traffic:
    """`canary --drive triton|openai`: the recipe's validation prompts (rendered as validate renders them) sent down
    the canary path over Triton gRPC (`grpc_url`, default the detached server) or the OpenAI front (`openai_url`)."""
    from specdeploy.client import hf_codec
    from specdeploy.client import options as client_options
    from specdeploy.client import validate as val
    from specdeploy.core.errors import ConfigError
    from specdeploy.deploy.recipe_deployment import server_url, tokenizer_dir

    if drive not in DRIVES:
        raise ConfigError(
            f"--drive {drive!r} is not one of {', '.join(DRIVES)}", "use --drive triton or --drive openai"
        )
    options = client_options.Options.from_recipe(recipe)
    prompts, _, _ = val.prepare_prompts(options, hf_codec.HFCodec(tokenizer_dir(recipe, layout)))
    if drive == "openai":
        from specdeploy.client.openai_adapter import OpenAIEndpoint

        if not openai_url:
            raise ConfigError(
                "--drive openai needs the front's address",
                "pass --openai-url http://127.0.0.1:PORT (specdeploy serve RECIPE --openai-port PORT)",
            )
        endpoint = OpenAIEndpoint(openai_url, recipe.name)
    else:
        from specdeploy.client.triton_adapter import TritonEndpoint

        endpoint = TritonEndpoint(grpc_url or server_url(layout))
    return Traffic(endpoint, [p.text for p in prompts], options.max_tokens, concurrency, options.request_timeout_s)
