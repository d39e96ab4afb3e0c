"""Soak: a steady mixed load on a served repository and its OpenAI front; nothing may fail, leak or miscount.

    .venv/bin/python bench/soak.py --recipe build/smollm2-135m.yaml [--root .] [--duration 600] [--concurrency 32]
                                   [--max-requests N] [--seed 0] [--out soak.json]

It serves the built repository (`specdeploy repo RECIPE` first) on free loopback ports, starts the OpenAI front
the way `specdeploy serve --detach --openai-port` does (its own process, `python -m specdeploy.ops.openai.api`), and
sends `--concurrency` requests at a time until `--duration` seconds have passed or `--max-requests` were sent,
whichever comes first. Each request picks one of four entry points: the speculative one (`tensorrt_llm_bls`)
and the control (`ensemble`) over Triton gRPC, and the front's `<recipe>` (speculative) and `<recipe>-control`
models over HTTP; a prompt of a few to a few hundred tokens; 1 to 64 new tokens; greedy or sampled.

It reports: requests and errors (any error fails the run), p50/p99 latency per half of the run and the slope
of p99 over it, the python stubs' RSS (children of tritonserver, read from /proc) over time and its slope in
the last half, in all and per process (each stub instance and the OpenAI front: which one grows), /dev/shm (the server's
own regions) and /tmp growth, and whether every counter of the metrics port equals what the client counted (specdeploy's
`specdeploy_*` counters of the speculative entry point, Triton's `nv_inference_request_*` of both entry points). After
stopping the server it checks that none of its shared-memory regions is left. Exit status 1 on an error, a counter
mismatch or a leftover region.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shutil
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PATHS = ("triton_speculative", "triton_control", "openai_speculative", "openai_control")
WORDS = (
    "the river",
    "a quiet harbour",
    "seven lanterns",
    "under the bridge",
    "morning trains",
    "copper kettles",
    "old maps",
)
MAX_NEW_TOKENS = (1, 4, 8, 16, 32, 64)
PROMPT_TOKENS = (4, 24, 96, 240)  # prompt lengths in the server's tokens (capped by the engine's limits)


def prompt_pool(codec, rng: random.Random, max_prompt_tokens: int, per_length: int = 8) -> list[str]:
    """Prompts of about each PROMPT_TOKENS length (never above `max_prompt_tokens`, counted as preprocessing counts)."""
    pool = []
    for target in sorted({min(n, max_prompt_tokens) for n in PROMPT_TOKENS}):
        for _ in range(per_length):
            words = [rng.choice(WORDS)]
            while True:
                longer = words + [rng.choice(WORDS)]
                if codec.count_prompt(" ".join(longer)) > target:
                    break
                words = longer
            pool.append(" ".join(words))
    return pool


@dataclass
class Counts:
    """What the client saw, per Triton model (the speculative counts also per round)."""

    ok: Counter = field(default_factory=Counter)  # triton model -> finished requests
    errors: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0  # speculative entry point only (the control exports no specdeploy_* series)
    output_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: list = field(default_factory=list)  # every round's k (0: a plain step), speculative entry point
    output_unknown: int = 0  # speculative answers without an exact token count


@dataclass
class Sample:
    start_s: float
    latency_s: float
    path: str
    ok: bool
    error: str = ""


# ---------------------------------------------------------------- one request per entry point


class Client:
    def __init__(self, grpc_url: str, openai_url: str, recipe, codec, timeout_s: float):
        from specdeploy.client.triton_adapter import TritonEndpoint

        self.endpoint = TritonEndpoint(grpc_url)
        self.address = openai_url.split("://", 1)[-1].split("/", 1)[0]
        self.name, self.recipe, self.codec, self.timeout_s = recipe.name, recipe, codec, timeout_s
        self.counts = Counts()
        self.lock = threading.Lock()

    def send(self, path: str, prompt: str, max_tokens: int, sampled: bool, k: int, seed: int) -> None:
        """One request; raises with the error's text when it fails."""
        from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL, GenerateRequest
        from specdeploy.speculation.sampling import SamplingParams

        model = SPECULATIVE_MODEL if path.endswith("speculative") else CONTROL_MODEL
        try:
            if path.startswith("triton"):
                sampling = SamplingParams(0.8, 0, 0.9, seed=seed) if sampled else None
                request = GenerateRequest(prompt, max_tokens, k if model == SPECULATIVE_MODEL else None, sampling)
                result = self.endpoint.generate(model, request, self.timeout_s)
                ids = result.token_ids
                drafted, accepted = result.perf.total_draft_tokens, result.perf.total_accepted_draft_tokens
                rounds, prompt_tokens = (
                    result.k_history,
                    self.codec.count_prompt(prompt) if model == SPECULATIVE_MODEL else 0,
                )
                output_tokens = None if ids is None else len(ids)
            else:
                body = {
                    "model": self.name if model == SPECULATIVE_MODEL else f"{self.name}-control",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0.8 if sampled else 0,
                    "seed": seed,
                }
                data = self._post(body)
                ext = data.get("specdeploy") or {}
                drafted, accepted, rounds = (
                    ext.get("draft_tokens"),
                    ext.get("accepted_draft_tokens"),
                    ext.get("k_history"),
                )
                prompt_tokens = data["usage"]["prompt_tokens"]
                output_tokens = data["usage"]["completion_tokens"] if ext.get("completion_tokens_exact") else None
        except Exception:
            with self.lock:
                self.counts.errors[model] += 1
            raise
        with self.lock:
            c = self.counts
            c.ok[model] += 1
            if model == SPECULATIVE_MODEL:
                c.prompt_tokens += prompt_tokens
                c.drafted += drafted or 0
                c.accepted += accepted or 0
                c.rounds.extend(rounds or [])
                if output_tokens is None:
                    c.output_unknown += 1
                else:
                    c.output_tokens += output_tokens

    def _post(self, body: dict) -> dict:
        conn = http.client.HTTPConnection(self.address, timeout=self.timeout_s)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = json.loads(response.read() or b"{}")
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {json.dumps(data)[:300]}")
        return data


# ---------------------------------------------------------------- what the machine shows


def stub_rss(server_pid: int) -> dict[str, tuple[int, int]]:
    """instance name (`tensorrt_llm_0_0`) -> (pid, resident bytes) of every python stub under the server (VmRSS)."""
    from specdeploy.triton.stubs import python_stubs

    return {name: (pid, _vm_rss(pid)) for name, pid in python_stubs(server_pid).items()}


def _vm_rss(pid: int) -> int:
    """VmRSS in bytes; 0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def region_bytes(prefixes) -> int:
    """What tmpfs holds for the server's shared-memory regions (pages touched)."""
    from specdeploy.triton import shm

    return shm.tmpfs_bytes([p for prefix in prefixes for p in shm.SHM_DIR.glob(prefix + "*")])


def used_bytes(path: str) -> int:
    usage = shutil.disk_usage(path)
    return usage.total - usage.free


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points; None with fewer than 2 distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Watcher(threading.Thread):
    """Samples stub RSS (and the OpenAI front's, `front_pid`), the server's /dev/shm regions and /tmp every `every_s`
    until stopped."""

    def __init__(self, server_pid: int, prefixes, every_s: float, t0: float, front_pid: int | None = None):
        super().__init__(name="soak-watcher", daemon=True)
        self.server_pid, self.prefixes, self.every_s, self.t0, self.front_pid = (
            server_pid,
            prefixes,
            every_s,
            t0,
            front_pid,
        )
        self.samples: list[dict] = []
        self.done = threading.Event()

    def sample(self) -> None:
        stubs = stub_rss(self.server_pid)
        self.samples.append(
            {
                "t_s": round(time.monotonic() - self.t0, 2),
                "stubs": len(stubs),
                "stub_rss_bytes": sum(rss for _, rss in stubs.values()),
                "stub_rss_by_instance": {name: rss for name, (_, rss) in stubs.items()},
                "stub_pids": {name: pid for name, (pid, _) in stubs.items()},
                "front_rss_bytes": None if self.front_pid is None else _vm_rss(self.front_pid),
                "shm_region_bytes": region_bytes(self.prefixes),
                "dev_shm_used_bytes": used_bytes("/dev/shm"),
                "tmp_used_bytes": used_bytes("/tmp"),
            }
        )

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            self.sample()


# ---------------------------------------------------------------- the run


def run_soak(
    grpc_url: str,
    openai_url: str,
    metrics_url: str,
    server_pid: int,
    recipe,
    codec,
    duration_s: float = 600.0,
    concurrency: int = 32,
    max_requests: int | None = None,
    seed: int = 0,
    timeout_s: float = 1800.0,
    sample_s: float = 10.0,
    prefixes=(),
    max_new_tokens=MAX_NEW_TOKENS,
    front_pid: int | None = None,
    echo=print,
) -> dict:
    """Send the mixed load; return the report (see the module docstring). The server must be this run's only client.
    `front_pid`: the OpenAI front's process, whose RSS is sampled with the stubs'."""
    from specdeploy.client import metrics_check
    from specdeploy.core.metrics import names, reader

    client = Client(grpc_url, openai_url, recipe, codec, timeout_s)
    max_new = [n for n in max_new_tokens if n < recipe.engine.max_seq_len // 2] or [1]
    prompts = prompt_pool(
        codec, random.Random(seed), min(recipe.engine.max_input_len, recipe.engine.max_seq_len - max(max_new)) - 1
    )
    before = reader.scrape(metrics_url)
    t0 = time.monotonic()
    deadline = t0 + duration_s
    watcher = Watcher(server_pid, prefixes, sample_s, t0, front_pid)
    watcher.sample()
    watcher.start()
    samples: list[Sample] = []
    tickets = iter(range(max_requests if max_requests is not None else 1 << 62))
    take = threading.Lock()

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while True:
            with take:
                ticket = next(tickets, None)
            if ticket is None or time.monotonic() >= deadline:
                return
            path = PATHS[ticket % len(PATHS)]
            prompt, new, sampled = rng.choice(prompts), rng.choice(max_new), rng.random() < 0.3
            k = rng.randint(1, recipe.speculative.max_draft_len)
            start = time.monotonic()
            try:
                client.send(path, prompt, new, sampled, k, rng.randrange(1 << 31))
                samples.append(Sample(start - t0, time.monotonic() - start, path, True))
            except Exception as exc:  # noqa: BLE001 - every failure is counted and reported with its text
                text = getattr(exc, "message", None) or str(exc)
                samples.append(Sample(start - t0, time.monotonic() - start, path, False, text[:300]))
                echo(f"  ! {path}: {text[:200]}")

    threads = [threading.Thread(target=worker, args=(i,), name=f"soak-{i}") for i in range(concurrency)]
    for t in threads:
        t.start()
    progress_at = t0
    for t in threads:
        while t.is_alive():
            t.join(1.0)
            if time.monotonic() - progress_at >= max(sample_s, 30.0):
                progress_at = time.monotonic()
                echo(f"  {progress_at - t0:.0f} s: {len(samples)} requests, {sum(not s.ok for s in samples)} errors")
    elapsed = time.monotonic() - t0
    watcher.done.set()
    watcher.join()
    watcher.sample()
    after = metrics_check.settled(
        metrics_url, before, (names.REQUESTS.name, metrics_check.TRITON_SUCCESS), metrics_check.SETTLE_S
    )
    report = summarize(samples, watcher.samples, elapsed)
    report["counters"] = compare_counters(after.minus(before), client.counts)
    report.update(
        duration_s=duration_s, concurrency=concurrency, max_requests=max_requests, seed=seed, recipe=recipe.name
    )
    return report


def summarize(samples: list[Sample], watch: list[dict], elapsed_s: float) -> dict:
    half = elapsed_s / 2
    ok = [s for s in samples if s.ok]
    halves = {}
    for name, part in (
        ("first_half", [s for s in ok if s.start_s < half]),
        ("second_half", [s for s in ok if s.start_s >= half]),
    ):
        halves[name] = {
            "requests": len(part),
            "p50_s": quantile([s.latency_s for s in part], 0.5),
            "p99_s": quantile([s.latency_s for s in part], 0.99),
        }
    windows = 10  # p99 of each tenth of the run, then its least-squares slope
    p99s = []
    for w in range(windows):
        lat = [s.latency_s for s in ok if w * elapsed_s / windows <= s.start_s < (w + 1) * elapsed_s / windows]
        if lat:
            p99s.append(((w + 0.5) * elapsed_s / windows, quantile(lat, 0.99)))
    last_half = [(x["t_s"], x["stub_rss_bytes"]) for x in watch if x["t_s"] >= half]
    rss_slope = slope(last_half)
    first, last = watch[0], watch[-1]
    return {
        "seconds": round(elapsed_s, 1),
        "requests": len(samples),
        "errors": sum(not s.ok for s in samples),
        "error_samples": [{"path": s.path, "error": s.error} for s in samples if not s.ok][:20],
        "by_path": dict(Counter(s.path for s in samples)),
        "latency": halves,
        "latency_by_path": {
            path: {"requests": len(lat), "p50_s": quantile(lat, 0.5), "p99_s": quantile(lat, 0.99)}
            for path in PATHS
            if (lat := [s.latency_s for s in ok if s.path == path])
        },
        "p99_by_window": [{"t_s": round(t, 1), "p99_s": p} for t, p in p99s],
        "p99_slope_s_per_min": None if slope(p99s) is None else slope(p99s) * 60,
        "stubs": last["stubs"],
        "stub_rss_bytes": {
            "start": first["stub_rss_bytes"],
            "end": last["stub_rss_bytes"],
            "max": max(x["stub_rss_bytes"] for x in watch),
        },
        "stub_rss_slope_last_half_bytes_per_min": None if rss_slope is None else rss_slope * 60,
        "stub_restarts": stub_restarts(watch),
        "rss_by_process": rss_by_process(watch, half),
        "shm_region_growth_bytes": last["shm_region_bytes"] - first["shm_region_bytes"],
        "dev_shm_growth_bytes": last["dev_shm_used_bytes"] - first["dev_shm_used_bytes"],
        "tmp_growth_bytes": last["tmp_used_bytes"] - first["tmp_used_bytes"],
        "rss_samples": [{k: v for k, v in x.items() if k not in ("stub_rss_by_instance", "stub_pids")} for x in watch],
    }


def stub_restarts(watch: list[dict]) -> list[str]:
    """The stub instances whose process changed or went away during the run (tritonserver 2.51 restarts none)."""
    last = watch[-1]["stub_pids"]
    seen: dict[str, set[int]] = {}
    for x in watch:
        for name, pid in x["stub_pids"].items():
            seen.setdefault(name, set()).add(pid)
    return sorted(name for name, pids in seen.items() if len(pids) > 1 or name not in last)


def rss_by_process(watch: list[dict], half: float) -> dict:
    """Each stub instance's RSS (and the OpenAI front's, `openai_front`) at the start, the end and its peak, and its
    least-squares slope over the last half in bytes per minute (None with fewer than two samples there): which
    process a growth of the total is in."""
    series: dict[str, list[tuple[float, int]]] = {}
    for x in watch:
        for name, rss in x["stub_rss_by_instance"].items():
            series.setdefault(name, []).append((x["t_s"], rss))
        if x.get("front_rss_bytes"):
            series.setdefault("openai_front", []).append((x["t_s"], x["front_rss_bytes"]))
    out = {}
    for name, points in sorted(series.items()):
        late = slope([(t, rss) for t, rss in points if t >= half])
        out[name] = {
            "start": points[0][1],
            "end": points[-1][1],
            "max": max(rss for _, rss in points),
            "slope_last_half_bytes_per_min": None if late is None else late * 60,
        }
    return out


def compare_counters(window, counts: Counts) -> dict:
    """Every counter of the metrics port against the client's count over the run: rows and the mismatches."""
    from specdeploy.client.protocol import CONTROL_MODEL, SPECULATIVE_MODEL
    from specdeploy.core.metrics import names

    spec = {"model": SPECULATIVE_MODEL, "arm": names.SPECULATIVE_ARM}
    rounds = counts.rounds
    expected = [
        (names.REQUESTS.name, spec, counts.ok[SPECULATIVE_MODEL]),
        (names.REQUEST_ERRORS.name, {"model": SPECULATIVE_MODEL}, counts.errors[SPECULATIVE_MODEL]),
        (
            names.REQUESTS.name,
            {"model": SPECULATIVE_MODEL, "arm": names.CONTROL_ARM},
            0,
        ),  # no canary share: every request stays speculative
        (names.E2E.name + "_count", spec, counts.ok[SPECULATIVE_MODEL]),
        (names.PROMPT_TOKENS.name, spec, counts.prompt_tokens),
        (names.DRAFT_TOKENS.name, spec, counts.drafted),
        (names.ACCEPTED_TOKENS.name, spec, counts.accepted),
        (names.DRAFTS.name, spec, sum(1 for k in rounds if k > 0)),
        (names.TARGET_PASSES.name, spec, len(rounds)),
        (names.ROUNDS.name, {**spec, "speculation": names.SPEC_ON}, sum(1 for k in rounds if k > 0)),
        (names.ROUNDS.name, {**spec, "speculation": names.SPEC_OFF}, sum(1 for k in rounds if k == 0)),
        (names.RUNNING.name, {"model": SPECULATIVE_MODEL}, 0),  # a gauge: nothing in flight at the end
        ("nv_inference_request_success", {"model": SPECULATIVE_MODEL}, counts.ok[SPECULATIVE_MODEL]),
        ("nv_inference_request_success", {"model": CONTROL_MODEL}, counts.ok[CONTROL_MODEL]),
        ("nv_inference_request_failure", {"model": SPECULATIVE_MODEL}, counts.errors[SPECULATIVE_MODEL]),
        ("nv_inference_request_failure", {"model": CONTROL_MODEL}, counts.errors[CONTROL_MODEL]),
    ]
    notes = [
        "time counters (draft/target seconds) and histogram buckets have no client-side count; not compared",
        (
            "draft tokens per position: a round's k (speculative_k_history) is what the policy chose, the draft may"
            " propose fewer near max_tokens; not compared (their sum, draft tokens, is)"
        ),
    ]
    client_failed = sum(counts.errors.values())
    if client_failed:
        notes.append(
            f"{client_failed} requests failed on the client side (a client deadline, say): the server may have finished"
            " them, so the request and token counters can differ by what those requests did"
        )
    if counts.output_unknown:
        notes.append(
            f"{counts.output_unknown} answers had no exact token count (the speculative entry point returns text, not"
            f" ids, as NVIDIA's BLS does): {names.GENERATION_TOKENS.name} not compared"
        )
    else:
        expected.append((names.GENERATION_TOKENS.name, spec, counts.output_tokens))
    rows = []
    for name, labels, want in expected:
        got = window.sum(name, **labels)
        rows.append(
            {
                "metric": name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}",
                "metrics": got,
                "client": want,
                "agree": abs(got - want) < 1e-6,
            }
        )
    return {"rows": rows, "mismatches": [r for r in rows if not r["agree"]], "notes": notes}


# ---------------------------------------------------------------- serving for the run


def serve_and_soak(recipe_path: str, root: str | None = None, echo=print, **kwargs) -> dict:
    """Serve the built repository of `recipe_path` and its OpenAI front (as `serve --detach --openai-port` does) on free
    loopback ports, soak them, stop both; then check that no shared-memory region of the server is left."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy.recipe_deployment import tokenizer_dir
    from specdeploy.ops.openai import api as openai_api
    from specdeploy.ops.openai import requests
    from specdeploy.recipe.load import load_recipe
    from specdeploy.triton import ports, server, shm

    recipe = load_recipe(recipe_path)
    layout = Layout.of(recipe, root)
    if not (layout.repo / "ensemble" / "config.pbtxt").is_file():
        raise SystemExit(f"no model repository at {layout.repo}: run `specdeploy repo {recipe_path}` first")
    state_dir = Path(layout.server_state) / "soak"
    srv = server.start(layout.repo, ports.Ports.pick(), state_dir / "tritonserver.log")
    prefixes = shm.prefixes_in(srv.process.args)
    try:
        server.wait_ready(srv, recipe.triton.startup_timeout_s)
        port = ports.free_port()
        # the front's deadline per Triton call: the soak's, not the recipe's validation.request_timeout_s
        front_pid = openai_api.start_detached(
            recipe_path, root, srv.state.grpc_url, port, state_dir, echo=echo, request_timeout_s=kwargs.get("timeout_s")
        )
        try:
            codec = requests.Codec(tokenizer_dir(recipe, layout))
            report = run_soak(
                srv.state.grpc_url,
                f"http://127.0.0.1:{port}",
                srv.state.metrics_url,
                srv.process.pid,
                recipe,
                codec,
                prefixes=prefixes,
                front_pid=front_pid,
                echo=echo,
                **kwargs,
            )
            report["server_live_at_end"] = server.is_ready(srv.state.http_port)
        finally:
            openai_api.stop_detached(state_dir)
    finally:
        srv.stop()
    report["shm_regions_left"] = sorted(p.name for prefix in prefixes for p in shm.SHM_DIR.glob(prefix + "*"))
    return report


def failed(report: dict) -> list[str]:
    out = []
    if report["errors"]:
        out.append(f"{report['errors']} requests failed")
    if report["counters"]["mismatches"]:
        out.append(f"{len(report['counters']['mismatches'])} counters differ from the client's counts")
    if report.get("shm_regions_left"):
        out.append(f"{len(report['shm_regions_left'])} shared-memory regions left after the stop")
    if report.get("server_live_at_end") is False:
        out.append("the server was not ready at the end")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--root", default=None)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--max-requests", type=int, default=None, help="stop after this many requests (default: only the duration)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS / shm / tmp samples")
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="per-request deadline, s (also the front's deadline per Triton call)",
    )
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    report = serve_and_soak(
        args.recipe,
        args.root,
        duration_s=args.duration,
        concurrency=args.concurrency,
        max_requests=args.max_requests,
        seed=args.seed,
        sample_s=args.sample_every,
        timeout_s=args.timeout,
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    brief = {k: v for k, v in report.items() if k not in ("rss_samples", "p99_by_window", "counters")}
    brief["counters_agree"] = f"{sum(r['agree'] for r in report['counters']['rows'])}/{len(report['counters']['rows'])}"
    print(json.dumps(brief, indent=1))
    for row in report["counters"]["mismatches"]:
        print(f"  counter {row['metric']}: metrics {row['metrics']:g}, client {row['client']:g}")
    problems = failed(report)
    for line in problems:
        print(f"FAIL: {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
