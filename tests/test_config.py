import copy
from pathlib import Path

import pytest
import yaml

from specdeploy.core.errors import ConfigError
from specdeploy.recipe.load import load_recipe, parse_recipe

RECIPE = "build/smollm2-135m-int8-draft.yaml"  # a model-draft recipe: these tests change its draft and target sections
DEFAULT = "build/smollm2-135m.yaml"


def raw_default():
    with open(RECIPE) as fh:
        return yaml.safe_load(fh)


def with_change(path: str, value):
    raw = copy.deepcopy(raw_default())
    node = raw
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return raw


def test_default_recipe_drafts_with_the_bundled_eagle3_head():
    from specdeploy.core import artifacts

    r = load_recipe(DEFAULT)
    assert r.name == "smollm2-135m" and r.backend == "cpu"
    assert r.draft.is_eagle3 and r.draft.head == "smollm2-135m-instruct-eagle3"
    head = artifacts.Layout.of(r, "/nonexistent").eagle3_head_source(r.draft.head)
    assert head == artifacts.BUNDLED_HEADS / "smollm2-135m-instruct-eagle3"
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    # the head was trained for this target as this recipe quantizes it (the training recipes' target section), by
    # the recipes shipped beside it: the last stage's at the top, the earlier ones' under lineage/, each the one in
    # build/ (the GPU run, then the two ShareGPT stages)
    stages = {
        ".": "build/smollm2-135m-eagle3-sharegpt2.yaml",
        "lineage/2-sharegpt": "build/smollm2-135m-eagle3-sharegpt.yaml",
        "lineage/1-gpu": "build/smollm2-135m-eagle3-gpu.yaml",
    }
    assert all(load_recipe(path).target == r.target for path in (*stages.values(), "build/smollm2-135m-eagle3.yaml"))
    for folder, path in stages.items():
        assert (head / folder / "recipe.yaml").read_text() == Path(path).read_text(), folder
    gpu = load_recipe("build/smollm2-135m-eagle3-gpu.yaml")
    assert (
        gpu.draft.data.backend == "torch"
        and load_recipe("build/smollm2-135m-eagle3.yaml").draft.data.backend == "engine"
    )


def test_model_draft_recipe_loads_into_frozen_dataclasses():
    r = load_recipe(RECIPE)
    assert r.name == "smollm2-135m-int8-draft"
    assert r.backend == "cpu"
    assert r.target.quantization.qformat == "fp8"
    assert r.draft.quantization.qformat == "int8_wo"
    assert r.speculative.num_draft_tokens <= r.speculative.max_draft_len
    assert isinstance(r.validation.concurrency, tuple)
    with pytest.raises(AttributeError):
        r.name = "other"


def test_every_shipped_recipe_validates():
    import glob

    paths = glob.glob("build/*.yaml")
    assert RECIPE in paths and DEFAULT in paths
    for path in paths:
        load_recipe(path)


@pytest.mark.parametrize(
    "path, value, message",
    [
        ("colour", "red", "unknown key 'colour'"),
        ("target.quantization.bogus", 1, "unknown key 'target.quantization.bogus'"),
        ("target.quantization.qformat", "int3", "key 'target.quantization.qformat' has invalid value 'int3'"),
        ("draft.quantization.kv_cache_dtype", "fp4", "key 'draft.quantization.kv_cache_dtype'"),
        ("draft.quantization.awq_block_size", 32, "awq_block_size"),
        ("backend", "tpu", "key 'backend' has invalid value 'tpu'"),
        ("speculative.num_draft_tokens", 9, "num_draft_tokens' is 9, larger than speculative.max_draft_len"),
        ("speculative.max_draft_len", "four", "must be int"),
        ("speculative.use_draft_logits", "yes", "must be bool"),
        ("engine.dtype", "int8", "key 'engine.dtype'"),
        ("engine.max_seq_len", 512, "must be larger than engine.max_input_len"),
        ("engine.max_batch_size", 0, "engine.max_batch_size' is 0, must be >= 1"),
        ("triton.grpc_port", 70000, "triton.grpc_port"),
        ("validation.concurrency", [], "validation.concurrency' is empty"),
        ("validation.concurrency", [1, 0], "validation.concurrency[1]"),
        ("validation.min_parity", 1.5, "validation.min_parity"),
        ("target.tp_size", 2, "ranks on backend 'cpu'"),
        ("name", "has space", "key 'name'"),
        ("target", "just-a-string", "must be a mapping"),
    ],
)
def test_invalid_recipes_name_the_key(path, value, message):
    with pytest.raises(ConfigError) as err:
        parse_recipe(with_change(path, value))
    assert message in str(err.value)


def test_num_draft_tokens_error_names_both_values_and_fix():
    raw = with_change("speculative.num_draft_tokens", 9)
    raw["speculative"]["max_draft_len"] = 4
    with pytest.raises(ConfigError) as err:
        parse_recipe(raw)
    assert "9" in err.value.message and "4" in err.value.message
    assert "num_draft_tokens <= 4" in err.value.hint


def test_backend_that_cannot_run_qformat_is_rejected():
    raw = with_change("backend", "trtllm-llmapi")
    raw["draft"]["quantization"]["qformat"] = "int8_wo"
    with pytest.raises(ConfigError) as err:
        parse_recipe(raw)
    assert "cannot run" in err.value.message and "fp8" in err.value.hint


def test_per_token_is_an_int8_sq_setting_of_the_cpu_backend():
    raw = with_change("target.quantization.qformat", "int8_sq")
    raw["target"]["quantization"]["per_token"] = True
    assert parse_recipe(raw).target.quantization.per_token
    raw["target"]["quantization"]["qformat"] = "fp8"
    with pytest.raises(ConfigError, match="per_token' is true with qformat 'fp8'"):
        parse_recipe(raw)
    raw = with_change("backend", "trtllm-engine")
    raw["target"]["quantization"].update(qformat="int8_sq", per_token=True)
    with pytest.raises(ConfigError, match="per_token' is true on backend trtllm-engine") as err:
        parse_recipe(raw)
    assert "backend cpu" in err.value.hint


def test_missing_required_key():
    raw = raw_default()
    del raw["target"]
    with pytest.raises(ConfigError, match="missing required key 'target'"):
        parse_recipe(raw)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(bad)
    bad.write_bytes(b"name: x\n\xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_recipe(bad)
    # YAML 1.1 reads `on:` as a boolean key and an unquoted version as a number: named, not a traceback
    bad.write_text("name: x\non: 1\nzzz: 2\ntarget: {model: m}\n")
    with pytest.raises(ConfigError, match="unknown key 'True' .YAML 1.1"):
        load_recipe(bad)
    bad.write_text("name: x\ntarget: {model: m}\ndraft: {kind: ngram}\ntrtllm_version: 1.10\n")
    with pytest.raises(ConfigError, match="got 1.1 .float.; YAML read an unquoted number: quote the text you mean"):
        load_recipe(bad)


def test_an_unusable_root_is_named_not_a_traceback(tmp_path):
    from specdeploy.core.lock import recipe_lock

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot create .*file/engines/r: Not a directory") as info:
        with recipe_lock(blocker / "engines" / "r", "r", "test"):
            pass
    assert "--root" in info.value.hint


def test_int_accepted_for_float_and_section_hash_is_stable():
    a = parse_recipe(with_change("validation.min_speedup", 2))
    assert a.validation.min_speedup == 2.0
    b = parse_recipe(with_change("validation.min_speedup", 2.0))
    assert a.section_hash("target", "engine") == b.section_hash("target", "engine")
    c = parse_recipe(with_change("target.quantization.qformat", "int8_wo"))
    assert a.section_hash("target") != c.section_hash("target")


def test_bls_instances_follow_in_flight_batching_unless_set():
    """Each tensorrt_llm_bls instance runs one speculative request at a time: with engines that batch in flight the
    BLS gets min(max_batch_size, 4) instances (NVIDIA's bls_instance_count), else instance_count, unless set."""
    base = {"name": "b", "target": {"model": "t"}, "draft": {"model": "d"}, "engine": {"max_batch_size": 8}}
    assert parse_recipe(base).bls_instance_count == 4  # cpu, in-flight batching on by default
    assert parse_recipe({**base, "engine": {"max_batch_size": 2}}).bls_instance_count == 2
    assert parse_recipe({**base, "triton": {"inflight_batching": False, "instance_count": 3}}).bls_instance_count == 3
    assert parse_recipe({**base, "triton": {"bls_instance_count": 6}}).bls_instance_count == 6
    gpu = {**base, "backend": "trtllm-engine", "triton": {"inflight_batching": False}}
    assert parse_recipe(gpu).bls_instance_count == 4  # TensorRT-LLM batches in flight whatever the cpu key says
    with pytest.raises(ConfigError, match="bls_instance_count"):
        parse_recipe({**base, "triton": {"bls_instance_count": -1}})


def test_eagle3_is_refused_where_the_backend_cannot_serve_it():
    from specdeploy.core import backends

    raw = {"name": "e", "target": {"model": "t"}, "draft": {"kind": "eagle3", "head": "/models/head"}}
    assert [b.name for b in backends.ALL if b.eagle3_draft] == ["cpu", "trtllm-llmapi"]
    for name in ("cpu", "trtllm-llmapi"):
        assert parse_recipe({**raw, "backend": name}).draft.is_eagle3
    with pytest.raises(ConfigError, match="not wired for backend trtllm-engine.*EAGLE-1/2") as exc:
        parse_recipe({**raw, "backend": "trtllm-engine"})
    assert "use backend cpu or trtllm-llmapi" in exc.value.hint


def test_smoothquant_alpha_is_an_int8_sq_setting_in_modelopts_range():
    from specdeploy.quantize.modelopt import modelopt_config
    from specdeploy.recipe.config import checkpoint_settings

    raw = with_change("target.quantization.qformat", "int8_sq")
    before = checkpoint_settings(parse_recipe(raw).target)
    raw["target"]["quantization"]["smoothquant_alpha"] = 1  # an int is a float here
    recipe = parse_recipe(raw)
    assert recipe.target.quantization.smoothquant_alpha == 1.0
    assert modelopt_config(recipe.target.quantization)["algorithm"] == {"method": "smoothquant", "alpha": 1.0}
    assert (
        modelopt_config(parse_recipe(with_change("target.quantization.qformat", "int8_sq")).target.quantization)[
            "algorithm"
        ]
        == "smoothquant"
    )
    # the checkpoint's identity: unchanged when the key is left at null (earlier checkpoints stay up to date), else part
    # of it
    assert "smoothquant_alpha" not in before["quantization"]
    assert checkpoint_settings(recipe.target)["quantization"]["smoothquant_alpha"] == 1.0
    for value, message in ((1.5, "must be in [0, 1]"), (-0.1, "must be in [0, 1]")):
        raw["target"]["quantization"]["smoothquant_alpha"] = value
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            parse_recipe(raw)
    raw["target"]["quantization"].update(qformat="fp8", smoothquant_alpha=0.8)
    with pytest.raises(ConfigError, match="smoothquant_alpha' is set with qformat 'fp8'"):
        parse_recipe(raw)


def test_a_policy_is_refused_where_no_specdeploy_model_would_apply_it():
    """On a GPU backend's llmapi layout TensorRT-LLM's own model decides the draft length: `policy: cost` would be read
    by nothing, so it is refused with the fix; the same key stays valid where specdeploy's models serve (cpu, either
    layout; the GPU inflight_batcher_llm layout's BLS)."""
    base = {"name": "g", "target": {"model": "t"}, "draft": {"model": "d"}, "speculative": {"policy": "cost"}}
    with pytest.raises(ConfigError, match="speculative.policy' is cost on backend trtllm-llmapi") as info:
        parse_recipe({**base, "backend": "trtllm-llmapi"})
    assert "policy: static" in info.value.hint
    assert parse_recipe({**base, "backend": "cpu", "triton": {"layout": "llmapi"}}).speculative.policy == "cost"
    assert parse_recipe({**base, "backend": "trtllm-engine"}).speculative.policy == "cost"
