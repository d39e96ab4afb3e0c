"""trtllm-llmapi: the LLM-API options file, its checks, and what the build records (no GPU here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from _trtllm_standin import write_hf_checkpoint, write_trtllm_checkpoint

from specdeploy.core.artifacts import Layout, Manifest
from specdeploy.core.errors import ConfigError, StaleArtifactError
from specdeploy.gpu import llmapi_options, llmapi_versions, trtllm
from specdeploy.recipe.load import parse_recipe


def make_recipe(target="t", draft="d", kv=None, **extra):
    return parse_recipe(
        {
            "name": "llmapi-test",
            "backend": "trtllm-llmapi",
            "target": {"model": str(target), "tp_size": 2, "quantization": {"qformat": "fp8", "kv_cache_dtype": kv}},
            "draft": {"model": str(draft), "quantization": {"qformat": "fp8"}},
            "speculative": {"max_draft_len": 5, "num_draft_tokens": 3},
            "engine": {
                "max_batch_size": 1,
                "max_input_len": 512,
                "max_seq_len": 1024,
                "kv_cache_free_gpu_mem_fraction": 0.8,
            },
            **extra,
        }
    )


def test_options_carry_draft_target_speculative_config(tmp_path):
    recipe = make_recipe(kv="fp8")
    layout = Layout.of(recipe, tmp_path)
    options = llmapi_options.llmapi_options(recipe, layout)
    # default trtllm_version 1.2: DraftTarget + speculative_model_dir; num_draft_tokens (3) is what is drafted
    assert options["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 3,
        "speculative_model_dir": str(layout.checkpoint("draft")),
    }
    assert options["kv_cache_config"] == {"free_gpu_memory_fraction": 0.8, "enable_block_reuse": False, "dtype": "fp8"}
    assert options["tensor_parallel_size"] == 2 and options["pipeline_parallel_size"] == 1
    # max_input_len: engine_max_input_len, max_seq_len - 1
    assert (options["max_batch_size"], options["max_input_len"], options["max_seq_len"]) == (1, 1023, 1024)
    assert options["disable_overlap_scheduler"] is True


def test_dry_run_prints_yaml_and_serve_command(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe()
    lines = []
    trtllm.build_llmapi_recipe(recipe, Layout.of(recipe, tmp_path), dry_run=True, echo=lines.append)
    text = "\n".join(lines)
    assert "decoding_type: DraftTarget" in text and "trtllm-serve" in text and "--extra_llm_api_options" in text
    assert not (tmp_path / "engines").exists()


@pytest.fixture
def llmapi_env(tmp_path, monkeypatch, tiny_llama_dir, tiny_llama_draft_dir):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = make_recipe(tiny_llama_dir, tiny_llama_draft_dir)
    layout = Layout.of(recipe, tmp_path / "project")
    write_hf_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir)
    write_hf_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_draft_dir)
    return recipe, layout


def test_build_writes_options_and_manifests(llmapi_env):
    recipe, layout = llmapi_env
    lines = []
    outputs = trtllm.build_llmapi_recipe(recipe, layout, echo=lines.append)
    assert outputs == [layout.engine("target"), layout.engine("draft")]
    # the file handed to trtllm-serve --extra_llm_api_options, read back and checked against values written
    # out here (LLM API argument names), not against what trtllm.llmapi_options computes
    written = yaml.safe_load((layout.engine("target") / "extra_llm_api_options.yaml").read_text())
    assert written["speculative_config"] == {
        "decoding_type": "DraftTarget",
        "max_draft_len": 3,
        "speculative_model_dir": str(layout.checkpoint("draft")),
    }
    assert written["kv_cache_config"] == {"free_gpu_memory_fraction": 0.8, "enable_block_reuse": False, "dtype": "auto"}
    assert (written["tensor_parallel_size"], written["pipeline_parallel_size"]) == (2, 1)
    m = Manifest.read(layout.engine("target"))
    assert m.stage == "build" and m.settings["backend"] == "trtllm-llmapi" and m.settings["max_draft_len"] == 5
    # honest about what it could not do here
    assert m.extra["start_check"].startswith("not run")
    assert Manifest.read(layout.engine("draft")).settings["role"] == "draft"
    again = []
    trtllm.build_llmapi_recipe(recipe, layout, echo=again.append)
    assert any("up to date" in line for line in again)


def test_trtllm_format_checkpoint_is_refused(llmapi_env, tiny_llama_dir):
    recipe, layout = llmapi_env
    write_trtllm_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, tp=2)
    with pytest.raises(StaleArtifactError, match="Hugging Face-format"):
        trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)


def test_unquantized_export_is_refused_for_fp8(llmapi_env, tiny_llama_dir):
    recipe, layout = llmapi_env
    write_hf_checkpoint(layout.checkpoint("draft"), recipe.name, tiny_llama_dir, quantized=False)
    with pytest.raises(StaleArtifactError, match="hf_quant_config"):
        trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)


def test_start_check_says_why_it_did_not_run(tmp_path):
    assert trtllm.prove_llmapi_starts(tmp_path, {}).startswith("not run")


# ---------------------------------------------------------------- options per TensorRT-LLM version (golden files)

GOLDEN_DIR = Path(__file__).parent / "data" / "llmapi"
GOLDEN_DYNAMIC = {
    "1.1": {"max_concurrency": 4},  # 1.1.0 has no acceptance gate (test_release_11_has_no_acceptance_gate)
    "1.2": {
        "draft_len_schedule": [[4, 4], [8, 2]],
        "acceptance_window": 16,
        "acceptance_threshold": 1.5,
        "acceptance_measure": "length",
    },
    "1.3": {"draft_len_schedule": [[4, 4], [8, 2]], "acceptance_window": 16, "acceptance_threshold": 0.4},
    "1.4": {"draft_len_schedule": [[4, 4], [8, 2]], "acceptance_window": 16, "acceptance_threshold": 0.4},
}


def built_image(version: str) -> str:
    """An image built with TensorRT-LLM `version` (no NGC image carries 1.3 or 1.4: trtllm_images)."""
    return f"registry.example.com/tritonserver-trtllm:{version}"


def golden_recipe(version, dynamic=None, **speculative):
    return parse_recipe(
        {
            "name": "golden",
            "backend": "trtllm-llmapi",
            "trtllm_version": version,
            "image": built_image(version),
            "target": {"model": "t", "tp_size": 2, "quantization": {"qformat": "fp8", "kv_cache_dtype": "fp8"}},
            "draft": {"model": "d", "quantization": {"qformat": "fp8"}},
            "speculative": {"max_draft_len": 6, "num_draft_tokens": 4, "dynamic": dynamic, **speculative},
            "engine": {
                "max_batch_size": 8,
                "max_input_len": 512,
                "max_seq_len": 1024,
                "kv_cache_free_gpu_mem_fraction": 0.85,
            },
        }
    )


@pytest.mark.parametrize("version", sorted(GOLDEN_DYNAMIC))
def test_options_match_the_golden_file_of_each_version(version):
    recipe = golden_recipe(version, GOLDEN_DYNAMIC[version])
    expected = yaml.safe_load((GOLDEN_DIR / f"trtllm-{version}.yaml").read_text())
    assert llmapi_options.llmapi_options(recipe, Layout.of(recipe, "/project")) == expected


def test_every_supported_version_has_a_golden_file():
    assert sorted(p.stem.removeprefix("trtllm-") for p in GOLDEN_DIR.glob("trtllm-*.yaml")) == sorted(
        llmapi_versions.LLMAPI_VERSIONS
    )


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("1.2", "1.2"),
        ("1.2.1", "1.2"),
        ("1.1.0.post1", "1.1"),
        ("1.3.0rc22", "1.3"),
        ("1.3.0", "1.3"),
        ("1.4.0rc1", "1.4"),
    ],
)
def test_release_strings_pick_their_line(text, line):
    assert llmapi_versions.llmapi_version(text).name == line


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("1.3.0rc5", "straddle"),
        ("1.0.0", "trtllm-engine"),
        ("2.0", "no verified"),
        ("latest", "not a TensorRT-LLM version"),
    ],
)
def test_unverified_releases_are_refused(text, words):
    with pytest.raises(ConfigError, match=words):
        llmapi_versions.llmapi_version(text)


def test_lower_bound_schedule_is_the_upper_bound_one_shifted():
    # batch 1-4 draft 4, 5-8 draft 2, 9-32 draft 1, 33+ off, in both spellings
    assert llmapi_options._draft_len_schedule(((4, 4), (8, 2), (32, 1)), "upper") == {4: 4, 8: 2, 32: 1}
    assert llmapi_options._draft_len_schedule(((4, 4), (8, 2), (32, 1)), "lower") == {1: 4, 5: 2, 9: 1, 33: 0}


@pytest.mark.parametrize("version", sorted(GOLDEN_DYNAMIC))
def test_draft_logits_are_rejection_sampling_where_the_release_has_it_and_refused_where_not(version, tmp_path):
    """speculative.use_draft_logits: DecodingBaseConfig.use_rejection_sampling on the 1.3.0rc27 / 1.4.0rc1 / 1.4.0rc4
    API pages (Draft_Target and Eagle3 one-model: PR #15775, #12588); 1.1 and 1.2 have no such key (refused, naming
    the releases that do); never dropped."""
    for recipe, kind in (
        (golden_recipe(version, use_draft_logits=True), "draft_target"),
        (
            example_eagle3(version, speculative={"max_draft_len": 3, "num_draft_tokens": 3, "use_draft_logits": True}),
            "eagle3",
        ),
    ):
        layout = Layout.of(recipe, tmp_path)
        if version in ("1.1", "1.2"):
            with pytest.raises(
                ConfigError, match=f"use_draft_logits is true, but TensorRT-LLM {version}.*no use_rejection_sampling"
            ) as err:
                llmapi_options.llmapi_options(recipe, layout)
            assert "trtllm_version to 1.3 or 1.4" in err.value.hint
            continue
        assert kind in llmapi_versions.LLMAPI_VERSIONS[version].rejection_sampling
        assert llmapi_options.llmapi_options(recipe, layout)["speculative_config"]["use_rejection_sampling"] is True
        plain = dataclasses.replace(recipe, speculative=dataclasses.replace(recipe.speculative, use_draft_logits=False))
        assert "use_rejection_sampling" not in llmapi_options.llmapi_options(plain, layout)["speculative_config"]


def test_draft_logits_beside_sa_config_are_refused(tmp_path):
    raw = yaml.safe_load(EXAMPLE_EAGLE3.read_text())
    recipe = example_eagle3(
        "1.4",
        draft={**raw["draft"], "sa_config": {"threshold": 3}},
        speculative={"max_draft_len": 3, "num_draft_tokens": 3, "use_draft_logits": True},
    )
    with pytest.raises(ConfigError, match="use_draft_logits and draft.sa_config"):
        llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))


@pytest.mark.parametrize(
    ("version", "measure", "named"),
    [("1.4", "length", "acceptance_rate_threshold"), ("1.2", "rate", "acceptance_length_threshold")],
)
def test_an_acceptance_gate_in_the_other_measure_is_refused(version, measure, named):
    recipe = golden_recipe(
        version, {"acceptance_window": 8, "acceptance_threshold": 0.5, "acceptance_measure": measure}
    )
    with pytest.raises(ConfigError, match=named):
        llmapi_options.llmapi_options(recipe, Layout.of(recipe, "/project"))


def test_release_11_has_no_acceptance_gate():
    # 1.1.0's DecodingBaseConfig (release docs' llm_args.py) has no acceptance_window / acceptance_length_threshold
    recipe = golden_recipe(
        "1.1", {"acceptance_window": 16, "acceptance_threshold": 1.5, "acceptance_measure": "length"}
    )
    with pytest.raises(ConfigError, match="1.1 has no acceptance gate"):
        llmapi_options.llmapi_options(recipe, Layout.of(recipe, "/project"))


def test_a_schedule_is_refused_where_unverified():
    recipe = golden_recipe("1.1", {"draft_len_schedule": [[4, 4]]})
    with pytest.raises(ConfigError, match="not verified"):
        llmapi_options.llmapi_options(recipe, Layout.of(recipe, "/project"))


@pytest.mark.parametrize(
    ("dynamic", "words"),
    [
        ({"draft_len_schedule": [[4, 3]]}, "full draft length"),
        ({"draft_len_schedule": [[4, 4], [2, 1]]}, "ascending"),
        ({"draft_len_schedule": [[4, 4]], "max_concurrency": 8}, "use one"),
        ({"acceptance_window": 8}, "go together"),
        ({"acceptance_window": 8, "acceptance_threshold": 1.5}, "outside 0..1"),
    ],
)
def test_dynamic_settings_are_checked_at_the_edge(dynamic, words):
    with pytest.raises(ConfigError, match=words):
        golden_recipe("1.4", dynamic)


def test_dynamic_settings_are_refused_on_other_backends():
    with pytest.raises(ConfigError, match="no dynamic speculation"):
        parse_recipe(
            {
                "name": "c",
                "backend": "trtllm-engine",
                "target": {"model": "t"},
                "draft": {"model": "d"},
                "speculative": {"dynamic": {"max_concurrency": 2}},
            }
        )
    # backend cpu runs them in its BLS (specdeploy.speculation.policy)
    parse_recipe(
        {
            "name": "c",
            "target": {"model": "t"},
            "draft": {"model": "d"},
            "speculative": {"dynamic": {"max_concurrency": 2}},
        }
    )


def test_dry_run_states_the_mapping_and_warns_of_another_installed_release(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    monkeypatch.setattr(trtllm.gpu_probe, "tensorrt_llm_version", lambda: "1.4.0rc1")
    recipe = golden_recipe("1.2")
    lines = []
    trtllm.build_llmapi_recipe(recipe, Layout.of(recipe, tmp_path), dry_run=True, echo=lines.append)
    text = "\n".join(lines)
    assert "tensorrt_llm 1.4.0rc1 is installed, the recipe targets trtllm_version 1.2" in text
    assert "num_draft_tokens 4 -> speculative_config.max_draft_len" in text
    assert "speculative_model_dir: " in text and "decoding_type: DraftTarget" in text
    # the per-release names were not read from the release's tag: the dry run says so, and what confirms them
    assert "not from the 1.2 release's tag" in text and "LLM(...) start check" in text


# ---------------------------------------------------------------- draft.kind eagle3 (EAGLE-3 heads)

EXAMPLE_EAGLE3 = Path(__file__).parent.parent / "build" / "llama3.1-8b-eagle3.yaml"
# What each release's llm_args.py takes for an EAGLE-3 head, written out by hand from the sources cited above
# LLMAPI_VERSIONS (1.1.0 / 1.2.0 release docs' llm_args.py: EagleDecodingConfig "Eagle" with eagle3_one_model and
# eagle3_layers_to_capture, speculative_model_dir; 1.3.0rc27 / 1.4.0rc1 API pages: Eagle3DecodingConfig "Eagle3",
# speculative_model, eagle3_layers_to_capture, no eagle3_one_model). HEAD stands for the staged head folder.
EAGLE3_EXPECTED = {
    "1.1": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": "HEAD", "eagle3_one_model": True},
    "1.2": {"decoding_type": "Eagle", "max_draft_len": 3, "speculative_model_dir": "HEAD", "eagle3_one_model": True},
    "1.3": {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "HEAD"},
    "1.4": {"decoding_type": "Eagle3", "max_draft_len": 3, "speculative_model": "HEAD"},
}


def write_eagle3_head(directory: Path, hidden=64, vocab=512, aux_layers=None, nested=False) -> Path:
    """An exported EAGLE-3 head as the deployment reads it: config.json (LlamaForCausalLMEagle3) + weights file."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "hidden_size": hidden,
        "vocab_size": vocab,
        "draft_vocab_size": 128,
        "num_hidden_layers": 1,
    }
    if aux_layers is not None:
        if nested:  # ModelOpt's export nests it in eagle_config
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
        else:
            config["eagle_aux_hidden_state_layer_ids"] = aux_layers
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "model.safetensors").write_bytes(b"head weights")
    return directory


def example_eagle3(version: str, head: Path | str | None = None, **changes):
    raw = yaml.safe_load(EXAMPLE_EAGLE3.read_text())
    raw["trtllm_version"], raw["image"] = version, built_image(version)
    if head is not None:
        raw["draft"]["head"] = str(head)
    for key, value in changes.items():
        raw[key] = value
    return parse_recipe(raw)


@pytest.mark.parametrize("version", sorted(EAGLE3_EXPECTED))
def test_the_example_eagle3_recipe_gives_each_release_its_eagle3_fields(version, tmp_path):
    assert sorted(EAGLE3_EXPECTED) == sorted(llmapi_versions.LLMAPI_VERSIONS)
    # the published head names no aux layers: TensorRT-LLM's default {1, L//2-1, L-4} applies, nothing is written
    recipe = example_eagle3(version)
    layout = Layout.of(recipe, tmp_path)
    head = str(layout.engine("draft"))
    expected = {k: head if v == "HEAD" else v for k, v in EAGLE3_EXPECTED[version].items()}
    assert llmapi_options.llmapi_options(recipe, layout)["speculative_config"] == expected
    # a head that names its layers gets them as TensorRT-LLM counts them (outputs of layers): ModelOpt's nested ids
    # as they are, the top-level ids of vLLM / llama.cpp (the stream entering layer i) one lower
    for nested, named in ((True, [26, 1, 14]), (False, [27, 2, 15])):
        source = write_eagle3_head(tmp_path / f"head-{nested}", aux_layers=named, nested=nested)
        recipe = example_eagle3(version, source)
        spec = llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))["speculative_config"]
        assert spec == {**expected, "eagle3_layers_to_capture": [1, 14, 26]}
    # both present (specdeploy's own export writes both): the nested ids win
    both = write_eagle3_head(tmp_path / "head-both", aux_layers=[1, 14, 26], nested=True)
    config = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [2, 15, 27]}))
    recipe = example_eagle3(version, both)
    spec = llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))["speculative_config"]
    assert spec["eagle3_layers_to_capture"] == [1, 14, 26]


@pytest.mark.parametrize("version", sorted(EAGLE3_EXPECTED))
def test_draft_sa_config_is_written_where_the_release_has_it_and_refused_where_not(version, tmp_path):
    """draft.sa_config (the suffix lookup before the head): Eagle3DecodingConfig.sa_config as TensorRT-LLM's
    SAEnhancerConfig (threshold, enable_global_pool) where the release's API page lists it (1.3.0rc27, 1.4.0rc1), a
    refusal naming the release before; never dropped."""
    raw = yaml.safe_load(EXAMPLE_EAGLE3.read_text())
    raw["draft"]["sa_config"] = {"threshold": 3, "enable_global_pool": True}
    recipe = example_eagle3(version, draft=raw["draft"])
    assert recipe.draft.sa_config.threshold == 3 and recipe.draft.lookup_threshold == 3
    layout = Layout.of(recipe, tmp_path)
    if "sa_config" not in llmapi_versions.LLMAPI_VERSIONS[version].eagle3_fields:
        with pytest.raises(ConfigError, match=f"sa_config is not verified for TensorRT-LLM {version}") as err:
            llmapi_options.llmapi_options(recipe, layout)
        assert "trtllm_version 1.3 or later" in err.value.hint
        return
    spec = llmapi_options.llmapi_options(recipe, layout)["speculative_config"]
    assert spec["sa_config"] == {"threshold": 3, "enable_global_pool": True}
    default = example_eagle3(version, draft={**raw["draft"], "sa_config": {}})  # TensorRT-LLM's defaults
    assert llmapi_options.llmapi_options(default, layout)["speculative_config"]["sa_config"] == {
        "threshold": 4,
        "enable_global_pool": False,
    }


def test_draft_sa_config_on_cpu_is_the_engines_and_checked():
    """backend cpu: the lookup runs in the CPU engine (its threshold a model parameter, not in model.yaml); it looks
    in the request's own tokens only, so a global pool is refused; a threshold below 1 too; other draft kinds have
    no head to put it before."""
    raw = yaml.safe_load(EXAMPLE_EAGLE3.read_text())
    cpu = {**raw, "backend": "cpu", "trtllm_version": "1.2"}
    with pytest.raises(ConfigError, match="enable_global_pool.*request's own tokens") as err:
        parse_recipe({**cpu, "draft": {**raw["draft"], "sa_config": {"enable_global_pool": True}}})
    assert "backend trtllm-llmapi" in err.value.hint
    with pytest.raises(ConfigError, match=r"draft.sa_config.threshold' is 0, must be >= 1"):
        parse_recipe({**cpu, "draft": {**raw["draft"], "sa_config": {"threshold": 0}}})
    with pytest.raises(ConfigError, match="'draft.sa_config' applies to draft.kind eagle3 only"):
        parse_recipe({**cpu, "draft": {"kind": "ngram", "sa_config": {"threshold": 2}}})
    assert parse_recipe({**cpu, "draft": {**raw["draft"], "sa_config": {"threshold": 2}}}).draft.lookup_threshold == 2
    assert parse_recipe(cpu).draft.lookup_threshold == 0


def test_the_example_eagle3_dry_run_prints_the_options(tmp_path, monkeypatch):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    recipe = example_eagle3("1.4")
    lines = []
    trtllm.build_llmapi_recipe(recipe, Layout.of(recipe, tmp_path), dry_run=True, echo=lines.append)
    text = "\n".join(lines)
    assert (
        "decoding_type: Eagle3" in text and f"speculative_model: {tmp_path / 'engines' / recipe.name / 'draft'}" in text
    )
    assert "eagle3_one_model" not in text.split("would contain:")[1]  # not verified for 1.4
    assert "EAGLE-3 fields verified for 1.4" in text
    assert not (tmp_path / "engines").exists()


def test_trtllm_engine_refuses_eagle3_with_the_reason_and_the_alternative():
    with pytest.raises(ConfigError, match="EAGLE-1/2") as exc:
        example_eagle3("1.2", backend="trtllm-engine")
    assert "trtllm-llmapi" in exc.value.hint and "Eagle3" in exc.value.hint


def test_a_draft_len_other_than_the_schedule_is_refused(tmp_path):
    recipe = example_eagle3(
        "1.4", speculative={"max_draft_len": 4, "num_draft_tokens": 4, "dynamic": {"draft_len_schedule": [[4, 4]]}}
    )
    with pytest.raises(ConfigError, match="first entry"):
        llmapi_options.llmapi_options(recipe, Layout.of(recipe, tmp_path))


@pytest.fixture
def eagle3_env(tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.setattr(trtllm.gpu_probe, "probe", lambda timeout_s=10.0: [])
    head = write_eagle3_head(tmp_path / "downloads" / "head", aux_layers=[0, 1], nested=True)
    raw = yaml.safe_load(EXAMPLE_EAGLE3.read_text())
    raw["target"]["model"], raw["draft"]["head"], raw["trtllm_version"] = str(tiny_llama_dir), str(head), "1.3"
    raw["image"] = built_image("1.3")
    recipe = parse_recipe(raw)
    layout = Layout.of(recipe, tmp_path / "project")
    write_hf_checkpoint(layout.checkpoint("target"), recipe.name, tiny_llama_dir, quantized=False)
    return recipe, layout, head


def test_build_stages_the_head_in_the_deployment_and_points_the_options_at_it(eagle3_env):
    recipe, layout, head = eagle3_env
    trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)
    staged = layout.engine("draft")
    assert (staged / "config.json").read_text() == (head / "config.json").read_text()
    assert (staged / "model.safetensors").read_bytes() == b"head weights"
    written = yaml.safe_load((layout.engine("target") / trtllm.LLMAPI_OPTIONS).read_text())
    assert written["speculative_config"] == {
        "decoding_type": "Eagle3",
        "max_draft_len": 3,
        "speculative_model": str(staged),
        "eagle3_layers_to_capture": [0, 1],
    }
    # inside the project root, which the container (-v root:root) and the Kubernetes volume mount at the same path
    assert staged.resolve().is_relative_to(Path(layout.root).resolve())
    m = Manifest.read(staged)
    assert m.settings["kind"] == "eagle3" and m.extra["head_source"] == str(head)
    # a changed head is a changed deployment
    trtllm.build_llmapi_recipe(recipe, layout, echo=(again := []).append)
    assert any("up to date" in line for line in again)
    # the counts file only the CPU engine reads (draft.serve_vocab_size) is not part of the head here
    (head / "draft_vocab_counts.json").write_text('{"counts": [1, 2]}')
    trtllm.build_llmapi_recipe(recipe, layout, echo=(counted := []).append)
    assert any("up to date" in line for line in counted)
    (head / "model.safetensors").write_bytes(b"retrained head")  # in place: the built deployment keeps its copy
    assert (staged / "model.safetensors").read_bytes() == b"head weights"
    trtllm.build_llmapi_recipe(recipe, layout, echo=(third := []).append)
    assert not any("up to date" in line for line in third)
    assert (staged / "model.safetensors").read_bytes() == b"retrained head"


def test_build_refuses_a_head_without_weights(eagle3_env):
    recipe, layout, head = eagle3_env
    (head / "model.safetensors").unlink()
    with pytest.raises(StaleArtifactError, match="no weights"):
        trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)


def test_repository_and_manifests_carry_the_staged_head(eagle3_env):
    from specdeploy.deploy import backend_stages
    from specdeploy.gpu import k8s
    from specdeploy.gpu import llmapi_repository as llmapi

    recipe, layout, head = eagle3_env
    trtllm.build_llmapi_recipe(recipe, layout, echo=lambda s: None)
    path, _ = backend_stages.of(recipe).write_repository(recipe, layout)
    model = yaml.safe_load((path / llmapi.SPECULATIVE_MODEL / "1" / "model.yaml").read_text())
    assert model["speculative_config"]["speculative_model"] == str(layout.engine("draft"))
    control = yaml.safe_load((path / llmapi.CONTROL_MODEL / "1" / "model.yaml").read_text())
    assert "speculative_config" not in control
    text = k8s.k8s_yaml(recipe, layout)
    mount = Path(layout.root).resolve()
    assert f"mountPath: {mount}" in text
    assert f"EAGLE-3 head: {layout.engine('draft')} (staged from {head} by specdeploy build)" in text


def test_the_dockerfile_says_where_the_head_comes_from(tmp_path):
    from specdeploy.gpu import image as packaging

    recipe = example_eagle3("1.4")
    layout = Layout.of(recipe, tmp_path)
    text = packaging.dockerfile(recipe, built_image("1.4"), layout)
    assert f"stages it in {layout.engine('draft')}" in text and text.index("EAGLE-3 head") < text.index("FROM ")
