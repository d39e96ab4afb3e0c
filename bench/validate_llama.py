"""`specdeploy validate` against a deployment specdeploy did not make (`make bench`, last part): llama.cpp's
llama-server serving the bundled target twice on loopback, plain and with `--spec-type draft-eagle3` and the shipped
head, validated over its OpenAI API exactly as a user of llama.cpp would:

    specdeploy validate --protocol openai --url http://127.0.0.1:SPEC --control-url http://127.0.0.1:PLAIN \
        --tokenizer <the bundled model's folder> --min-speedup 0

(the recipe-less default run: the default recipe's size, streamed; --min-speedup 0 because llama.cpp's EAGLE-3 path
is slower than its plain decode on a 2-core CPU, which the report shows and the bench does not fail on). Then the same
prompts go to the same speculative server as token ids through bench/eagle3_peer.py's client (`/completion`,
per-pass counts from the server's log), so the acceptance validate read from llama.cpp's timings is checked against
eagle3_peer's count for the same head and prompts.

    .venv/bin/python bench/validate_llama.py [--recipe build/smollm2-135m.yaml] [--head DIR] [--threads 2]
        [--format q8_0] [--quick] [--report-dir engines/llama-validate]

Exit code: validate's (0, 3 parity, ...), or 1 when the two acceptance counts disagree; skipped with one line (exit 0)
where llama.cpp or a head cannot be had.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from bench import eagle3_peer, llama_cpp  # noqa: E402
from bench.llama_cpp import log  # noqa: E402

CTX = 4096  # the longest built-in prompt, chat-rendered, plus 64 tokens and the drafts


def peer_acceptance(server: eagle3_peer.LlamaServer, tokenizer, report: dict) -> eagle3_peer.Acceptance:
    """eagle3_peer's count (the server's per-pass log, checked against its timings) for validate's parity prompts,
    sent as token ids."""
    total = eagle3_peer.Acceptance()
    end_ids = {tokenizer.eos_token_id}
    for prompt in report["prompts"]:
        ids = list(tokenizer(prompt["text"], add_special_tokens=True)["input_ids"])
        total.merge(server.generate(ids, prompt["max_tokens"], end_ids).acceptance)
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "build" / "smollm2-135m.yaml"))
    ap.add_argument("--head", default=None, help="exported EAGLE-3 head folder [the recipe's, else the bundled]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--format", default="q8_0", help="the target's GGUF type")
    ap.add_argument("--quick", action="store_true", help="validate --quick (a small plan) instead of the default run")
    ap.add_argument("--report-dir", default=str(ROOT / "engines" / "llama-validate"))
    ap.add_argument("--cache-prompt", action="store_true", help="serve with llama-server's default prompt cache")
    args = ap.parse_args(argv)

    from specdeploy.core.artifacts import Layout
    from specdeploy.core.model_store import resolve
    from specdeploy.engine.generate import load_tokenizer
    from specdeploy.recipe.load import load_recipe

    recipe = load_recipe(args.recipe)
    head_dir = eagle3_peer.resolve_head(recipe, Layout.of(recipe, os.environ.get("SPECDEPLOY_ROOT") or ROOT), args.head)
    if head_dir is None:
        print(f"validate-llama: skipped: no EAGLE-3 head for {recipe.name} (--head DIR)")
        return 0
    hf_dir = Path(resolve(recipe.target.model))
    k = recipe.speculative.num_draft_tokens
    servers: list[eagle3_peer.LlamaServer] = []
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        binary = llama_cpp.binary("llama-server", args.threads)
        head_gguf = llama_cpp.convert_head(head_dir, hf_dir)
        model = llama_cpp.convert_model(hf_dir, args.format)
        # a request reusing the previous one's cached prompt prefills in another batch shape, whose logits llama.cpp
        # does not promise bit-equal (b11434 tools/server/README.md, `cache_prompt`): greedy answers then change between
        # requests
        extra: list[str] = [] if args.cache_prompt else ["--no-cache-prompt"]
        for head in (None, head_gguf):
            log_path = out / f"llama-{'spec' if head else 'plain'}.log"
            servers.append(eagle3_peer.start_server(binary, model, args.threads, CTX, log_path, head, k, extra=extra))
    except (llama_cpp.Unavailable, OSError) as exc:
        for server in servers:
            server.close()
        print(f"validate-llama: skipped: {type(exc).__name__}: {exc}")
        return 0
    plain, spec = servers
    try:
        log(
            f"llama.cpp {args.format}: plain on 127.0.0.1:{plain.port}, draft-eagle3 (head {head_dir}, K = {k}) on "
            f"127.0.0.1:{spec.port}"
        )
        command = [
            str(Path(sys.executable).with_name("specdeploy")),
            "validate",
            "--protocol",
            "openai",
            "--url",
            f"http://127.0.0.1:{spec.port}",
            "--control-url",
            f"http://127.0.0.1:{plain.port}",
            "--tokenizer",
            str(hf_dir),
            "--min-speedup",
            "0",
            "--report-dir",
            str(out),
            "--no-progress",
            *(["--quick"] if args.quick else []),
        ]
        log(" ".join(command))
        code = subprocess.run(command).returncode
        report = json.loads((out / "report.json").read_text())
        peer = peer_acceptance(spec, load_tokenizer(hf_dir, recipe.target.model), report)
    finally:
        for server in servers:
            server.close()
    acc = report.get("acceptance") or {}
    mine = acc.get("all") or {}
    log(
        f"acceptance from llama.cpp's timings (validate, parity phase): {mine.get('accepted')}/{mine.get('drafted')} "
        f"drafts accepted over {mine.get('prompts')} prompts; eagle3_peer's count, same prompts as token ids: "
        f"{peer.accepted}/{peer.drafted} over {peer.passes} passes (length {peer.length:.2f}, per position "
        + " ".join(f"{p:.2f}" for p in peer.per_position)
        + ")"
    )
    both = {"validate": mine, "eagle3_peer": peer.to_json()}
    (out / "peer_acceptance.json").write_text(json.dumps(both, indent=2) + "\n")
    if (mine.get("drafted"), mine.get("accepted")) != (peer.drafted, peer.accepted):
        log(
            "the two counts differ: validate's came from the text prompts llama-server tokenized itself, eagle3_peer's "
            "from token ids; see the report's prompts"
        )
        return code or 1
    return code


if __name__ == "__main__":
    sys.exit(main())
