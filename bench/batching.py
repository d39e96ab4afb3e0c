"""In-flight batching on the served paths: before and after, side by side in one run.

    .venv/bin/python bench/batching.py [--recipe build/smollm2-135m.yaml] [--root .] [--levels 1,2,4,8]
        [--models ensemble,tensorrt_llm_bls] [--variants before,after] [--in-process] [--raw] [--out batching.json]

Serves the recipe's built engines (`specdeploy build RECIPE` first; they are only read) from two
servers started side by side, with repositories generated under a scratch folder:
  before  the recipe as it is (`triton.inflight_batching` false: one request at a time per instance)
  after   `triton.inflight_batching: true`, one instance (concurrent requests share engine steps)
and at each concurrency level sends the same greedy requests to each of `--models` (`ensemble`: the control
path; `tensorrt_llm_bls`: the speculative path, with the recipe's draft and policy) from that many client
threads, `--repeats` times, every level and server once per repeat in turns, every other repeat in reverse order (on a
shared machine the speed drifts over minutes: the median run of each is shown, and each repeat's ratio to its own first
level). The prompts go in the tokenizer's chat template (`--raw`: as plain text).
`--in-process` also runs the same requests on the target engine in this process, through the BatchScheduler the
served model uses (the recipe's `engine.max_batch_size`), at every level in turns with the servers (idle
meanwhile): the served figures over those are what serving adds (at the first level, and at the others, where the
server's other processes share the cores with the engine's step). Prints one table (output tokens/s,
end-to-end p50/p90/p99 latency, the median request's latency per output token, the machine's
load average, and the peak RSS of the `tensorrt_llm` stub so far: what concurrency adds to the target's memory)
and writes it as JSON. Output tokens are counted by tokenizing each returned text with the model's
tokenizer (the same texts in every row, so the ratios are exact). Also checks that every prompt got the
same text on both paths, in both servers and at every concurrency (greedy parity and batch invariance, end to end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# --in-process waits for OpenMP work as the served stubs do (triton/server.py); read when torch loads OpenMP
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a refrigerator keeps food cold.",
    "List five tips for learning a new programming language.",
    "What are the main causes of the seasons on Earth?",
    "Describe the water cycle in simple terms.",
    "Give me a recipe for a quick vegetable soup.",
    "Why is the sky blue? Answer in a paragraph.",
    "Summarize the plot of a detective novel you invent.",
]


def _infer(url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, float]:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        inputs = []
        for name, arr in (
            ("text_input", np.array([[prompt.encode()]], dtype=object)),
            ("max_tokens", np.array([[max_tokens]], dtype=np.int32)),
            ("exclude_input_in_output", np.array([[True]])),
        ):  # text_output: the answer alone
            kind = {np.dtype(object): "BYTES", np.dtype(np.int32): "INT32", np.dtype(bool): "BOOL"}[arr.dtype]
            tensor = grpcclient.InferInput(name, list(arr.shape), kind)
            tensor.set_data_from_numpy(arr)
            inputs.append(tensor)
        t0 = time.perf_counter()
        result = client.infer(model, inputs, client_timeout=600)
        latency = time.perf_counter() - t0
        return result.as_numpy("text_output").reshape(-1)[0].decode("utf-8"), latency
    finally:
        client.close()


def _level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, count) -> dict:
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: _infer(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    latencies = sorted(lat for _, lat in results)
    counts = [count(text) for text, _ in results]
    tokens = sum(counts)
    per_token = sorted(1000 * lat / n for (_, lat), n in zip(results, counts) if n)
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "out_tok_s": round(tokens / wall, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p90_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.9 * len(latencies)))], 1),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 1),
        "ms_per_token": (
            round(statistics.median(per_token), 2) if per_token else None
        ),  # a request's latency / its tokens
        "load1": round((load_before + os.getloadavg()[0]) / 2, 2),
        "texts": [text for text, _ in results],
    }


def _target_peak_rss_mb(server_pid: int) -> float | None:
    """Peak resident memory (VmHWM) of the server's `tensorrt_llm` stub, the process holding the target's weights
    and KV cache; None where /proc does not show it."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or f"PPid:\t{server_pid}\n" not in (status := (proc / "status").read_text()):
                continue
            if "tensorrt_llm_0_0" in (proc / "cmdline").read_bytes().decode(errors="replace").split("\0"):
                return int(status.split("VmHWM:")[1].split()[0]) / 1024
        except (OSError, IndexError, ValueError):
            continue
    return None


def _start_server(recipe, engines_dir: Path, work: Path, label: str):
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy import backend_stages
    from specdeploy.triton import ports, server

    root = work / label
    (root / "engines").mkdir(parents=True, exist_ok=True)
    link = root / "engines" / recipe.name
    if not link.exists():
        link.symlink_to(engines_dir, target_is_directory=True)
    repo, _ = backend_stages.of(recipe).write_repository(recipe, Layout.of(recipe, root), force=True)
    srv = server.start(repo, ports.Ports.pick(), root / "tritonserver.log", exit_timeout_s=5)
    try:
        server.wait_ready(srv, recipe.triton.startup_timeout_s)
    except BaseException:
        srv.stop()
        raise
    return srv


class _InProcess:
    """The same greedy requests on the same target engine in this process, run as the served `tensorrt_llm` model
    runs them: an Executor loaded and stepped in a BatchScheduler's own thread (one standing team per step), at
    `max_batch_size`, from as many client threads as a level. `level(c)`: output tokens/s and the median over
    requests of its time / its tokens, measured as the served columns (prefill included, tokens counted on the
    decoded text). What serving adds is the served figures over these; main() runs each level here in turn with
    the servers' (idle meanwhile), so that the machine's drift does not enter the ratio."""

    def __init__(self, engine_dir: Path, tokenizer, prompts: list[str], max_tokens: int, max_batch_size: int, count):
        from specdeploy.engine.batching import BatchScheduler
        from specdeploy.engine.executor import Executor
        from specdeploy.engine.model import CpuEngine

        self.tokenizer, self.max_tokens, self.count = tokenizer, max_tokens, count
        self.ids = [tokenizer(prompt, add_special_tokens=False)["input_ids"] for prompt in prompts]
        self.scheduler = BatchScheduler.loading(
            lambda: Executor(CpuEngine.load(engine_dir)), max_batch_size=max_batch_size
        )
        self._one(0)  # warm-up

    def _one(self, i: int) -> tuple[list[int], float]:
        from specdeploy.engine.request import EngineRequest

        t0 = time.perf_counter()
        request = EngineRequest(
            input_ids=self.ids[i], max_new_tokens=self.max_tokens, end_id=self.tokenizer.eos_token_id
        )
        out = [t for chunk in self.scheduler.generate(request) for t in chunk.token_ids]
        return out, time.perf_counter() - t0

    def level(self, concurrency: int) -> dict:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            runs = list(pool.map(self._one, range(len(self.ids))))
        wall = time.perf_counter() - t0
        # counted afterwards: the clients' tokenizer calls would hold the GIL the scheduler's thread needs
        results = [(self.count(self.tokenizer.decode(out, skip_special_tokens=True)), t) for out, t in runs]
        return {
            "out_tok_s": round(sum(n for n, _ in results) / wall, 2),
            "ms_per_token": round(statistics.median(1000 * t / n for n, t in results if n), 2),
        }

    def close(self) -> None:
        self.scheduler.close()


def _median_row(runs: list[dict]) -> dict:
    """The run with the median throughput of repeated runs (its latencies with it), all texts kept."""
    runs = sorted(runs, key=lambda r: r["out_tok_s"])
    row = dict(runs[len(runs) // 2])
    row["out_tok_s_runs"] = [r["out_tok_s"] for r in runs]
    row["all_texts"] = [r["texts"] for r in runs]
    return row


def main(argv=None) -> int:
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import load_recipe

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument(
        "--root", default=os.environ.get("SPECDEPLOY_ROOT") or str(ROOT), help="project root holding engines/<name>"
    )
    ap.add_argument("--levels", default="1,2,4", help="client concurrency levels")
    ap.add_argument(
        "--models", default="ensemble", help="paths to measure: ensemble (control), tensorrt_llm_bls (speculative)"
    )
    ap.add_argument("--variants", default="before,after", help="before (in-flight batching off), after (on), or both")
    ap.add_argument("--requests", type=int, default=8, help="requests per level (the prompts, cycled)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs per level and variant, interleaved (the median is shown)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help=(
            "OMP_NUM_THREADS for both servers (0: inherit). On a loaded machine a 2-thread OpenMP team in the "
            "python stub's main thread (where the one-request-at-a-time path runs the engine) can stall on its "
            "barriers; 1 compares the two paths on equal terms"
        ),
    )
    ap.add_argument(
        "--raw",
        action="store_true",
        help="send the prompts as raw text (default: in the tokenizer's chat template, as an instruct model expects)",
    )
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="also run the requests one at a time on the target engine in this process (the served overhead)",
    )
    ap.add_argument("--out", default="batching.json")
    args = ap.parse_args(argv)

    recipe = load_recipe(args.recipe)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit the environment
    engines_dir = Layout.of(recipe, args.root).engines
    if not (engines_dir / "target").is_dir():
        print(
            f"no engines at {engines_dir}: run `specdeploy build {args.recipe}` first (or pass --root)", file=sys.stderr
        )
        return 2
    from transformers import AutoTokenizer

    from specdeploy.core import model_store as models

    tokenizer = AutoTokenizer.from_pretrained(str(models.resolve(recipe.target.model)))
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    levels = [int(x) for x in args.levels.split(",")]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    if not args.raw and tokenizer.chat_template:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    models = args.models.split(",")
    every = {
        "before": recipe,
        "after": dataclasses.replace(
            recipe, triton=dataclasses.replace(recipe.triton, inflight_batching=True, instance_count=1)
        ),
    }
    variants = {label: every[label] for label in args.variants.split(",")}
    served_label = list(variants)[-1]  # the variant run last at each level: the one the in-process run follows
    print(
        f"{', '.join(models)}: {args.requests} requests x {args.max_tokens} max tokens per level, greedy; before:"
        f" instance_count {recipe.triton.instance_count}, one request at a time each; after: in-flight batching, 1"
        " instance"
    )
    rows = []
    in_process, local, paired = None, {c: [] for c in levels}, {c: [] for c in levels}
    with tempfile.TemporaryDirectory(prefix="specdeploy-batching-") as work:
        servers = {}
        try:  # the servers up at once (idle, one waits while the other is measured), runs interleaved
            for label, variant in variants.items():
                servers[label] = _start_server(variant, engines_dir, Path(work), label)
                for model in models:
                    for p in prompts[:2]:  # warm-up
                        _infer(servers[label].state.grpc_url, model, p, 8)
            if args.in_process:
                in_process = _InProcess(
                    engines_dir / "target", tokenizer, prompts, args.max_tokens, recipe.engine.max_batch_size, count
                )
            for model in models:
                # every level once per repeat, in turns: the machine's speed drifts over minutes (on a shared VM by
                # 1.5x), and the ratios between levels are what is measured
                runs = {(label, c): [] for label in variants for c in levels}
                for rep in range(args.repeats):
                    # odd repeats run the levels in reverse (ABBA): a drift over the repeats falls on every level alike
                    for c in levels if rep % 2 == 0 else levels[::-1]:
                        for label, srv in servers.items():
                            run = _level(srv.state.grpc_url, model, prompts, c, args.max_tokens, count)
                            run["target_peak_rss_mb"] = _target_peak_rss_mb(srv.state.pid)
                            print(
                                f"  {model} {label:6s} c={c}: {run['out_tok_s']:7.1f} out tok/s  p50"
                                f" {run['p50_ms']:7.0f} ms  load {run['load1']}",
                                flush=True,
                            )
                            runs[label, c].append(run)
                        if in_process is not None and model == models[0]:
                            local[c].append(in_process.level(c))
                            paired[c].append(
                                round(runs[served_label, c][-1]["ms_per_token"] / local[c][-1]["ms_per_token"], 3)
                            )
                for (label, c), level_runs in runs.items():
                    row = _median_row(level_runs)
                    # each repeat's level over its own first level (measured minutes apart at most)
                    row["vs_first_runs"] = [
                        round(r["out_tok_s"] / first["out_tok_s"], 2)
                        for r, first in zip(level_runs, runs[label, levels[0]])
                    ]
                    rows.append({"model": model, "variant": label, **row})
        finally:
            for srv in servers.values():
                srv.stop()
            if in_process is not None:
                in_process.close()
    rows.sort(key=lambda r: (models.index(r["model"]), list(variants).index(r["variant"]), r["concurrency"]))
    reference = rows[0]["texts"]
    identical = all(texts == reference for r in rows for texts in r["all_texts"])
    row_at = {(r["model"], r["variant"], r["concurrency"]): r for r in rows}
    print()
    print(
        f"{'model':17s} {'variant':8s} {'conc':>4s} {'out tok/s':>10s} {'vs c=1':>7s} {'p50 ms':>8s} {'p90 ms':>8s}"
        f" {'p99 ms':>8s} {'ms/token':>8s} {'vs c=1':>7s} {'vs before':>10s} {'vs ' + models[0]:>13s} {'load':>5s}"
        f" {'target RSS MB':>13s}"
    )
    for r in rows:
        c1 = row_at[r["model"], r["variant"], levels[0]]
        control = row_at[models[0], r["variant"], r["concurrency"]]
        before = row_at.get((r["model"], "before", r["concurrency"]))
        vs_before = f"{r['out_tok_s'] / before['out_tok_s']:9.2f}x" if before else f"{'-':>10s}"
        print(
            f"{r['model']:17s} {r['variant']:8s} {r['concurrency']:4d} {r['out_tok_s']:10.1f}"
            f" {r['out_tok_s'] / c1['out_tok_s']:6.2f}x {r['p50_ms']:8.0f} {r['p90_ms']:8.0f} {r['p99_ms']:8.0f}"
            f" {r['ms_per_token']:8.2f} {r['ms_per_token'] / c1['ms_per_token']:6.2f}x {vs_before}"
            f" {r['out_tok_s'] / control['out_tok_s']:12.2f}x {r['load1']:5.1f}"
            f" {r['target_peak_rss_mb'] or float('nan'):13.0f}"
        )
    for r in rows:
        if r["concurrency"] != levels[0]:
            print(
                f"{r['model']} {r['variant']} c={r['concurrency']} over c={levels[0]}, output tokens/s, each repeat:"
                f" {', '.join(f'{x:.2f}x' for x in r['vs_first_runs'])} (median"
                f" {statistics.median(r['vs_first_runs']):.2f}x)"
            )
    print(
        "same text for every prompt on every path, in every server, at every concurrency:"
        f" {'yes' if identical else 'NO'}"
    )
    local_rows = {c: sorted(r, key=lambda x: x["out_tok_s"])[len(r) // 2] for c, r in local.items() if r}  # median runs
    if local_rows:
        print(
            "in-process, same engine and requests through the scheduler (max_batch_size"
            f" {recipe.engine.max_batch_size}), in turns with the servers, against served {models[0]} ({served_label}):"
        )
        first = local_rows[levels[0]]
        for c, row in local_rows.items():
            served = row_at[models[0], served_label, c]
            print(
                f"  concurrency {c}: {row['out_tok_s']:7.1f} out tok/s ({row['out_tok_s'] / first['out_tok_s']:.2f}x), "
                f"{row['ms_per_token']:.2f} ms/token ({row['ms_per_token'] / first['ms_per_token']:.2f}x); served "
                f"{served['out_tok_s']:.1f} tok/s, {served['ms_per_token']:.2f} ms/token "
                f"({served['ms_per_token'] / row['ms_per_token']:.2f}x in-process)"
            )
        for c, ratios in paired.items():  # each repeat's served run over the in-process run right after it
            print(
                f"  served over in-process ms/token at concurrency {c}, each repeat: "
                f"{', '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x)"
            )
    print(f"cores: {os.cpu_count()}, load average now: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    out = {
        "recipe": args.recipe,
        "max_tokens": args.max_tokens,
        "identical_outputs": identical,
        "threads": args.threads,
        "chat_template": not args.raw,
        "in_process": {str(c): row for c, row in local_rows.items()} or None,
        "served_over_in_process_runs": {str(c): r for c, r in paired.items() if r} or None,
        "rows": [{k: v for k, v in r.items() if k not in ("texts", "all_texts")} for r in rows],
    }
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
