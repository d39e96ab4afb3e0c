"""TensorRT-LLM's own llmapi Triton model files (model.py, helpers.py): where a GPU repository gets them.

The generated repository holds model.yaml and config.pbtxt; the Python that reads them is TensorRT-LLM's and must
be the image's own release. Two ways in:
- the image: the Dockerfile (packaging.dockerfile) runs `python3 -m specdeploy.gpu.llmapi_upstream` at
  `docker build`, which stages the files of the image's TensorRT-LLM in STAGED_DIR, and the container's start
  (launch_command.container_command) copies them into the repository before tritonserver starts;
- a checkout the user names: `specdeploy repo RECIPE --trtllm-src DIR` copies them from DIR/UPSTREAM_DIR.
`repository_missing` lists what a repository still lacks; serve's start refuses it (launch.start).
"""

from __future__ import annotations

import shutil
import sys
import urllib.request
from pathlib import Path

UPSTREAM_DIR = "triton_backend/all_models/llmapi/tensorrt_llm/1"  # in a TensorRT-LLM checkout
UPSTREAM_FILES = ("model.py", "helpers.py")
# tensorrtllm_backend@0b9d7d5 dockerfile/Dockerfile.triton.trt_llm_backend:172-174 copies the release's
# triton_backend/all_models to /app/all_models; an image without that copy gets the files at the release's tag.
IMAGE_COPY_DIR = "/app/all_models/llmapi/tensorrt_llm/1"
STAGED_DIR = "/opt/specdeploy/llmapi"  # where the image build stages them for the container's start
# TensorRT-LLM's release tags are v<version> (tensorrtllm_backend@7777c28 docs/model_config.md:9 links
# NVIDIA/TensorRT-LLM/blob/v0.16.0).
RELEASE_URL = "https://raw.githubusercontent.com/NVIDIA/TensorRT-LLM/v{version}/" + UPSTREAM_DIR + "/{file}"


def repository_missing(repo: Path, models: tuple[str, ...]) -> list[str]:
    """The upstream files a GPU llmapi repository lacks, as '<model>/1/<file>'."""
    return [f"{m}/1/{f}" for m in models for f in UPSTREAM_FILES if not (Path(repo) / m / "1" / f).is_file()]


def copy_from_checkout(checkout: Path, model_version_dir: Path) -> None:
    """Copy model.py and helpers.py from a TensorRT-LLM checkout; FileNotFoundError naming the file it lacks."""
    for file in UPSTREAM_FILES:
        src = Path(checkout) / UPSTREAM_DIR / file
        if not src.is_file():
            raise FileNotFoundError(src)
        shutil.copyfile(src, Path(model_version_dir) / file)


def stage(dest: Path, version: str, image_copy: Path = Path(IMAGE_COPY_DIR), url: str = RELEASE_URL) -> str:
    """Put the llmapi model files of TensorRT-LLM `version` in `dest`: the image's own copy when it has one, else
    the files at the release's tag. Returns where they came from."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    if all((Path(image_copy) / f).is_file() for f in UPSTREAM_FILES):
        for file in UPSTREAM_FILES:
            shutil.copyfile(Path(image_copy) / file, dest / file)
        return str(image_copy)
    for file in UPSTREAM_FILES:
        with urllib.request.urlopen(url.format(version=version, file=file), timeout=60) as resp:
            (dest / file).write_bytes(resp.read())
    return url.format(version=version, file="")


def main(argv: list[str]) -> int:
    """`python3 -m specdeploy.gpu.llmapi_upstream [DEST]` inside the image: stage its release's files."""
    from importlib import metadata

    version = metadata.version("tensorrt_llm")
    source = stage(Path(argv[0] if argv else STAGED_DIR), version)
    print(f"TensorRT-LLM {version} llmapi model files from {source}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
