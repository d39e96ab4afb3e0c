"""Re-records llama_*.json / llama_spec.sse: real llama-server answers to POST /v1/completions (README.md here).

.venv/bin/python tests/data/runtime_counters/record_llama.py
"""

from __future__ import annotations

import json
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from bench import eagle3_peer, llama_cpp  # noqa: E402

PROMPT = "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n"


def post(port: int, body: dict) -> bytes:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read()


def main() -> None:
    from specdeploy.core.artifacts import BUNDLED_HEADS
    from specdeploy.core.model_store import resolve

    hf_dir = Path(resolve("smollm2-135m-instruct"))
    head = llama_cpp.convert_head(BUNDLED_HEADS / "smollm2-135m-instruct-eagle3", hf_dir)
    model, binary = llama_cpp.convert_model(hf_dir, "q8_0"), llama_cpp.binary("llama-server", 2)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    extra: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, draft in (("plain", None), ("spec", head)):
            server = eagle3_peer.start_server(binary, model, 2, 1024, Path(tmp) / f"{name}.log", draft, 3, extra=extra)
            try:
                (HERE / f"llama_{name}.json").write_bytes(post(server.port, body))
                if draft is not None:
                    streamed = post(server.port, {**body, "stream": True, "stream_options": {"include_usage": True}})
                    (HERE / "llama_spec.sse").write_bytes(streamed)
            finally:
                server.close()


if __name__ == "__main__":
    main()
