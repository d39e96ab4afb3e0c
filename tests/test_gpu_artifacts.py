"""Every GPU recipe's generated artifacts against rules transcribed from NVIDIA's own validators and tables.

No GPU and no TensorRT-LLM here (its PyPI package is a stub), and its llm_args.py does not import on its own (it
imports torch, tensorrt_llm.bindings and tensorrt_llm._torch), so NVIDIA's pydantic models cannot run in a test:
their rules are transcribed below, each with the page or file and commit it is read from, and each is shown
failing on a broken artifact (test_every_rule_fails_on_a_broken_artifact).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from specdeploy.cli.main import main
from specdeploy.core import backends
from specdeploy.core.artifacts import Layout
from specdeploy.core.errors import ConfigError, ServerError
from specdeploy.gpu import image as packaging
from specdeploy.gpu import k8s as gpu_k8s
from specdeploy.gpu import launch, launch_command, llmapi_options, llmapi_upstream
from specdeploy.gpu import llmapi_repository as llmapi
from specdeploy.recipe.load import parse_recipe

BUILD = Path(__file__).resolve().parents[1] / "build"
LLMAPI_RECIPES = ("llama3-70b-fp8.yaml", "llama3.1-8b-eagle3.yaml")
TREE_RECIPE = "llama3.1-8b-eagle3-tree.yaml"
RELEASES = ("1.1", "1.2", "1.3", "1.4")

# ---------------------------------------------------------------- NVIDIA's rules, transcribed

# Triton's Release Compatibility Matrix, trtllm-python-py3 (triton-inference-server/server@6fa22ae
# docs/introduction/compatibility.md), the rows of the images the recipes can name: tag -> TensorRT-LLM.
MATRIX = {
    "25.03": "0.18.0",
    "25.12": "1.1.0",
    "26.01": "1.1.0",
    "26.02": "1.1.0",
    "26.03": "1.2.0",
    "26.04": "1.2.1",
    "26.07": "1.2.1",
}

# The fields of each release's speculative configs. DecodingBaseConfig and its subclasses are StrictBaseModel
# (llm_args.py@0004396: `from .utils import (StrictBaseModel, ...)`; every *DecodingConfig(DecodingBaseConfig)),
# which forbids other keys.
_BASE_13 = {
    "max_draft_len",
    "max_total_draft_tokens",
    "speculative_model",
    "max_concurrency",
    "draft_len_schedule",
    "load_format",
    "acceptance_rate_window_size",
    "acceptance_rate_threshold",
    "use_rejection_sampling",
    "allow_advanced_sampling",
    "advanced_sampling_mode",
    "enable_penalty",
    "decoding_type",
}
_NGRAM = {"max_matching_ngram_size", "is_keep_all", "is_use_oldest", "is_public_pool"}  # 1.4.0rc4 NGramDecodingConfig
_EAGLE3_13 = {
    "eagle_choices",
    "use_dynamic_tree",
    "dynamic_tree_max_topK",
    "num_eagle_layers",
    "max_non_leaves_per_layer",
    "eagle3_layers_to_capture",
    "eagle3_model_arch",
    "sa_config",
}
# SADecodingConfig, the standalone suffix automaton: 1.3.0rc27 and 1.4.0rc4 API pages
# (llm-api/reference/SADecodingConfig.html), llm_args.py@0004396; 1.1.0 / 1.2.0 have no "SA" key in from_dict
_SA = {"max_matching_ngram_size", "enable_global_pool", "global_pool_size"}
FIELDS = {
    # 1.1.0 / 1.2.0 llm_args.py (gh-pages 1.1.0 @8660c11, 1.2.0 @7e873e5 _modules/tensorrt_llm/llmapi/llm_args.html):
    # DecodingBaseConfig max_draft_len, speculative_model_dir, max_concurrency, load_format; 1.2 adds
    # draft_len_schedule and acceptance_window / acceptance_length_threshold; EagleDecodingConfig eagle3_one_model,
    # eagle3_layers_to_capture (only the fields read there are listed: a key outside them is unverified)
    "1.1": {
        "DraftTarget": {"decoding_type", "max_draft_len", "speculative_model_dir", "max_concurrency", "load_format"}
    },
    "1.2": {
        "DraftTarget": {
            "decoding_type",
            "max_draft_len",
            "speculative_model_dir",
            "speculative_model",
            "max_concurrency",
            "load_format",
            "draft_len_schedule",
            "acceptance_window",
            "acceptance_length_threshold",
        }
    },
    # 1.3.0rc27 API pages llm-api/reference/Eagle3DecodingConfig.html and DFlashDecodingConfig.html (the base
    # fields every config shares, then the Eagle3 ones)
    "1.3": {
        "Draft_Target": _BASE_13,
        "NGram": _BASE_13 | _NGRAM,
        "Eagle3": _BASE_13 | _EAGLE3_13,
        "SA": _BASE_13 | _SA,
    },
    # 1.4.0rc1 Eagle3DecodingConfig.html: the 1.3 fields plus moe_backend and spec_dec_variant
    "1.4": {
        "Draft_Target": _BASE_13 | {"moe_backend", "spec_dec_variant"},
        "NGram": _BASE_13 | _NGRAM | {"moe_backend", "spec_dec_variant"},
        "Eagle3": _BASE_13 | _EAGLE3_13 | {"moe_backend", "spec_dec_variant"},
        "SA": _BASE_13 | _SA | {"moe_backend", "moe_tactic", "spec_dec_variant"},  # 1.4.0rc4 SADecodingConfig.html
    },
}
for _release in ("1.1", "1.2"):
    _base = FIELDS[_release]["DraftTarget"]
    FIELDS[_release]["NGram"] = (_base - {"speculative_model_dir", "speculative_model"}) | _NGRAM
    FIELDS[_release]["Eagle"] = _base | {"eagle3_one_model", "eagle3_layers_to_capture"}
    # AutoDecodingConfig(DecodingBaseConfig), no field of its own ("AUTO" in both from_dict tables)
    FIELDS[_release]["AUTO"] = _base
# AutoDecodingConfig: the base fields only (1.3.0rc29 AutoDecodingConfig.html; llm_args.py@0004396 for 1.4)
FIELDS["1.3"]["AUTO"] = _BASE_13
FIELDS["1.4"]["AUTO"] = _BASE_13 | {"moe_backend", "spec_dec_variant"}
# MTPDecodingConfig: 1.1.0 / 1.2.0 llm_args.py (gh-pages @8660c11 / @7e873e5), 1.3.0rc27 / 1.4.0rc1 pages
_MTP = {"use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta", "use_mtp_vanilla"}
FIELDS["1.1"]["MTP"] = (
    FIELDS["1.1"]["AUTO"]
    | _MTP
    | {
        "num_nextn_predict_layers",
        "mtp_eagle_one_model",
        "num_nextn_predict_layers_from_model_config",
        "BEGIN_THINKING_PHASE_TOKEN",
        "END_THINKING_PHASE_TOKEN",
    }
)
FIELDS["1.2"]["MTP"] = (
    FIELDS["1.2"]["AUTO"]
    | _MTP
    | {
        "num_nextn_predict_layers",
        "mtp_eagle_one_model",
        "num_nextn_predict_layers_from_model_config",
        "begin_thinking_phase_token",
        "end_thinking_phase_token",
    }
)
_MTP_13 = _MTP | {
    "use_dynamic_tree",
    "dynamic_tree_max_topK",
    "sa_config",
    "num_nextn_predict_layers",
    "begin_thinking_phase_token",
    "end_thinking_phase_token",
}
FIELDS["1.3"]["MTP"] = _BASE_13 | _MTP_13
FIELDS["1.4"]["MTP"] = _BASE_13 | _MTP_13 | {"moe_backend", "spec_dec_variant"}
# DFlashDecodingConfig: 1.3.0rc27 DFlashDecodingConfig.html (1.4: main's llm_args.py@0004396); PARDDecodingConfig:
# 1.4.0rc1 / rc4 PARDDecodingConfig.html (no 1.3 page found)
FIELDS["1.3"]["DFlash"] = _BASE_13 | {"mask_token_id", "target_layer_ids", "attention_backend"}
FIELDS["1.4"]["DFlash"] = FIELDS["1.3"]["DFlash"] | {"moe_backend", "spec_dec_variant"}
FIELDS["1.4"]["PARD"] = _BASE_13 | {"mask_token_id", "sa_config", "moe_backend", "spec_dec_variant"}


def rule_extra_keys(spec: dict, release: str) -> list[str]:
    """StrictBaseModel: no key outside the release's config (FIELDS)."""
    allowed = FIELDS[release].get(spec.get("decoding_type"))
    if allowed is None:
        return [f"decoding_type {spec.get('decoding_type')!r} is not one of {release}'s {sorted(FIELDS[release])}"]
    return [f"key {k!r} is not a field of {release}'s {spec['decoding_type']} config" for k in spec if k not in allowed]


def rule_exclusive(spec: dict, release: str) -> list[str]:
    """Mutually exclusive fields. max_concurrency with an upper-bound draft_len_schedule (PR #10860, as
    llmapi_versions cites it); sa_config only on Eagle3 in the 1.3.0rc27 / 1.4.0rc1 pages (MTP's aside)."""
    out = []
    if release in ("1.3", "1.4") and "max_concurrency" in spec and "draft_len_schedule" in spec:
        out.append("max_concurrency and draft_len_schedule are mutually exclusive")
    if "sa_config" in spec and spec.get("decoding_type") not in ("Eagle3", "PARD", "MTP"):
        out.append("sa_config is an Eagle3DecodingConfig field (and PARD's, MTP's)")
    if spec.get("use_rejection_sampling") and "sa_config" in spec:
        out.append("use_rejection_sampling with sa_config")
    if "global_pool_size" in spec and not spec.get("enable_global_pool"):  # SADecodingConfig.validate_sa_config
        out.append("global_pool_size requires enable_global_pool=True")
    return out


def rule_ranges(spec: dict, release: str) -> list[str]:
    """The ranges of the 1.3.0rc27 / 1.4.0rc1 signatures: max_draft_len Ge(0), max_concurrency Gt(0),
    acceptance_rate_window_size Ge(0), acceptance_rate_threshold Ge(0) Le(1); SAEnhancerConfig.threshold PositiveInt
    (llm_args.py@0004396 as llmapi_versions cites it); NGram max_matching_ngram_size Gt(0) (1.4.0rc4 page)."""
    out = []
    checks = {
        "max_draft_len": lambda v: v >= 0,
        "max_concurrency": lambda v: v > 0,
        "acceptance_rate_window_size": lambda v: v >= 0,
        "acceptance_rate_threshold": lambda v: 0 <= v <= 1,
        "max_matching_ngram_size": lambda v: v > 0,
    }
    if spec.get("decoding_type") == "MTP" and release in ("1.3", "1.4"):  # PositiveInt, NonNegativeFloat (pages)
        checks["relaxed_topk"] = lambda v: v > 0
        checks["relaxed_delta"] = lambda v: v >= 0
    if spec.get("decoding_type") == "SA":  # llm_args.py@0004396 SADecodingConfig.validate_sa_config
        checks["max_draft_len"] = lambda v: v > 0
        pooled = spec.get("enable_global_pool")
        checks["max_matching_ngram_size"] = lambda v: v == -1 or (1 <= v <= 64 if pooled else v > 0)
        checks["global_pool_size"] = lambda v: v >= 1
    for key, ok in checks.items():
        if key in spec and not ok(spec[key]):
            out.append(f"{key} {spec[key]} out of range")
    if "sa_config" in spec and not spec["sa_config"]["threshold"] > 0:
        out.append("sa_config.threshold must be a positive int")
    if spec.get("use_dynamic_tree"):  # model_drafter.py@0859050: `assert max_draft_len <= max_total_draft_tokens`
        if not spec.get("dynamic_tree_max_topK", 0) >= 1:
            out.append("dynamic_tree_max_topK must be >= 1")
        if not spec["max_draft_len"] <= spec.get("max_total_draft_tokens", -1):
            out.append("max_total_draft_tokens must be >= max_draft_len")
    schedule = spec.get("draft_len_schedule")
    if schedule and release in ("1.3", "1.4") and spec["max_draft_len"] != schedule[min(schedule)]:
        out.append("draft_len_schedule's smallest key must draft max_draft_len (PR #10860)")
    return out


def rule_image(dockerfile: str, release: str) -> list[str]:
    """The Dockerfile's base carries the recipe's release (MATRIX); a non-NGC base is left to its version gate."""
    base = re.search(r"^FROM (\S+)$", dockerfile, re.M).group(1)
    m = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d\d\.\d\d)-trtllm-python-py3", base)
    if m is None:
        return [] if "m.version('tensorrt_llm')" in dockerfile else [f"{base}: no version gate"]
    carried = MATRIX.get(m.group(1))
    if carried is None or carried.split(".")[: len(release.split("."))] != release.split("."):
        return [f"{base} carries TensorRT-LLM {carried}, not {release}"]
    return []


def rule_repository(repo: Path) -> list[str]:
    """TensorRT-LLM's llmapi model folder (triton_backend/all_models/llmapi/tensorrt_llm/: config.pbtxt,
    1/model.py, 1/helpers.py, 1/model.yaml at NVIDIA/TensorRT-LLM@fab2f90 / @b35ac1b / @c8c6df0) for both models."""
    want = ("config.pbtxt", "1/model.py", "1/helpers.py", "1/model.yaml")
    return [f"{m}/{f} missing" for m in llmapi.MODELS for f in want if not (repo / m / f).is_file()]


SPEC_RULES = (rule_extra_keys, rule_exclusive, rule_ranges)


# ---------------------------------------------------------------- the recipes' artifacts


def gpu_recipe(name: str, release: str, **changes):
    raw = yaml.safe_load((BUILD / name).read_text())
    raw["trtllm_version"] = release
    if release in ("1.3", "1.4"):  # no NGC image carries them: an image built with the release
        raw["image"] = f"registry.example.com/tritonserver-trtllm:{release}"
    raw.update(changes)
    return parse_recipe(raw)


VARIANTS = [(name, release) for name in LLMAPI_RECIPES for release in RELEASES]


def spec_of(recipe, tmp_path) -> dict:
    return llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))["speculative_config"]


@pytest.mark.parametrize(("name", "release"), VARIANTS)
def test_each_gpu_recipes_options_pass_nvidias_rules(name, release, tmp_path):
    recipe = gpu_recipe(name, release)
    spec = spec_of(recipe, tmp_path)
    assert [v for rule in SPEC_RULES for v in rule(spec, release)] == []
    ngram = gpu_recipe(name, release, draft={"kind": "ngram"}, speculative={"max_draft_len": 4, "num_draft_tokens": 4})
    assert [v for rule in SPEC_RULES for v in rule(spec_of(ngram, tmp_path), release)] == []
    if release in ("1.3", "1.4"):  # with what the release adds: the schedule, the gate, rejection sampling
        rich = gpu_recipe(
            name,
            release,
            speculative={
                "max_draft_len": 3,
                "num_draft_tokens": 3,
                "use_draft_logits": True,
                "dynamic": {
                    "draft_len_schedule": [[4, 3], [8, 1]],
                    "acceptance_window": 16,
                    "acceptance_threshold": 0.3,
                },
            },
        )
        rich_spec = spec_of(rich, tmp_path)
        assert rich_spec["use_rejection_sampling"] is True
        assert [v for rule in SPEC_RULES for v in rule(rich_spec, release)] == []


@pytest.mark.parametrize(("name", "release"), VARIANTS)
def test_each_gpu_recipes_image_carries_its_release(name, release, tmp_path):
    recipe = gpu_recipe(name, release)
    layout = Layout.of(recipe, tmp_path)
    text = packaging.dockerfile(recipe, packaging.base_image(recipe), layout)
    assert rule_image(text, release) == []
    if release in ("1.1", "1.2"):  # an NGC image, the newest carrying it
        tag = {"1.1": "26.02", "1.2": "26.07"}[release]
        assert f"FROM nvcr.io/nvidia/tritonserver:{tag}-trtllm-python-py3" in text
    assert f"RUN python3 -m specdeploy.gpu.llmapi_upstream {llmapi_upstream.STAGED_DIR}" in text


BROKEN_SPECS = [  # (rule, release, a broken speculative_config)
    (
        rule_extra_keys,
        "1.2",
        {
            "decoding_type": "DraftTarget",
            "max_draft_len": 3,
            "speculative_model_dir": "d",
            "use_rejection_sampling": True,
        },
    ),  # 1.2 has no such key
    (
        rule_extra_keys,
        "1.4",
        {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "h", "eagle3_one_model": True},
    ),  # not on the 1.4.0rc1 page
    (rule_extra_keys, "1.3", {"decoding_type": "Eagle", "max_draft_len": 3}),  # 1.3 spells it Eagle3
    (
        rule_exclusive,
        "1.4",
        {"decoding_type": "Draft_Target", "max_draft_len": 4, "max_concurrency": 2, "draft_len_schedule": {4: 4}},
    ),
    (rule_exclusive, "1.4", {"decoding_type": "Draft_Target", "max_draft_len": 4, "sa_config": {"threshold": 4}}),
    (
        rule_exclusive,
        "1.4",
        {"decoding_type": "Eagle3", "max_draft_len": 4, "use_rejection_sampling": True, "sa_config": {"threshold": 4}},
    ),
    (rule_ranges, "1.4", {"decoding_type": "Draft_Target", "max_draft_len": -1}),
    (rule_ranges, "1.4", {"decoding_type": "Draft_Target", "max_draft_len": 4, "max_concurrency": 0}),
    (rule_ranges, "1.3", {"decoding_type": "Draft_Target", "max_draft_len": 4, "acceptance_rate_threshold": 1.5}),
    (rule_ranges, "1.3", {"decoding_type": "Draft_Target", "max_draft_len": 4, "acceptance_rate_window_size": -1}),
    (rule_ranges, "1.4", {"decoding_type": "Eagle3", "max_draft_len": 4, "sa_config": {"threshold": 0}}),
    (rule_ranges, "1.4", {"decoding_type": "NGram", "max_draft_len": 4, "max_matching_ngram_size": 0}),
    (rule_ranges, "1.4", {"decoding_type": "Draft_Target", "max_draft_len": 4, "draft_len_schedule": {4: 2, 8: 1}}),
    (
        rule_ranges,
        "1.4",
        {
            "decoding_type": "Eagle3",
            "max_draft_len": 4,
            "use_dynamic_tree": True,
            "dynamic_tree_max_topK": 4,
            "max_total_draft_tokens": 3,
        },
    ),
    (
        rule_ranges,
        "1.4",
        {
            "decoding_type": "Eagle3",
            "max_draft_len": 4,
            "use_dynamic_tree": True,
            "dynamic_tree_max_topK": 0,
            "max_total_draft_tokens": 8,
        },
    ),
    (rule_extra_keys, "1.2", {"decoding_type": "Eagle", "max_draft_len": 4, "use_dynamic_tree": True}),
    (rule_extra_keys, "1.2", {"decoding_type": "SA", "max_draft_len": 4}),  # no SA before 1.3
    (rule_extra_keys, "1.4", {"decoding_type": "SA", "max_draft_len": 4, "is_keep_all": True}),  # NGram's, not SA's
    (rule_ranges, "1.4", {"decoding_type": "SA", "max_draft_len": 4, "max_matching_ngram_size": 0}),
    (rule_ranges, "1.4", {"decoding_type": "SA", "max_draft_len": 0, "max_matching_ngram_size": -1}),
    (
        rule_ranges,
        "1.3",
        {"decoding_type": "SA", "max_draft_len": 4, "max_matching_ngram_size": 65, "enable_global_pool": True},
    ),
    (rule_exclusive, "1.4", {"decoding_type": "SA", "max_draft_len": 4, "global_pool_size": 64}),
    (rule_extra_keys, "1.2", {"decoding_type": "AUTO", "max_matching_ngram_size": 3}),  # NGram's, not AUTO's
    (rule_extra_keys, "1.1", {"decoding_type": "MTP", "num_nextn_predict_layers": 1, "begin_thinking_phase_token": 1}),
    (rule_ranges, "1.4", {"decoding_type": "MTP", "max_draft_len": 1, "relaxed_topk": 0}),
    (rule_ranges, "1.3", {"decoding_type": "MTP", "max_draft_len": 1, "relaxed_delta": -0.1}),
    (rule_extra_keys, "1.3", {"decoding_type": "PARD", "max_draft_len": 4, "speculative_model": "p"}),  # no 1.3 page
    (rule_extra_keys, "1.4", {"decoding_type": "DFlash", "max_draft_len": 4, "sa_config": {"threshold": 4}}),
]


@pytest.mark.parametrize(("rule", "release", "spec"), BROKEN_SPECS, ids=lambda x: getattr(x, "__name__", None))
def test_every_rule_fails_on_a_broken_artifact(rule, release, spec):
    assert rule(spec, release), f"{rule.__name__} let {spec} through"


def test_the_image_rule_fails_on_a_broken_dockerfile(tmp_path):
    recipe = gpu_recipe("llama3-70b-fp8.yaml", "1.2")
    text = packaging.dockerfile(recipe, packaging.base_image(recipe), Layout.of(recipe, tmp_path))
    assert rule_image(text.replace(":26.07-", ":25.12-"), "1.2") == [
        "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3 carries TensorRT-LLM 1.1.0, not 1.2"
    ]
    custom = text.replace("nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3", "mine:1")
    assert rule_image(custom, "1.2") == []  # its version gate checks it at docker build
    assert rule_image(re.sub(r"RUN python3 -c \"import importlib.*?\n\n", "", custom, flags=re.S), "1.2")


# ---------------------------------------------------------------- the image/release match, where the user meets it


def test_check_refuses_an_image_that_carries_another_release(tmp_path):
    raw = yaml.safe_load((BUILD / "llama3-70b-fp8.yaml").read_text())
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({**raw, "image": "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"}))
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "check", str(path)])
    assert result.exit_code != 0
    assert "carries TensorRT-LLM 1.1.0" in result.output and "trtllm_version 1.2" in result.output
    assert "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3" in result.output  # the fix names the image
    path.write_text(yaml.safe_dump({**raw, "trtllm_version": "1.4"}))  # no NGC image carries 1.4
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "check", str(path)])
    assert result.exit_code != 0 and "no NGC Triton image carries TensorRT-LLM 1.4" in result.output


@pytest.mark.parametrize("name", ["llama3-70b-fp8.yaml", "llama3.1-8b-eagle3.yaml", "llama3-70b-fp8-engine.yaml"])
def test_serve_print_only_refuses_a_mismatched_image_on_every_path(name, tmp_path):
    recipe_path = str(BUILD / name)
    wrong = "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"  # 1.1.0: neither the llmapi 1.2 nor engines' 0.18
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", recipe_path, "--print-only", "--image", wrong])
    assert result.exit_code != 0 and "carries TensorRT-LLM 1.1.0" in result.output, result.output
    result = CliRunner().invoke(main, ["--root", str(tmp_path), "serve", recipe_path, "--print-only"])
    assert result.exit_code == 0, result.output
    dockerfile = next(tmp_path.glob("engines/*/image/Dockerfile")).read_text()
    assert rule_image(dockerfile, "0.18" if "engine" in name else "1.2") == []


def test_the_image_table_is_the_matrix():
    from specdeploy.core import trtllm_images

    assert {tag: trtllm_images.IMAGE_TRTLLM[tag] for tag in MATRIX} == MATRIX
    assert trtllm_images.image_for("1.2") == "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"
    assert trtllm_images.image_for("1.2.0") == "nvcr.io/nvidia/tritonserver:26.03-trtllm-python-py3"
    assert trtllm_images.image_for("1.1") == "nvcr.io/nvidia/tritonserver:26.02-trtllm-python-py3"
    with pytest.raises(ConfigError, match="no NGC Triton image carries TensorRT-LLM 1.3"):
        trtllm_images.image_for("1.3")
    assert not trtllm_images.carries("1.2.1", "1.2.0") and trtllm_images.carries("1.2.1", "1.2")
    assert not trtllm_images.carries("1.20.0", "1.2")


# ---------------------------------------------------------------- the repository's files


def test_the_container_start_gives_the_repository_the_images_model_files(tmp_path, monkeypatch):
    """The generated repository (model.yaml, config.pbtxt) plus what the container's start copies in from the image:
    NVIDIA's llmapi model folder, complete; without the copy the repository rule fails."""
    recipe = gpu_recipe("llama3-70b-fp8.yaml", "1.2")
    layout = Layout.of(recipe, tmp_path / "project")
    for model in llmapi.MODELS:  # what `specdeploy repo` writes on a GPU backend (tests/test_trtllm_repo.py)
        (Path(layout.repo) / model / "1").mkdir(parents=True)
        (Path(layout.repo) / model / "config.pbtxt").write_text('backend: "python"\n')
        (Path(layout.repo) / model / "1" / "model.yaml").write_text("model: t\n")
    assert rule_repository(Path(layout.repo)) == [
        f"{m}/1/{f} missing" for m in llmapi.MODELS for f in ("model.py", "helpers.py")
    ]
    staged = tmp_path / "image" / "opt-specdeploy-llmapi"
    image_copy = _image_copy(tmp_path)
    assert llmapi_upstream.stage(staged, "1.2.1", image_copy=image_copy) == str(image_copy)  # no download
    monkeypatch.setattr(llmapi_upstream, "STAGED_DIR", str(staged))
    plan = launch_command.launch_plan(recipe, layout)
    command = launch_command.docker_command(plan, recipe, layout)
    start = command[command.index(packaging.image_tag(recipe)) + 1 :]
    assert start[:2] == ["sh", "-c"] and start[4:] == plan.command
    done = subprocess.run([*start[:4], "true"], capture_output=True, text=True, timeout=60)  # the copy, then exec
    assert done.returncode == 0, done.stderr
    assert rule_repository(Path(layout.repo)) == []
    assert (Path(layout.repo) / "tensorrt_llm_control" / "1" / "helpers.py").read_text() == "# image helpers.py\n"
    k8s = [d for d in yaml.safe_load_all(gpu_k8s.k8s_yaml(recipe, layout)) if d][0]
    assert k8s["spec"]["template"]["spec"]["containers"][0]["command"] == start


def _image_copy(tmp_path) -> Path:
    """An image's /app/all_models/llmapi/tensorrt_llm/1 (tensorrtllm_backend's Dockerfile copies it there)."""
    copy_dir = tmp_path / "image" / "app-all_models"
    copy_dir.mkdir(parents=True)
    (copy_dir / "model.py").write_text("# image model.py\n")
    (copy_dir / "helpers.py").write_text("# image helpers.py\n")
    return copy_dir


def test_staging_fetches_the_release_tag_when_the_image_has_no_copy(tmp_path):
    """An image without /app/all_models gets the files at TensorRT-LLM's v<release> tag: here a loopback server
    stands in for raw.githubusercontent.com, answering only the tag's two paths."""
    import http.server
    import threading

    asked = []

    class Tag(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            body = f"# {self.path.rsplit('/', 1)[1]} at {self.path.split('/')[1]}\n".encode()
            self.send_response(200 if self.path.startswith("/v1.2.1/" + llmapi_upstream.UPSTREAM_DIR) else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Tag)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/v{{version}}/{llmapi_upstream.UPSTREAM_DIR}/{{file}}"
        llmapi_upstream.stage(tmp_path / "staged", "1.2.1", image_copy=tmp_path / "absent", url=url)
    finally:
        server.shutdown()
        server.server_close()
    assert asked == [f"/v1.2.1/{llmapi_upstream.UPSTREAM_DIR}/{f}" for f in llmapi_upstream.UPSTREAM_FILES]
    assert (tmp_path / "staged" / "helpers.py").read_text() == "# helpers.py at v1.2.1\n"
    assert (
        llmapi_upstream.RELEASE_URL.format(version="1.2.1", file="model.py")
        == "https://raw.githubusercontent.com/NVIDIA/TensorRT-LLM/v1.2.1/triton_backend/all_models/llmapi/tensorrt_llm/1/"
        "model.py"
    )


def test_a_start_outside_the_image_refuses_a_repository_without_the_model_files(tmp_path):
    recipe = gpu_recipe("llama3-70b-fp8.yaml", "1.2")
    layout = Layout.of(recipe, tmp_path)
    for model in llmapi.MODELS:
        (Path(layout.repo) / model / "1").mkdir(parents=True)
    exe = tmp_path / "tritonserver"
    exe.write_text("#!/bin/sh\nexit 3\n")
    exe.chmod(0o755)
    with pytest.raises(ServerError, match="lacks TensorRT-LLM's llmapi model files: tensorrt_llm/1/model.py") as err:
        launch.start(recipe, layout, str(exe), tmp_path / "log")
    assert "--trtllm-src" in err.value.hint and "serve --print-only" in err.value.hint
    assert not (tmp_path / "log").exists()  # refused before anything started


def test_repo_trtllm_src_is_for_the_gpu_llmapi_model_only(tmp_path):
    from specdeploy.deploy import backend_stages

    cpu = parse_recipe({"name": "c", "target": {"model": "t"}, "draft": {"kind": "ngram"}})
    with pytest.raises(ConfigError, match="--trtllm-src is for TensorRT-LLM's llmapi model"):
        backend_stages.of(cpu).write_repository(cpu, Layout.of(cpu, tmp_path), trtllm_src=tmp_path)


def test_broken_spec_copies_are_independent():
    # the broken artifacts above are literals; the rules must not mutate them (a rule run twice says the same)
    for rule, release, spec in BROKEN_SPECS:
        before = copy.deepcopy(spec)
        assert rule(spec, release) == rule(spec, release) and spec == before


def test_a_draft_mapping_of_its_own_is_refused_on_the_llm_api(tmp_path):
    """No speculative config of any release has a tp/pp field (FIELDS): the draft runs in the LLM's mapping."""
    assert not {
        k
        for fields in FIELDS.values()
        for keys in fields.values()
        for k in keys
        if "parallel" in k or k in ("tp_size", "pp_size")
    }
    with pytest.raises(ConfigError, match="draft runs in the target's mapping") as err:
        gpu_recipe("llama3-70b-fp8.yaml", "1.2", draft={"model": "d", "tp_size": 2})
    assert "remove draft.tp_size" in err.value.hint
    same = gpu_recipe("llama3-70b-fp8.yaml", "1.2")
    assert gpu_recipe("llama3-70b-fp8.yaml", "1.2", draft={"model": "d", "tp_size": same.target.tp_size}).draft.tp_size


def test_the_overlap_scheduler_stays_on_for_eagle3_only(tmp_path):
    eagle3 = gpu_recipe("llama3.1-8b-eagle3.yaml", "1.2")
    assert llmapi_options.llmapi_options(eagle3, Layout.of(eagle3, tmp_path))["disable_overlap_scheduler"] is False
    pair = gpu_recipe("llama3-70b-fp8.yaml", "1.2")
    assert llmapi_options.llmapi_options(pair, Layout.of(pair, tmp_path))["disable_overlap_scheduler"] is True


# ---------------------------------------------------------------- EAGLE-3 dynamic trees (draft.tree)


@pytest.mark.parametrize("release", RELEASES)
def test_the_tree_recipe_writes_a_dynamic_tree_where_the_release_has_one(release, tmp_path):
    """draft.tree -> use_dynamic_tree, dynamic_tree_max_topK, max_total_draft_tokens (1.3.0rc27 / 1.4.0rc1 pages);
    1.1 and 1.2 were not read for them: refused, never dropped."""
    recipe = gpu_recipe(TREE_RECIPE, release)
    if release in ("1.1", "1.2"):
        with pytest.raises(ConfigError, match=f"use_dynamic_tree is not verified for TensorRT-LLM {release}"):
            spec_of(recipe, tmp_path)
        return
    spec = spec_of(recipe, tmp_path)
    assert {
        k: spec[k] for k in ("use_dynamic_tree", "dynamic_tree_max_topK", "max_total_draft_tokens", "max_draft_len")
    } == {"use_dynamic_tree": True, "dynamic_tree_max_topK": 4, "max_total_draft_tokens": 8, "max_draft_len": 3}
    assert [v for rule in SPEC_RULES for v in rule(spec, release)] == []
    dockerfile = packaging.dockerfile(recipe, packaging.base_image(recipe), Layout.of(recipe, tmp_path))
    assert f"FROM {recipe.image}\n" in dockerfile and rule_image(dockerfile, release) == []
    assert (
        yaml.safe_load((BUILD / TREE_RECIPE).read_text())["image"] == "registry.example.com/tritonserver-trtllm:1.4.0"
    )


def _tree(**tree):
    return {"kind": "eagle3", "head": "/models/head", "max_draft_len": 3, "tree": tree}


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"max_topk": 4, "max_total_draft_tokens": 2}, r"max_total_draft_tokens' is 2, outside \[3, 12\]"),
        ({"max_topk": 2, "max_total_draft_tokens": 7}, r"max_total_draft_tokens' is 7, outside \[3, 6\]"),
        ({"max_topk": 0, "max_total_draft_tokens": 3}, "max_topk' is 0, must be >= 1"),
    ],
)
def test_a_tree_outside_its_bounds_is_refused(tree, message):
    with pytest.raises(ConfigError, match=message):
        gpu_recipe(TREE_RECIPE, "1.4", draft=_tree(**tree))
    gpu_recipe(TREE_RECIPE, "1.4", draft=_tree(max_topk=2, max_total_draft_tokens=6))  # the bounds themselves pass
    gpu_recipe(TREE_RECIPE, "1.4", draft=_tree(max_topk=2, max_total_draft_tokens=3))


def test_a_tree_with_the_suffix_automaton_or_on_the_cpu_is_refused():
    with pytest.raises(ConfigError, match="'draft.tree' and 'draft.sa_config' are both set"):
        gpu_recipe(TREE_RECIPE, "1.4", draft={**_tree(max_topk=4, max_total_draft_tokens=8), "sa_config": {}})
    raw = yaml.safe_load((BUILD / "smollm2-135m-eagle3.yaml").read_text())
    raw["draft"]["tree"] = {"max_topk": 2, "max_total_draft_tokens": 6}
    with pytest.raises(ConfigError, match="0.77-1.02x the chain's speed") as err:
        parse_recipe(raw)
    assert "backend trtllm-llmapi" in err.value.hint
    with pytest.raises(ConfigError, match="'draft.tree' applies to draft.kind eagle3 only"):
        gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft={"model": "d", "tree": {"max_topk": 2}})


# ---------------------------------------------------------------- the standalone suffix automaton (draft.kind suffix)


@pytest.mark.parametrize("release", RELEASES)
def test_the_suffix_kind_writes_sa_where_the_release_has_it(release, tmp_path):
    """draft.kind suffix -> SADecodingConfig (1.3.0rc27 / 1.4.0rc4 pages); 1.1 and 1.2 have no SA decoding type:
    refused, naming the releases that have it."""
    suffix = {"kind": "suffix", "max_matching_ngram_size": 8}
    recipe = gpu_recipe("llama3-70b-fp8.yaml", release, draft=suffix)
    if release in ("1.1", "1.2"):
        with pytest.raises(ConfigError, match=f"SADecodingConfig, which TensorRT-LLM {release} does not have") as err:
            spec_of(recipe, tmp_path)
        assert err.value.hint == "set trtllm_version to 1.3 or 1.4"
        return
    options = llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))
    spec = options["speculative_config"]
    n = recipe.speculative.num_draft_tokens
    assert spec == {
        "decoding_type": "SA",
        "max_draft_len": n,
        "max_matching_ngram_size": 8,
        "enable_global_pool": False,
    }
    assert options["disable_overlap_scheduler"] is False  # SADecodingConfig: "supports ... overlap scheduler"
    assert [v for rule in SPEC_RULES for v in rule(spec, release)] == []
    pooled = gpu_recipe(
        "llama3-70b-fp8.yaml", release, draft={"kind": "suffix", "enable_global_pool": True, "global_pool_size": 64}
    )
    pooled_spec = spec_of(pooled, tmp_path)
    assert pooled_spec["global_pool_size"] == 64 and pooled_spec["max_matching_ngram_size"] == -1
    assert [v for rule in SPEC_RULES for v in rule(pooled_spec, release)] == []


def test_check_reports_the_suffix_refusal_on_an_old_release():
    from specdeploy.deploy import preflight

    (finding,) = preflight.check_llmapi_options(gpu_recipe("llama3-70b-fp8.yaml", "1.2", draft={"kind": "suffix"}))
    assert finding.level == "error" and "SADecodingConfig" in finding.message
    (finding,) = preflight.check_llmapi_options(gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft={"kind": "suffix"}))
    assert finding.level == "info" and "decoding_type SA" in finding.message


# ---------------------------------------------------------------- AUTO (draft.kind auto)


@pytest.mark.parametrize("release", RELEASES)
def test_the_auto_kind_writes_auto_on_every_release(release, tmp_path):
    """draft.kind auto -> {decoding_type: AUTO} alone (AutoDecodingConfig ignores the base fields), NGram's overlap
    scheduler setting; the check names what it does with num_draft_tokens."""
    from specdeploy.deploy import preflight

    recipe = gpu_recipe("llama3-70b-fp8.yaml", release, draft={"kind": "auto"})
    options = llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))
    assert options["speculative_config"] == {"decoding_type": "AUTO"}
    assert options["disable_overlap_scheduler"] is True  # it picks an NGram draft (auto_heuristic.py@7274a59)
    assert [v for rule in SPEC_RULES for v in rule(options["speculative_config"], release)] == []
    (finding,) = preflight.check_llmapi_options(recipe)
    assert finding.level == "info" and "num_draft_tokens is not passed" in finding.message


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"draft": {"kind": "auto", "max_draft_len": 3}}, "does not apply to draft.kind auto"),
        ({"draft": {"kind": "auto", "model": "d"}}, "does not apply to draft.kind auto"),
        (
            {"draft": {"kind": "auto"}, "speculative": {"dynamic": {"max_concurrency": 8}}},
            "AutoDecodingConfig ignores the settings",
        ),
        (
            {"draft": {"kind": "auto"}, "speculative": {"use_draft_logits": True}},
            "AutoDecodingConfig ignores the settings",
        ),
    ],
)
def test_auto_refuses_settings_it_would_drop(changes, words):
    with pytest.raises(ConfigError, match=words):
        gpu_recipe("llama3-70b-fp8.yaml", "1.4", **changes)


def test_auto_on_the_cpu_is_refused_with_what_it_would_pick():
    raw = yaml.safe_load((BUILD / "smollm2-135m-ngram.yaml").read_text())
    raw["draft"] = {"kind": "auto"}
    with pytest.raises(ConfigError, match="a choice TensorRT-LLM's LLM API makes when it starts") as err:
        parse_recipe(raw)
    assert "draft.kind ngram, max_draft_len 5, max_matching_ngram_size 3" in err.value.hint  # max_batch_size 4
    raw["engine"]["max_batch_size"] = 8
    with pytest.raises(ConfigError) as err:
        parse_recipe(raw)
    assert "max_draft_len 3, max_matching_ngram_size 5" in err.value.hint and "trtllm-llmapi" in err.value.hint


# ---------------------------------------------------------------- MTP (draft.kind mtp)


def _mtp_target(tmp_path, **config) -> str:
    folder = tmp_path / "target"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], **config}))
    return str(folder)


@pytest.mark.parametrize("release", RELEASES)
def test_the_mtp_kind_writes_the_releases_keys(release, tmp_path):
    """draft.kind mtp -> MTPDecodingConfig: the draft length as num_nextn_predict_layers on 1.1 / 1.2 (from_dict
    copies it into max_draft_len), max_draft_len on 1.3 / 1.4; relaxed acceptance only when asked, with the thinking
    tokens in 1.1's upper-case spelling there."""
    relaxed = {
        "kind": "mtp",
        "max_draft_len": 3,
        "use_relaxed_acceptance_for_thinking": True,
        "relaxed_topk": 10,
        "relaxed_delta": 0.01,
        "begin_thinking_phase_token": 151667,
        "end_thinking_phase_token": 151668,
    }
    plain = gpu_recipe("llama3-70b-fp8.yaml", release, draft={"kind": "mtp", "max_draft_len": 3})
    options = llmapi_options.llmapi_options(plain, Layout.of(plain, tmp_path))
    key = "num_nextn_predict_layers" if release in ("1.1", "1.2") else "max_draft_len"
    assert options["speculative_config"] == {"decoding_type": "MTP", key: 3}
    assert options["disable_overlap_scheduler"] is False  # support_overlap_scheduler: is_mtp in every version read
    spec = spec_of(gpu_recipe("llama3-70b-fp8.yaml", release, draft=relaxed), tmp_path)
    begin, end = (
        ("BEGIN_THINKING_PHASE_TOKEN", "END_THINKING_PHASE_TOKEN")
        if release == "1.1"
        else ("begin_thinking_phase_token", "end_thinking_phase_token")
    )
    assert spec == {
        "decoding_type": "MTP",
        key: 3,
        "use_relaxed_acceptance_for_thinking": True,
        "relaxed_topk": 10,
        "relaxed_delta": 0.01,
        begin: 151667,
        end: 151668,
    }
    for s in (options["speculative_config"], spec):
        assert [v for rule in SPEC_RULES for v in rule(s, release)] == []


@pytest.mark.parametrize(
    ("draft", "words"),
    [
        ({"kind": "mtp", "relaxed_topk": 4}, "only acts with use_relaxed_acceptance_for_thinking"),
        ({"kind": "mtp", "use_relaxed_acceptance_for_thinking": True, "relaxed_topk": 0}, "relaxed_topk' is 0"),
        ({"kind": "mtp", "use_relaxed_acceptance_for_thinking": True, "relaxed_delta": -0.5}, "relaxed_delta' is -0.5"),
        ({"kind": "mtp", "max_matching_ngram_size": 3}, "applies to draft.kind ngram only"),
        ({"kind": "ngram", "relaxed_topk": 3}, "'draft.relaxed_topk' applies to draft.kind mtp only"),
        ({"kind": "mtp", "model": "d"}, "does not apply to draft.kind mtp"),
    ],
)
def test_mtp_keys_are_checked(draft, words):
    with pytest.raises(ConfigError, match=words):
        gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft=draft)


def test_mtp_on_the_cpu_is_refused_with_the_reason():
    raw = yaml.safe_load((BUILD / "smollm2-135m-ngram.yaml").read_text())
    raw["draft"] = {"kind": "mtp"}
    with pytest.raises(ConfigError, match="Llama, Mistral and Qwen2 checkpoints") as err:
        parse_recipe(raw)
    assert "trtllm-llmapi" in err.value.hint


def test_a_target_without_mtp_heads_is_refused_before_the_build(tmp_path):
    from specdeploy.deploy import preflight

    def findings(**config):
        recipe = gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft={"kind": "mtp", "max_draft_len": 3})
        return preflight.check_mtp_heads(recipe, Path(_mtp_target(tmp_path, **config)))

    (error,) = findings(num_hidden_layers=61)
    assert error.level == "error" and "names no MTP layers" in error.message
    assert findings(num_nextn_predict_layers=0)[0].level == "error"
    assert [f.level for f in findings(num_nextn_predict_layers=1)] == ["info"]  # one head, replayed (MTP-Eagle)
    assert [f.level for f in findings(mtp_num_hidden_layers=1)] == ["info"]  # Qwen3-Next's spelling
    levels = findings(num_nextn_predict_layers=2)
    assert [f.level for f in levels] == ["info", "warning"] and "drafts at most 2" in levels[1].message
    recipe = gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft={"kind": "mtp"})
    assert [f.level for f in preflight.check_mtp_heads(recipe, None)] == ["info"]  # not on this machine yet
    assert "mtp_heads" in backends.TRTLLM_LLMAPI.preflight_checks


# ---------------------------------------------------------------- PARD and DFlash drafts (draft.kind pard, dflash)


@pytest.mark.parametrize("kind", ["pard", "dflash"])
@pytest.mark.parametrize("release", RELEASES)
def test_pard_and_dflash_write_the_staged_draft_where_the_release_has_them(kind, release, tmp_path):
    """draft.kind pard / dflash: {decoding_type, max_draft_len, speculative_model} with the draft staged by the build
    (its config.json supplies the mask token and DFlash's layers). PARD: 1.4 only (pages 1.4.0rc1 / rc4); DFlash: 1.3
    (1.3.0rc27 page) and 1.4; refused elsewhere, naming the releases that have it."""
    recipe = gpu_recipe("llama3-70b-fp8.yaml", release, draft={"kind": kind, "head": "/models/draft"})
    has = {"pard": ("1.4",), "dflash": ("1.3", "1.4")}[kind]
    if release not in has:
        with pytest.raises(ConfigError, match="which TensorRT-LLM .* does not have") as err:
            spec_of(recipe, tmp_path)
        assert err.value.hint == f"set trtllm_version to {' or '.join(has)}"
        return
    layout = Layout.of(recipe, tmp_path)
    options = llmapi_options.llmapi_options(recipe, layout)
    spec = options["speculative_config"]
    assert spec == {
        "decoding_type": {"pard": "PARD", "dflash": "DFlash"}[kind],
        "max_draft_len": recipe.speculative.num_draft_tokens,
        "speculative_model": str(layout.engine("draft")),
    }
    assert options["disable_overlap_scheduler"] is True
    assert [v for rule in SPEC_RULES for v in rule(spec, release)] == []
    assert recipe.model_roles == ("target",) and recipe.draft.stages_head


@pytest.mark.parametrize(
    ("draft", "words"),
    [
        ({"kind": "pard"}, "must name the PARD draft checkpoint folder"),
        ({"kind": "dflash", "head": "trained"}, "must name the DFlash draft checkpoint folder"),
        ({"kind": "pard", "head": "/d", "model": "m"}, "loads the draft checkpoint as it is"),
        ({"kind": "dflash", "head": "/d", "max_draft_len": 3}, "does not apply to draft.kind dflash"),
        ({"kind": "pard", "head": "/d", "sa_config": {}}, "applies to draft.kind eagle3 only"),
    ],
)
def test_pard_and_dflash_keys_are_checked(draft, words):
    with pytest.raises(ConfigError, match=words):
        gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft=draft)


def test_pard_and_dflash_on_the_cpu_are_refused_with_the_reason():
    raw = yaml.safe_load((BUILD / "smollm2-135m-ngram.yaml").read_text())
    for kind in ("pard", "dflash"):
        raw["draft"] = {"kind": kind, "head": "/models/draft"}
        with pytest.raises(ConfigError, match="the CPU engine has neither drafter") as err:
            parse_recipe(raw)
        assert "trtllm-llmapi" in err.value.hint


def test_the_build_stages_a_pard_draft_like_a_head(tmp_path):
    """The draft folder travels with the project root: build copies it to engines/<recipe>/draft."""
    from specdeploy.gpu import trtllm

    draft = tmp_path / "pard-draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "model.safetensors").write_bytes(b"x")
    recipe = gpu_recipe("llama3-70b-fp8.yaml", "1.4", draft={"kind": "pard", "head": str(draft)})
    layout = Layout.of(recipe, tmp_path / "project")
    lines = []
    trtllm._write_draft(recipe, layout, "fp", {}, draft, lines.append)
    assert (layout.engine("draft") / "model.safetensors").read_bytes() == b"x"
    assert lines == [f"staging the PARD draft {draft} -> {layout.engine('draft')}"]
