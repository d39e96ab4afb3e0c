"""The container image a GPU deployment runs in: the NGC Triton + TensorRT-LLM image with specdeploy installed.

specdeploy's python models (preprocessing, postprocessing, tensorrt_llm_bls) import specdeploy inside the
server. Mounting the host's site-packages into the container would put the host's torch and numpy ahead of
the image's CUDA builds; instead `specdeploy serve --print-only` writes a Docker build context under
engines/<recipe>/image/: a copy of the specdeploy source and a Dockerfile that installs it into the image
with `pip install --no-deps` (the image's torch, transformers, tokenizers and numpy stay), adds the few
pure-Python packages it needs, and refuses to build when the image's TensorRT-LLM is not the recipe's
`trtllm_version`.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from specdeploy.core.artifacts import Layout
from specdeploy.recipe.config import Recipe

# What engine-backend images must carry when no built engine says otherwise: gpu_models.ENGINE_BACKEND_TRTLLM.
# Distributions the image already provides in CUDA builds; installing specdeploy must not replace them.
PROVIDED_BY_IMAGE = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "accelerate", "nvidia-modelopt")
# specdeploy's dependencies that the server-side models need and the image may lack (pure Python).
SERVER_SIDE = ("pyyaml", "click", "tqdm", "psutil", "requests")
CONTEXT_DIR = "image"
SOURCE_DIR = "specdeploy-src"


def image_context(layout: Layout) -> Path:
    return Path(layout.engines) / CONTEXT_DIR


def base_image(recipe: Recipe, override: str | None = None) -> str:
    """The image the Dockerfile starts FROM: `override` (serve --image), the recipe's `image`, else the backend's
    default (trtllm-engine) or the newest NGC image carrying the recipe's trtllm_version (trtllm-llmapi, checked)."""
    from specdeploy.core import backends, trtllm_images

    backend = backends.of(recipe)
    if backend.tensorrt_engines:  # checked against the built engines' release in write_context
        return override or (recipe.image if recipe.image != "auto" else backend.default_image)
    return trtllm_images.recipe_image(recipe, override)


def image_tag(recipe: Recipe, layout: Layout | None = None) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", recipe.name.lower()).strip("-.") or "recipe"
    return f"specdeploy/{name}:trtllm-{target_trtllm(recipe, layout)}"


def target_trtllm(recipe: Recipe, layout: Layout | None = None) -> str:
    """The TensorRT-LLM release the image must carry: the recipe's trtllm_version (LLM API), or for TensorRT
    engines the release that built them (their manifest records what trtllm-build printed)."""
    from specdeploy.core import backends

    if not backends.of(recipe).tensorrt_engines:
        return recipe.trtllm_version
    if layout is not None:
        from specdeploy.core.artifacts import Manifest

        built = Manifest.read(layout.engine("target"))
        version = (built.tool_versions or {}).get("trtllm-build") if built is not None else None
        if version:
            return str(version).split("-")[0]
    from specdeploy.gpu import triton_models as gpu_models

    return gpu_models.ENGINE_BACKEND_TRTLLM


def pinned_requirements(names=SERVER_SIDE) -> list[str]:
    """specdeploy's own pins (its installed metadata) for the server-side extras, e.g. 'pyyaml==6.0.3'."""
    from importlib import metadata

    pins = {}
    for req in metadata.requires("specdeploy") or []:
        if ";" in req:
            continue
        m = re.match(r"\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)$", req)
        if m:
            pins[m.group(1).lower()] = m.group(2).strip()
    return [f"{n}{pins.get(n, '')}" for n in names]


def dockerfile(recipe: Recipe, base: str, layout: Layout | None = None) -> str:
    """The Dockerfile text: base image, specdeploy installed without touching the image's CUDA packages; on
    trtllm-llmapi also TensorRT-LLM's llmapi model files of the image's release, staged for the container's start."""
    from specdeploy.core import backends
    from specdeploy.gpu import llmapi_upstream
    from specdeploy.gpu.llmapi_versions import LLMAPI_MIN_RC

    version = target_trtllm(recipe, layout)
    engines = backends.of(recipe).tensorrt_engines
    why, fix = (
        ("the engines were built with it", "rebuild the engines with the image's trtllm-build, or pass --image")
        if engines
        else ("the LLM-API option names differ between releases", "set trtllm_version, or pass --image")
    )
    # A release line's candidates before its first verified one use other option names (trtllm.LLMAPI_MIN_RC):
    # `trtllm_version: 1.3` accepts 1.3.0rc22 and later, not 1.3.0rc5.
    min_rc = 0 if engines else LLMAPI_MIN_RC.get(version, 0)
    extras = " ".join(f'"{r}"' for r in pinned_requirements())
    upstream = (
        ""
        if engines
        else f"""
# TensorRT-LLM's llmapi Triton model (model.py, helpers.py) of the image's own release; the container copies them into
# the repository as it starts (specdeploy serve --print-only prints that docker run).
RUN python3 -m specdeploy.gpu.llmapi_upstream {llmapi_upstream.STAGED_DIR}
"""
    )
    head = ""
    if recipe.draft.stages_head and layout is not None:
        # the models stay out of the image: they come from the project root, mounted at its own path
        head = (
            f"# The {recipe.draft.head_name} is not in the image: `specdeploy build` stages it in {layout.engine('draft')},"
            " under\n"
            "# the project root that `docker run -v` and the Kubernetes volume mount at the same path, where\n"
            "# speculative_config.speculative_model finds it.\n"
        )
    return f"""\
# Generated by specdeploy for recipe {recipe.name} (backend {recipe.backend}); rebuild after changing specdeploy.
#   docker build -t {image_tag(recipe, layout)} <this folder>
{head}FROM {base}

# The image must carry TensorRT-LLM {version}: {why}.
RUN python3 -c "import importlib.metadata as m, re, sys; v = m.version('tensorrt_llm'); \\
rc = re.search('rc([0-9]+)', v); \\
ok = (v == '{version}' or v.startswith('{version}.') or v.startswith('{version}rc')) and (rc is None or int(rc.group(1)) >= {min_rc}); \\
print('TensorRT-LLM in the image:', v); \\
sys.exit(0 if ok else 'the image has TensorRT-LLM ' + v + ', the recipe targets {version}: {fix}')"

COPY {SOURCE_DIR} /opt/specdeploy/src
# --no-deps: keep the image's CUDA builds of {", ".join(PROVIDED_BY_IMAGE)}.
RUN python3 -m pip install --no-cache-dir --no-deps /opt/specdeploy/src \\
 && python3 -m pip install --no-cache-dir {extras} \\
 && python3 -c "import specdeploy, specdeploy.recipe.config, specdeploy.triton.models.common; print('specdeploy', specdeploy.__file__)"
{upstream}"""


def _ignore(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n in ("__pycache__", "build", ".pytest_cache") or n.endswith((".pyc", ".so", ".o"))}


def write_context(recipe: Recipe, layout: Layout, image: str | None = None) -> Path:
    """Write engines/<recipe>/image/{Dockerfile, specdeploy-src/} FROM base_image(recipe, image); returns the
    context folder."""
    import specdeploy
    from specdeploy.core import backends

    base = base_image(recipe, image)
    if backends.of(recipe).tensorrt_engines:
        from specdeploy.gpu import triton_models as gpu_models

        # the repository names tensors for the engines' release: the image must carry that release's backend
        gpu_models.check_engine_image(base, target_trtllm(recipe, layout))
    package = Path(specdeploy.__file__).resolve().parent
    project = package.parent
    dest = image_context(layout)
    src = dest / SOURCE_DIR
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    shutil.copytree(package, src / "specdeploy", ignore=_ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (project / name).is_file():
            shutil.copyfile(project / name, src / name)
    if not (src / "pyproject.toml").is_file():  # an installed (non-editable) specdeploy: a minimal project file
        from importlib import metadata

        (src / "pyproject.toml").write_text(
            '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n\n'
            f'[project]\nname = "specdeploy"\nversion = "{metadata.version("specdeploy")}"\n'
            '\n[tool.setuptools.packages.find]\ninclude = ["specdeploy*"]\n\n[tool.setuptools.package-data]\n'
            '"*" = ["*"]\n'
        )
    (dest / "Dockerfile").write_text(dockerfile(recipe, base, layout))
    return dest


def build_command(recipe: Recipe, layout: Layout) -> list[str]:
    return ["docker", "build", "-t", image_tag(recipe, layout), str(image_context(layout))]
