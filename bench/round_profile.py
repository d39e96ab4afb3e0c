"""Per-op profile of the served round (issue 59, `make bench`): where a fused EAGLE-3 round's time goes, in one-row
steps.

The recipe's target engine and head (`draft.head`), after a context of --context tokens of built-in chat prompts, in
process, on the engine's own code paths:
  step      a plain one-row decode step as served (greedy, screened LM head, no aux capture): the unit of every figure.
  pass m    a verification pass of m = 1..8 rows as the fused loop runs it (aux features captured, greedy LM-head
            screen), split into the decoder's parts, timed inside the native call (csrc Decoder.set_profile: norms,
            the four linears, rope + KV write, attention, swiglu, aux capture), the final norm and LM head
            (CpuEngine._logits, timed around it), the native call's own time outside its ops (`native call`: its
            arguments, the step's team, the clock), and the rest of the pass's Python (`python`: checks, embedding
            lookup, argument lists, the aux features joined).
  lm head   the screen (lm_screen.ScreenedHead.argmax_rows) and the fallback (the whole bf16 head) alone on m rows.
  head      the head's catch-up over n = 1..4 rows (a round accepting n - 1 drafts), one draft step after a catch-up,
            and the head's whole work in a round of --draft-len drafts (Eagle3Drafter.catch_up + draft: Python
            included), as the executor runs them (Eagle3Head.run_passes), split into fc (catch-up only), its LM head
            and the rest of its layer (timed inside the head's one native call, csrc Eagle3Head.set_profile, where it
            runs). Where it runs, the same catch-up of 2 rows, draft step and round also op by op (the path without
            it), in turns with the rest: `head op by op`.
  verify    the greedy verification of a pass of m rows (logits.process_rows + verify.verify_greedy).
A part measured alone runs after an untimed one-row target step, as it follows the target's layers in a round.
  round     the served loop on --prompts chat prompts, k = --draft-len against the target alone: per round the head,
            the pass and the rest (the executor's Python: bookkeeping, lookup, verification), in the control's steps;
            where the head runs in one native call, also with it op by op, in turns.
  batched   the same with --concurrency requests in flight in one BatchScheduler (as served; their passes shared, their
            heads' forwards in one), the prompts in groups that start together: per batched step where all of them
            decode, the heads, the shared pass and the rest, in the control's batched steps at that concurrency.

Every measurement takes turns with the others in each of --repeats rounds (a slow spell of the shared machine falls on
all of them) and is reported as a median. Floors: the bytes a part must read over the read bandwidth measured in the
same run (kernels.memory_probe, taking turns with the rest), or, where it reads next to nothing, its operations.

    .venv/bin/python bench/round_profile.py [--recipe build/smollm2-135m.yaml] [--threads 2] [--repeats 15]

Prints a table and writes bench/results/round_profile-<time>.json. Quote ratios from one run, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the served stubs (bench/kernels.py)

ROWS = tuple(range(1, 9))
CATCH_UP = tuple(range(1, 5))
# the decoder's parts, in the order of csrc Decoder::kProfileParts (the last entry there counts calls)
DECODER_PARTS = ("norms", "qkv", "rope+kv", "attention", "o", "gate_up", "swiglu", "down", "aux capture")
LINEARS = ("qkv", "o", "gate_up", "down")
OP_BY_OP = "ops"  # the prefix of a head measurement's key with the head run op by op


def op_by_op(head, call):
    """`call` with the head run op by op (Eagle3Head._forward_ops), as where its one native call cannot run."""

    def run():
        one_call, head.one_call = head.one_call, None
        try:
            return call()
        finally:
            head.one_call = one_call

    return run


class Timers:
    """Seconds per part of the call being measured; `wrap` puts a timer around an object's method (a hook on the
    engine's own code path, not a copy of it), `unwrap` takes every timer off again."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self.wrapped: list[tuple[object, str, bool, object]] = []

    def wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)
        self.wrapped.append((obj, name, name in vars(obj), inner))

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - t0

        setattr(obj, name, timed)

    def unwrap(self) -> None:
        for obj, name, own, inner in reversed(self.wrapped):
            if own:
                setattr(obj, name, inner)  # an attribute of the object itself (the head's LM head)
            else:
                delattr(obj, name)  # a method: the class's again
        self.wrapped = []


def context_ids(tokenizer, length: int) -> list[int]:
    """`length` tokens of the built-in chat prompts, rendered as served, one after the other."""
    from bench.eagle3_peer import chat_prompts

    ids: list[int] = []
    for _, prompt in chat_prompts(tokenizer, 32, 64):
        ids.extend(prompt)
        if len(ids) >= length:
            break
    return ids[:length]


def lscpu_summary() -> dict:
    flags = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.processor()):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")
    return {"model": model, "flags": [f for f in wanted if f in flags], "cores": os.cpu_count()}


def profile(engine, head, context: list[int], repeats: int, threads: int, draft_len: int) -> dict:
    """The profile of a loaded engine and head after `context`: medians per part, floors, the tables (see the module
    docstring). The engine and head are as before when it returns."""
    import torch

    from bench.kernels import memory_probe
    from specdeploy.engine import logits as lp
    from specdeploy.engine import native
    from specdeploy.engine.eagle3 import HeadPass
    from specdeploy.engine.request import EngineRequest, check_request
    from specdeploy.speculation import verify

    decoder, ops, head_call = engine.decoder, engine.native, head.one_call
    layers = head.aux_layer_ids
    length = len(context)
    floor_bytes = part_bytes(engine, head, length)  # before the timers wrap the head's LM head
    timers = Timers()
    timers.wrap(engine, "_native_batch", "decoder call")
    timers.wrap(engine, "_norm", "final norm")
    timers.wrap(engine, "_logits", "lm head")
    timers.wrap(head, "project", "head fc")
    timers.wrap(head, "lm_head", "head lm head")

    # the context, its greedy continuation (the pass's tokens: the screen sees what it sees when served), the head
    cache = engine.new_cache()
    logits, aux = engine.forward(cache, torch.tensor(context), aux_layers=layers, greedy=True)
    cont = [int(logits[-1].argmax())]
    probe_cache = engine.new_cache()
    engine.forward(probe_cache, torch.tensor(context))
    for _ in range(max(ROWS)):
        cont.append(int(engine.forward(probe_cache, torch.tensor(cont[-1:]), greedy=True)[0].argmax()))
    del probe_cache
    drafter = head.new_drafter()
    drafter.catch_up(aux, context[1:] + cont[:1])
    assert drafter.length == length
    params = check_request(
        EngineRequest(input_ids=context, max_new_tokens=64), engine.spec.max_draft_len, engine.spec.max_seq_len, None
    )

    # features and final-norm rows of a pass of every size (inputs of the head and LM-head measurements)
    _, (pass_aux,) = engine.forward_batch([cache], [torch.tensor(cont[: max(ROWS)])], aux_layers=layers, greedy=[True])
    cache.truncate(length)
    captured_h = {}

    def capture_logits_input(h, greedy):  # to keep the final norm's rows of the last pass (LM head alone, below)
        captured_h["h"] = h
        return orig_logits(h, greedy)

    orig_logits = engine._logits
    engine._logits = capture_logits_input
    engine.forward_batch([cache], [torch.tensor(cont[: max(ROWS)])], greedy=[True])
    cache.truncate(length)
    engine._logits = orig_logits
    h_all = captured_h["h"]  # [8, hidden]
    normed = {m: h_all[:m].contiguous() for m in ROWS}

    # ---------------------------------------------------------------- the measured calls
    def engine_call(tokens, capture: bool):
        def run():
            ids = [torch.tensor(tokens)]
            if capture:
                engine.forward_batch([cache], ids, [None], aux_layers=layers, capture=[True], greedy=[True])
            else:
                engine.forward_batch([cache], ids, [1], greedy=[True])
            cache.truncate(length)

        return run

    step = engine_call(cont[:1], False)

    def catch_up(n):
        def run():
            head.run_passes([HeadPass(drafter, cont[1 : n + 1], aux=pass_aux[:n])])
            drafter.cache.truncate(length)

        return run

    def after_catch_up():  # a draft step's state: the target's pass, then the head's catch-up on 2 rows
        step()
        drafter.catch_up(pass_aux[:2], cont[1:3])

    def draft_step():
        head.run_passes([HeadPass(drafter, cont[2:3], features=drafter.prenorm)])
        drafter.truncate(length)

    def head_round():  # the head's work in a round of 3 drafts as the loop asks for it (catch-up, drafts, Python)
        drafter.catch_up(pass_aux[:2], cont[1:3])
        drafter.draft(draft_len, 1e-9)  # a p_min that cuts nothing: the probabilities are computed, as served
        drafter.truncate(length)

    def verify_rows(m):
        rows = engine.forward_batch([cache], [torch.tensor(cont[:m])], greedy=[True])[0]
        cache.truncate(length)
        draft = cont[1:m]

        def run():
            processed = lp.process_rows(rows, context + draft, length, 0, params)
            verify.verify_greedy(draft, processed)

        return run

    # key -> (untimed setup, timed call): a part measured alone follows a target step, as it follows the target's
    # layers in a round (the caches hold what they hold when it runs served)
    calls = {"step": (None, step)}
    calls.update({f"pass {m}": (None, engine_call(cont[:m], True)) for m in ROWS})
    screen = engine.screen
    for m in ROWS:
        if screen is not None:
            calls[f"screen {m}"] = (step, lambda m=m: screen.argmax_rows(normed[m]))
        calls[f"full head {m}"] = (step, lambda m=m: engine.lm_head(normed[m]))
    calls.update({f"catch-up {n}": (step, catch_up(n)) for n in CATCH_UP})
    calls["draft step"] = (after_catch_up, draft_step)
    calls[f"head round {draft_len}"] = (step, head_round)
    if head_call is not None:  # the same work op by op, in turns with the rest
        for key, (setup, call) in [(k, calls[k]) for k in ("catch-up 2", "draft step", f"head round {draft_len}")]:
            calls[f"{OP_BY_OP} {key}"] = (setup, op_by_op(head, call))
    calls.update({f"verify {m}": (step, verify_rows(m)) for m in ROWS})
    probe = memory_probe(threads)
    bandwidth: list[float] = []

    samples: dict[str, list[dict]] = {key: [] for key in calls}
    order = list(calls)
    for rep in range(repeats + 1):  # the first round warms up
        bandwidth_now = probe()
        for key in order if rep % 2 == 0 else order[::-1]:
            setup, call = calls[key]
            with native.standing_team(ops):  # as the executor runs a step's passes (Executor.generate)
                if setup is not None:
                    setup()
                timers.parts = {}
                decoder.set_profile(True)
                if head_call is not None:
                    head_call.set_profile(True)
                t0 = time.perf_counter()
                call()
                total = time.perf_counter() - t0
            profile = decoder.profile().tolist()
            decoder.set_profile(False)
            head_profile = [0.0] * 4 if head_call is None else head_call.profile().tolist()  # fc, layer, lm head, calls
            if head_call is not None:
                head_call.set_profile(False)
            if rep:
                parts = dict(timers.parts)
                if head_profile[-1]:
                    parts["head fc"], parts["head lm head"] = head_profile[0], head_profile[2]
                if profile[-1]:
                    parts.update(zip(DECODER_PARTS, profile))
                    # what is left, per call (a median of differences, not a difference of medians)
                    parts["native call"] = parts["decoder call"] - sum(parts[p] for p in DECODER_PARTS)
                if "decoder call" in parts:
                    parts["python"] = total - sum(parts.get(p, 0.0) for p in ("decoder call", "lm head", "final norm"))
                if "head lm head" in parts:
                    parts["head layer+python"] = total - parts["head lm head"] - parts.get("head fc", 0.0)
                parts["total"] = total
                samples[key].append(parts)
        if rep:
            bandwidth.append(bandwidth_now)

    gb_s = statistics.median(bandwidth)
    med = {key: _medians(rows) for key, rows in samples.items()}
    unit = med["step"]["total"]
    result = {
        "cpu": lscpu_summary(),
        "isa": native.isa(),
        "int8_variant": native.INT8_VARIANT_NAMES[native.int8_variant()],
        "screen": None if screen is None else screen.kind,
        "threads": threads,
        "head_one_call": head_call is not None,
        "context": length,
        "repeats": repeats,
        "read_gb_s": gb_s,
        "step_ms": unit * 1e3,
        "medians_s": med,
    }
    result["floors"] = floors(engine, head, floor_bytes, gb_s)
    result["passes"] = pass_table(med, unit, result["floors"])
    result["head"] = head_table(med, unit, result["floors"])
    result["head_op_by_op"] = {k[len(OP_BY_OP) + 1 :]: med[k]["total"] / unit for k in med if k.startswith(OP_BY_OP)}
    timers.unwrap()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=4, help="chat prompts of the round section (0: skip it)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--draft-len", type=int, default=3)
    ap.add_argument("--round-repeats", type=int, default=2)
    ap.add_argument(
        "--concurrency", type=int, default=2, help="requests in flight of the batched round section (0: skip it)"
    )
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)

    import torch

    from bench.eagle3_confidence import load_pair

    torch.set_num_threads(args.threads)
    recipe, layout, engine, head, tokenizer = load_pair(args.recipe, args.root)
    if engine.decoder is None:
        print("round_profile: the engine runs no native decoder here (no AVX2/AVX-512 kernels): skipped")
        return 0
    result = profile(engine, head, context_ids(tokenizer, args.context), args.repeats, args.threads, args.draft_len)
    if args.prompts:
        result["round"] = round_section(args, recipe, engine, head, tokenizer)
    if args.prompts and args.concurrency > 1:
        result["batched_round"] = batched_round_section(args, recipe, engine, head, tokenizer)
    print_tables(result)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else ROOT / "bench" / "results" / f"round_profile-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def _medians(rows: list[dict]) -> dict:
    keys = {k for r in rows for k in r}
    return {k: statistics.median(r.get(k, 0.0) for r in rows) for k in sorted(keys)}


def part_bytes(engine, head, context: int) -> dict:
    """The bytes each part must read: weights (as packed for the kernels) and, for attention, the KV cache."""
    s = engine.spec

    # int8_sq keeps gate and up apart (each its own scales): the decoder's gate_up part runs both
    def nbytes(layer, name):
        apart = name == "gate_up" and layer.gate_up is None
        return sum(lin.nbytes() for lin in ((layer.gate, layer.up) if apart else (getattr(layer, name),)))

    per_linear = {name: sum(nbytes(layer, name) for layer in engine.layers) for name in LINEARS}
    kv_bytes = lambda m: s.num_layers * 2 * s.num_kv_heads * (context + m) * s.head_size * 2  # bf16 K and V
    head_bytes = {n: getattr(head, n).nbytes() for n in ("fc", "qkv", "o", "gate_up", "down", "lm_head")}
    return {
        **{f"linear {n}": b for n, b in per_linear.items()},
        "linears": sum(per_linear.values()),
        "lm head screen": engine.screen.nbytes() if engine.screen is not None else None,
        "lm head full": engine.lm_head.nbytes(),
        **{f"kv {m}": kv_bytes(m) for m in ROWS},
        "head catch-up": sum(head_bytes.values()),
        "head draft step": sum(b for n, b in head_bytes.items() if n != "fc"),
        "head lm head": head_bytes["lm_head"],
        "head fc": head_bytes["fc"],
    }


def floors(engine, head, nbytes: dict, gb_s: float) -> dict:
    """Each part's floor in seconds: the bytes it must read at `gb_s`; for the parts that read next to nothing, their
    operations per row."""
    s = engine.spec
    to_s = lambda b: None if b is None else b / (gb_s * 1e9)
    rope = (s.num_heads + s.num_kv_heads) * s.head_size
    flops = s.num_layers * (8 * s.hidden_size + 4 * rope)
    return {
        "bytes": nbytes,
        "seconds": {
            "linears": to_s(nbytes["linears"]),
            "lm head screen": to_s(nbytes["lm head screen"]),
            "lm head full": to_s(nbytes["lm head full"]),
            **{f"attention {m}": to_s(nbytes[f"kv {m}"]) for m in ROWS},
            "head catch-up": to_s(nbytes["head catch-up"]),
            "head draft step": to_s(nbytes["head draft step"]),
        },
        # parts that read next to nothing: the operations per row
        "ops_per_row": {
            "norms+rope": f"{s.num_layers} x (2 rms norms of {s.hidden_size} + rope of {rope}): "
            f"~{flops / 1e3:.0f} kflop a row",
            "swiglu": f"{s.num_layers} x {s.intermediate_size} silu x mul",
            "aux capture": f"copies {len(head.aux_layer_ids)} x {s.hidden_size} bf16 values",
            "verify": f"an argmax over {s.vocab_size} f32 logits ({s.vocab_size * 4 / 1e3:.0f} kB)",
        },
    }


def pass_table(med: dict, unit: float, fl: dict) -> dict:
    """rows -> part -> one-row steps, for the plain step and every pass (medians; the parts' medians need not add up
    to the total's)."""
    table = {}
    for key in ["step"] + [f"pass {m}" for m in ROWS]:
        m = 1 if key == "step" else int(key.split()[1])
        d = med[key]
        linears = sum(d.get(n, 0.0) for n in LINEARS)
        parts = {
            "total": d["total"],
            "linears": linears,
            "attention": d.get("attention", 0.0),
            "norms+rope": d.get("norms", 0.0) + d.get("rope+kv", 0.0) + d.get("swiglu", 0.0),
            "aux capture": d.get("aux capture", 0.0),
            "lm head": d.get("lm head", 0.0) + d.get("final norm", 0.0),
            "python": d.get("python", 0.0),
            "native call": d.get("native call", 0.0),  # the native call's own: arguments, the step's team, the clock
            "screen alone": med.get(f"screen {m}", {}).get("total"),
            "full head alone": med[f"full head {m}"]["total"],
            "verify": med[f"verify {m}"]["total"] if key != "step" else None,
        }
        table[key] = {k: (None if v is None else v / unit) for k, v in parts.items()}
        table[key]["floor linears"] = fl["seconds"]["linears"] / unit
        table[key]["floor attention"] = fl["seconds"][f"attention {m}"] / unit
        table[key]["floor screen"] = (fl["seconds"]["lm head screen"] or 0.0) / unit
        table[key]["floor full head"] = fl["seconds"]["lm head full"] / unit
    return table


def head_table(med: dict, unit: float, fl: dict) -> dict:
    table = {}
    for key in [f"catch-up {n}" for n in CATCH_UP] + ["draft step"] + [k for k in med if k.startswith("head round")]:
        d = med[key]
        table[key] = {
            "total": d["total"] / unit,
            "fc": d.get("head fc", 0.0) / unit,
            "lm head": d.get("head lm head", 0.0) / unit,
            "layer+python": d.get("head layer+python", 0.0) / unit,
            "floor": (
                fl["seconds"]["head draft step"] * (int(key.split()[-1]) - 1) + fl["seconds"]["head catch-up"]
                if key.startswith("head round")
                else fl["seconds"]["head catch-up" if key != "draft step" else "head draft step"]
            )
            / unit,
        }
    return table


def round_section(args, recipe, engine, head, tokenizer) -> dict:
    """The served loop (Executor.generate) on chat prompts: k = --draft-len against the target alone, taking turns;
    per round the head's time, the pass's and the rest, in the control's forward time per pass."""
    from bench.eagle3_peer import chat_prompts
    from bench.eagle3_rounds import run_all
    from specdeploy.engine.executor import Executor

    prompts = chat_prompts(tokenizer, args.prompts, args.max_tokens)
    executor = Executor(engine, 2, head=head, draft_p_min=recipe.speculative.draft_p_min, lookup_threshold=0)
    run_all(executor, prompts[:1], args.draft_len, 8, tokenizer.eos_token_id)  # warm-up
    arms = {"plain": (0, None), "fused": (args.draft_len, None)}  # name -> (k, how the head runs)
    if head.one_call is not None:
        arms[OP_BY_OP] = (args.draft_len, OP_BY_OP)
    runs = {name: [] for name in arms}
    outputs = {}
    for rep in range(args.round_repeats):
        for name in list(arms) if rep % 2 == 0 else list(arms)[::-1]:
            k, how = arms[name]
            go = lambda k=k: run_all(executor, prompts, k, args.max_tokens, tokenizer.eos_token_id)
            tot, outputs[name] = (op_by_op(head, go) if how == OP_BY_OP else go)()
            runs[name].append(tot)
    plain = runs["plain"]
    step = statistics.median(r["fwd"] / r["passes"] for r in plain)

    def parts(fused: list[dict]) -> dict:
        per = lambda key: statistics.median(r[key] / r["passes"] for r in fused) / step
        return {
            "round_steps": per("t"),
            "head_steps": per("draft"),
            "pass_steps": per("fwd"),
            "rest_steps": statistics.median((r["t"] - r["fwd"] - r["draft"]) / r["passes"] for r in fused) / step,
            "speedup": statistics.median(r["t"] / r["out"] for r in plain)
            / statistics.median(r["t"] / r["out"] for r in fused),
        }

    result = {
        "draft_len": args.draft_len,
        "prompts": len(prompts),
        "identical_outputs": all(outputs[name] == outputs["plain"] for name in arms),
        "tokens_per_pass": statistics.median(r["out"] / r["passes"] for r in runs["fused"]),
        **parts(runs["fused"]),
        "plain_rest_steps": statistics.median((r["t"] - r["fwd"]) / r["passes"] for r in plain) / step,
    }
    if OP_BY_OP in runs:
        result["head_op_by_op"] = parts(runs[OP_BY_OP])
    return result


def batched_round_section(args, recipe, engine, head, tokenizer, prompts=None) -> dict:
    """The served loop with --concurrency requests in flight in one BatchScheduler, as the served model runs them (the
    requests' passes in one shared pass, their head forwards in one): the prompts in groups that start together,
    k = --draft-len against the target alone, taking turns. Per batched step, between the ends of two shared passes:
    the heads' forwards, the pass and the rest (the scheduler's and the requests' Python), in the control's time per
    batched step at the same concurrency; only steps where every request of the group decodes (no prefill chunk, none
    finished), so each step is a round of every request. A round here counts once for all the requests in it.
    `prompts`: (id, token ids) pairs instead of --prompts built-in chat prompts."""
    import threading

    from bench.eagle3_peer import chat_prompts
    from specdeploy.engine.batching import BatchScheduler
    from specdeploy.engine.executor import Executor
    from specdeploy.engine.request import EngineRequest

    c, k = args.concurrency, args.draft_len
    prompts = prompts or chat_prompts(tokenizer, max(args.prompts, c), args.max_tokens)
    groups = [prompts[i : i + c] for i in range(0, len(prompts) - c + 1, c)]
    executor = Executor(engine, 2 * c, head=head, draft_p_min=recipe.speculative.draft_p_min, lookup_threshold=0)

    def run_group(group, k: int) -> dict:
        executor.clear_cache()
        events: list[tuple] = []  # (kind, start, end, [rows of each pass])
        run_passes, run_heads = executor.run_passes, executor.run_head_passes

        def timed(kind, run):
            def call(passes):
                t0 = time.perf_counter()
                run(passes)
                rows = [len(p.tokens) for p in passes] if kind == "pass" else [1] * len(passes)
                events.append((kind, t0, time.perf_counter(), rows))

            return call

        executor.run_passes, executor.run_head_passes = timed("pass", run_passes), timed("head", run_heads)
        scheduler = BatchScheduler(executor, c)
        outputs, stats, failures = [None] * len(group), [None] * len(group), []

        def consume(i: int, stream) -> None:
            tokens = []
            try:
                for chunk in stream:
                    tokens.extend(chunk.token_ids)
                    if chunk.finished:
                        stats[i] = chunk.stats
            except Exception as exc:  # noqa: BLE001 - raised in the caller's thread below
                failures.append(exc)
            outputs[i] = tokens

        try:
            with scheduler.paused():  # every request of the group joins the first step
                streams = [
                    scheduler.generate(
                        EngineRequest(
                            input_ids=list(ids),
                            max_new_tokens=args.max_tokens,
                            end_id=tokenizer.eos_token_id,
                            num_draft_tokens=k,
                        )
                    )
                    for _, ids in group
                ]
                threads = [threading.Thread(target=consume, args=(i, s)) for i, s in enumerate(streams)]
                for t in threads:
                    t.start()
                while scheduler.waiting() < len(group) and not failures:
                    time.sleep(0.001)
            for t in threads:
                t.join()
            if failures:
                raise failures[0]
        finally:
            scheduler.close()
            del executor.run_passes, executor.run_head_passes
        step, head_s, pass_s, steps = [], 0.0, 0.0, 0
        last_end, heads_since = None, 0.0
        for kind, t0, t1, rows in events:
            if kind == "head":
                heads_since += t1 - t0
                continue
            decoding = len(rows) == len(group) and max(rows) <= k + 1
            if last_end is not None and decoding:
                step.append(t1 - last_end)
                head_s += heads_since
                pass_s += t1 - t0
                steps += 1
            last_end, heads_since = t1, 0.0
        return dict(
            step_s=sum(step),
            steps=steps,
            head_s=head_s,
            pass_s=pass_s,
            out=sum(len(o) - 1 for o in outputs),
            passes=sum(s.iterations - 1 for s in stats),
            outputs=outputs,
        )

    run_group(groups[0], k)  # warm-up
    runs: dict[str, list[dict]] = {"plain": [], "fused": []}
    for rep in range(args.round_repeats):
        for name in ("plain", "fused") if rep % 2 == 0 else ("fused", "plain"):
            per = [run_group(g, k if name == "fused" else 0) for g in groups]
            runs[name].append(
                {key: sum(r[key] for r in per) for key in ("step_s", "steps", "head_s", "pass_s", "out", "passes")}
                | {"outputs": [o for r in per for o in r["outputs"]]}
            )
    plain_step = statistics.median(r["step_s"] / r["steps"] for r in runs["plain"])
    per_step = lambda key: statistics.median(r[key] / r["steps"] for r in runs["fused"]) / plain_step
    round_steps = per_step("step_s")
    tokens = statistics.median(r["out"] / r["passes"] for r in runs["fused"])  # a request's tokens a round
    return {
        "concurrency": c,
        "draft_len": k,
        "prompts": len(groups) * c,
        "identical_outputs": all(r["outputs"] == runs["plain"][0]["outputs"] for rs in runs.values() for r in rs),
        "plain_step_ms": 1000 * plain_step,
        "steps_timed": statistics.median(r["steps"] for r in runs["fused"]),
        "tokens_per_pass": tokens,
        "round_steps": round_steps,
        "head_steps": per_step("head_s"),
        "pass_steps": per_step("pass_s"),
        "rest_steps": round_steps - per_step("head_s") - per_step("pass_s"),
        "plain_pass_steps": statistics.median(r["pass_s"] / r["steps"] for r in runs["plain"]) / plain_step,
        "tpot_speedup": tokens / round_steps,
    }


def print_tables(r: dict) -> None:
    cpu = r["cpu"]
    print(
        f"\n{cpu['model']} ({cpu['cores']} cores; {' '.join(cpu['flags'])}), {r['threads']} threads, isa {r['isa']}, "
        f"int8 {r['int8_variant']}, screen {r['screen']}, head {'one call' if r['head_one_call'] else 'op by op'}; "
        f"context {r['context']}; one-row step {r['step_ms']:.2f} ms; "
        f"read bandwidth {r['read_gb_s']:.1f} GB/s; medians of {r['repeats']}, in one-row steps"
    )
    cols = ("total", "linears", "attention", "norms+rope", "aux capture", "lm head", "native call", "python", "verify")
    print(f"{'':10}" + "".join(f"{c:>12}" for c in cols) + f"{'screen':>9}{'full':>7}")
    for key, d in r["passes"].items():
        cells = "".join(f"{'-' if d[c] is None else format(d[c], '.3f'):>12}" for c in cols)
        print(f"{key:10}{cells}{d['screen alone'] or 0:9.3f}{d['full head alone']:7.3f}")
    first = r["passes"]["step"]
    print(
        f"{'floor':10}{'':12}{first['floor linears']:12.3f}{first['floor attention']:12.3f}{'~0':>12}{'~0':>12}"
        f"{first['floor screen']:12.3f}{'0':>12}{'0':>12}{'~0':>12}"
        f"{first['floor screen']:9.3f}{first['floor full head']:7.3f}"
    )
    print(f"\n{'head':12}{'total':>8}{'fc':>8}{'lm head':>9}{'layer+py':>10}{'floor':>8}")
    for key, d in r["head"].items():
        print(f"{key:12}{d['total']:8.3f}{d['fc']:8.3f}{d['lm head']:9.3f}{d['layer+python']:10.3f}{d['floor']:8.3f}")
    if r["head_op_by_op"]:
        print("head op by op: " + ", ".join(f"{key} {total:.3f}" for key, total in r["head_op_by_op"].items()))
    if "round" in r:
        x = r["round"]
        print(
            f"\nserved round (k={x['draft_len']}, {x['prompts']} prompts, identical outputs {x['identical_outputs']}): "
            f"{x['round_steps']:.2f} steps = head {x['head_steps']:.2f} + pass {x['pass_steps']:.2f} + rest "
            f"{x['rest_steps']:.2f} (plain decode's rest {x['plain_rest_steps']:.2f}); {x['tokens_per_pass']:.2f} "
            f"tokens a pass; {x['speedup']:.2f}x"
        )
        if "head_op_by_op" in x:
            y = x["head_op_by_op"]
            print(
                f"  with the head op by op: {y['round_steps']:.2f} steps = head {y['head_steps']:.2f} + pass "
                f"{y['pass_steps']:.2f} + rest {y['rest_steps']:.2f}; {y['speedup']:.2f}x"
            )
    if "batched_round" in r:
        x = r["batched_round"]
        print(
            f"served round, {x['concurrency']} requests in flight (k={x['draft_len']}, {x['prompts']} prompts, "
            f"identical outputs {x['identical_outputs']}, {x['steps_timed']:.0f} steps timed): {x['round_steps']:.2f} "
            f"steps of {x['plain_step_ms']:.2f} ms = head {x['head_steps']:.2f} + pass {x['pass_steps']:.2f} + rest "
            f"{x['rest_steps']:.2f} (the control's pass {x['plain_pass_steps']:.2f}); "
            f"{x['tokens_per_pass']:.2f} tokens a request's pass; TPOT {x['tpot_speedup']:.2f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
