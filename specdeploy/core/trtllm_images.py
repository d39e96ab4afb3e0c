"""Which TensorRT-LLM release each NGC Triton image carries, and the image a GPU recipe runs in.

The recipe's `trtllm_version` picks the image (`image: auto`), or the recipe names one (`image:` / `serve --image`)
and it must carry that release: an NGC `<yy.mm>-trtllm-python-py3` tag is looked up in IMAGE_TRTLLM and a mismatch
refused here, before anything is written; any other image (one built with tensorrtllm_backend's Dockerfile) is
checked by the version gate of the generated Dockerfile at `docker build` (packaging.dockerfile).
"""

from __future__ import annotations

import re

from specdeploy.core.errors import ConfigError

NGC_IMAGE = "nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3"
_NGC_TAG = re.compile(r"(?:nvcr\.io/)?nvidia/tritonserver:(\d\d\.\d\d)-trtllm-python-py3")

# Triton's Release Compatibility Matrix, container trtllm-python-py3, column "TensorRT-LLM version":
# triton-inference-server/server@6fa22ae docs/introduction/compatibility.md (the r26.08 branch; it lists no 26.08
# trtllm-python-py3 row). 25.11 carries NVIDIA's 1.0.3.2510 build of the 1.0 line. No NGC image carries 1.3 or 1.4.
IMAGE_TRTLLM = {
    "24.12": "0.16.0",
    "25.01": "0.17.0",
    "25.02": "0.17.0.post1",
    "25.03": "0.18.0",
    "25.04": "0.18.2",
    "25.05": "0.19.0",
    "25.06": "0.20.0",
    "25.07": "0.20.0",
    "25.08": "0.21.0",
    "25.09": "1.0.0",
    "25.10": "1.0.0",
    "25.11": "1.0.3.2510",
    "25.12": "1.1.0",
    "26.01": "1.1.0",
    "26.02": "1.1.0",
    "26.03": "1.2.0",
    "26.04": "1.2.1",
    "26.05": "1.2.1",
    "26.06": "1.2.1",
    "26.07": "1.2.1",
}
MATRIX_SOURCE = "triton-inference-server/server@6fa22ae docs/introduction/compatibility.md"


def ngc_tag(image: str) -> str | None:
    """The `<yy.mm>` of an NGC Triton TensorRT-LLM image, None for any other image."""
    m = _NGC_TAG.fullmatch(image.strip())
    return m.group(1) if m else None


def image_trtllm(image: str) -> str:
    """The TensorRT-LLM release an NGC Triton image carries; ConfigError for an image IMAGE_TRTLLM does not list."""
    tag = ngc_tag(image)
    if tag is None or tag not in IMAGE_TRTLLM:
        known = ", ".join(f"{t} ({v})" for t, v in IMAGE_TRTLLM.items())
        raise ConfigError(
            f"image {image!r} is not an NGC Triton TensorRT-LLM image specdeploy knows the TensorRT-LLM release of",
            f"pass --image nvcr.io/nvidia/tritonserver:<yy.mm>-trtllm-python-py3 with one of {known}, or add the tag to"
            " specdeploy.core.trtllm_images.IMAGE_TRTLLM after checking Triton's compatibility matrix"
            f" ({MATRIX_SOURCE})",
        )
    return IMAGE_TRTLLM[tag]


def carries(release: str, version: str) -> bool:
    """Whether an image's TensorRT-LLM `release` ("1.2.1") is the recipe's `version` ("1.2", "1.2.1", "1.3.0rc27"):
    the same release line, and the same release where the version names one."""
    release_parts, version_parts = release.split("."), str(version).split(".")
    return release_parts[: len(version_parts)] == version_parts


def images_for(version: str) -> list[str]:
    """The NGC tags that carry TensorRT-LLM `version`, oldest first."""
    return [tag for tag, release in IMAGE_TRTLLM.items() if carries(release, version)]


def image_for(version: str) -> str:
    """The newest NGC Triton image carrying `version`; ConfigError naming the way out when none does."""
    tags = images_for(version)
    if not tags:
        lines = sorted(
            {".".join(v.split(".")[:2]) for v in IMAGE_TRTLLM.values()},
            key=lambda line: [int(p) for p in line.split(".")],
        )
        raise ConfigError(
            f"no NGC Triton image carries TensorRT-LLM {version} (Triton's compatibility matrix, {MATRIX_SOURCE}, "
            f"lists releases {', '.join(lines)})",
            "name an image built with it (key 'image', or serve --image; tensorrtllm_backend's "
            "dockerfile/Dockerfile.triton.trt_llm_backend takes TENSORRTLLM_VER), or set trtllm_version to a release "
            f"an NGC image carries (newest: {IMAGE_TRTLLM[list(IMAGE_TRTLLM)[-1]]})",
        )
    return NGC_IMAGE.format(tag=tags[-1])


def check_image(image: str, version: str, key: str = "image") -> str:
    """`image` for a recipe targeting TensorRT-LLM `version`: an NGC tag must carry it (refused otherwise); another
    image is returned as is, for the Dockerfile's version gate to check when it is built."""
    tag = ngc_tag(image)
    if tag is None:
        return image
    release = image_trtllm(image)
    if not carries(release, version):
        tags = images_for(version)
        fix = (
            f"use {NGC_IMAGE.format(tag=tags[-1])}" if tags else "use an image built with that release"
        ) + f", or set trtllm_version: {'.'.join(release.split('.')[:2])}"
        raise ConfigError(
            f"key '{key}' is {image}, which carries TensorRT-LLM {release} ({MATRIX_SOURCE}), but the "
            f"recipe targets trtllm_version {version}: the LLM-API options are written for that release",
            fix,
        )
    return image


def recipe_image(recipe, override: str | None = None) -> str:
    """The base image of a trtllm-llmapi recipe: `override` (serve --image), the recipe's `image`, or the newest NGC
    image that carries its trtllm_version; a named one must carry it (check_image)."""
    if override:
        return check_image(override, recipe.trtllm_version, key="--image")
    if recipe.image != "auto":
        return check_image(recipe.image, recipe.trtllm_version)
    return image_for(recipe.trtllm_version)
