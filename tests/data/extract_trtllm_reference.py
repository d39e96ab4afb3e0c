"""One-off: extract the tensor declarations of NVIDIA's inflight_batcher_llm layout into JSON.

Source: github.com/triton-inference-server/tensorrtllm_backend at commit c2e65b8,
all_models/inflight_batcher_llm/{preprocessing,tensorrt_llm,tensorrt_llm_bls,postprocessing,ensemble}/config.pbtxt.
The template placeholders are filled (`${logits_datatype}` -> TYPE_FP32, the others -> 1) and each
config is parsed with tritonclient's ModelConfig protobuf. Run once against a clone of that
repository; the output, trtllm_backend_c2e65b8_tensors.json, is what tests/test_triton_repo.py reads:

    python tests/data/extract_trtllm_reference.py /path/to/tensorrtllm_backend >
    tests/data/trtllm_backend_c2e65b8_tensors.json
"""

import json
import re
import subprocess
import sys

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

COMMIT = "c2e65b8"
MODELS = ("preprocessing", "tensorrt_llm", "tensorrt_llm_bls", "postprocessing", "ensemble")


def tensors(items) -> list[dict]:
    return [
        {
            "name": t.name,
            "dtype": model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_"),
            "dims": list(t.dims),
            "optional": bool(getattr(t, "optional", False)),
        }  # outputs have no such field
        for t in items
    ]


def main(clone: str) -> None:
    out = {
        "source": f"triton-inference-server/tensorrtllm_backend@{COMMIT}:all_models/inflight_batcher_llm/*/config.pbtxt"
    }
    for model in MODELS:
        path = f"{COMMIT}:all_models/inflight_batcher_llm/{model}/config.pbtxt"
        text = subprocess.run(["git", "-C", clone, "show", path], capture_output=True, text=True, check=True).stdout
        text = re.sub(r"\$\{[a-z_]+\}", "1", text.replace("${logits_datatype}", "TYPE_FP32"))
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
        out[model] = {"inputs": tensors(config.input), "outputs": tensors(config.output)}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
