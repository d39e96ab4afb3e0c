"""A recording stand-in for TensorRT-LLM's `trtllm-build`, and fake quantize-stage checkpoints.

The stand-in is a real executable put on PATH: it appends its argv to $STANDIN_RECORD, prints a
version line and progress like the real tool, and writes config.json + rank{N}.engine for each rank
of the checkpoint's mapping. With STANDIN_FAIL=target (or draft) it writes a partial file and exits 1.
It builds nothing: tests of the orchestration only.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

from specdeploy.core.artifacts import Manifest

STANDIN = r"""#!{python}
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
with open(os.environ["STANDIN_RECORD"], "a") as fh:
    fh.write(json.dumps(argv) + "\n")
def arg(name):
    return argv[argv.index(name) + 1]
role = "target" if "--speculative_decoding_mode" in argv else "draft"
print("[TensorRT-LLM] TensorRT-LLM version: 0.18.0-standin", flush=True)
ckpt = json.loads((Path(arg("--checkpoint_dir")) / "config.json").read_text())
world = ckpt["mapping"]["world_size"]
out = Path(arg("--output_dir"))
out.mkdir(parents=True, exist_ok=True)
for rank in range(world):
    print(f"[TRT-LLM] [I] building rank {{rank}} of {{world}} ({{role}})", flush=True)
    (out / f"rank{{rank}}.engine").write_bytes(b"standin engine " + role.encode())
    if os.environ.get("STANDIN_FAIL") == role:
        print("[TRT-LLM] [E] out of memory while building the engine", flush=True)
        print("RuntimeError: [TensorRT-LLM][ERROR] standin failure", flush=True)
        sys.exit(1)
build_config = {{"max_draft_len": int(arg("--max_draft_len")) if "--max_draft_len" in argv else 0}}
(out / "config.json").write_text(json.dumps({{"build_config": build_config, "pretrained_config": ckpt}}))
print("[TRT-LLM] [I] Total time of building all engines: 00:00:00", flush=True)
"""


def install_standin(bin_dir: Path, monkeypatch, record: Path) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "trtllm-build"
    tool.write_text(STANDIN.format(python=sys.executable))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STANDIN_RECORD", str(record))
    monkeypatch.delenv("STANDIN_FAIL", raising=False)
    return tool


def recorded(record: Path) -> list[list[str]]:
    if not record.is_file():
        return []
    return [json.loads(line) for line in record.read_text().splitlines()]


def write_trtllm_checkpoint(
    directory: Path,
    recipe_name: str,
    source_dir: Path,
    tp: int = 1,
    pp: int = 1,
    quant_algo: str | None = "FP8",
    fingerprint: str = "ckpt-fp",
    layers: int = 2,
) -> None:
    """A quantize-stage output as far as the build reads it: config.json (mapping) + manifest."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architecture": "LlamaForCausalLM",
        "dtype": "bfloat16",
        "vocab_size": 512,
        "hidden_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_size": 16,
        "intermediate_size": 128,
        "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp},
        "quantization": {"quant_algo": quant_algo, "kv_cache_quant_algo": None},
    }
    (directory / "config.json").write_text(json.dumps(config))
    for rank in range(tp * pp):
        (directory / f"rank{rank}.safetensors").write_bytes(b"")
    Manifest(
        stage="quantize", recipe_name=recipe_name, fingerprint=fingerprint, inputs={"source_dir": str(source_dir)}
    ).write(directory)


def write_hf_checkpoint(directory: Path, recipe_name: str, source_dir: Path, quantized: bool = True) -> None:
    """A ModelOpt Hugging Face-format export as the LLM-API path loads it (config + hf_quant_config.json)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(source_dir) / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    if quantized:
        (directory / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    else:
        (directory / "hf_quant_config.json").unlink(missing_ok=True)
    Manifest(
        stage="quantize", recipe_name=recipe_name, fingerprint="hf-fp", inputs={"source_dir": str(source_dir)}
    ).write(directory)


# A stand-in for tritonserver (the NGC image's, or the embedded one): prints and, with $STANDIN_RECORD set,
# records its argv, answers /v2/health/ready over HTTP, and records the signal that stops it. It speaks no
# gRPC, so validation cannot succeed against it.
STANDIN_TRITONSERVER = """#!{python}
import http.server, json, os, signal, sys
def record(line):
    if os.environ.get("STANDIN_RECORD"):
        with open(os.environ["STANDIN_RECORD"], "a") as fh:
            fh.write(json.dumps(line) + "\\n")
record(["tritonserver", *sys.argv[1:]])
def stopped(signum, frame):
    record(["tritonserver-stopped", signal.Signals(signum).name])
    os._exit(0)
signal.signal(signal.SIGTERM, stopped)
port = int(next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--http-port=")))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/v2/health/ready", "/v2/health/live") else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
print("standin tritonserver", " ".join(sys.argv[1:]), flush=True)
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
