"""One-off: the tensor names of NVIDIA's `tensorrt_llm` model (C++ backend) in each tensorrtllm_backend release.

Source: github.com/triton-inference-server/tensorrtllm_backend,
all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt at each tag below (from 0.20 on the backend lives in
NVIDIA/TensorRT-LLM's triton_backend/ folder, not in this repository). Template placeholders are filled as in
extract_trtllm_reference.py and the config is parsed with tritonclient's ModelConfig protobuf. Run against a clone; the
output is trtllm_backend_tensor_names.json, which tests/test_trtllm_repo.py compares with
specdeploy.gpu.triton_models.BACKEND_TENSOR_NAMES:

    python tests/data/extract_trtllm_backend_names.py /path/to/tensorrtllm_backend.git >
    tests/data/trtllm_backend_tensor_names.json
"""

import json
import re
import subprocess
import sys

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

TAGS = ("v0.16.0", "v0.17.0", "v0.18.0", "v0.18.1", "v0.18.2", "v0.19.0", "c2e65b8")
PATH = "all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"


def main(git_dir: str) -> None:
    out = {"source": f"triton-inference-server/tensorrtllm_backend@<tag>:{PATH}"}
    for tag in TAGS:
        text = subprocess.run(
            ["git", "--git-dir", git_dir, "show", f"{tag}:{PATH}"], capture_output=True, text=True, check=True
        ).stdout
        text = re.sub(r"\$\{[a-z_]+\}", "1", text.replace("${logits_datatype}", "TYPE_FP32"))
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
        out[tag] = {"inputs": [t.name for t in config.input], "outputs": [t.name for t in config.output]}
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
