"""Each pre-flight check fires on its case, and stays quiet otherwise."""

from __future__ import annotations

import json

import pytest

from specdeploy.core.errors import ConfigError
from specdeploy.core.gpus import GpuInfo, parse_nvidia_smi
from specdeploy.deploy import preflight
from specdeploy.deploy.preflight import ModelShape
from specdeploy.recipe.load import parse_recipe

GIB = 2**30
H100 = GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GIB, (9, 0))
A100 = GpuInfo(0, "NVIDIA A100-SXM4-80GB", 80 * GIB, (8, 0))

# Llama-3.1-70B / Llama-3.2-1B shapes (their Hugging Face config.json values)
LLAMA_70B = ModelShape(
    num_layers=80,
    hidden_size=8192,
    num_heads=64,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=28672,
    vocab_size=128256,
)
LLAMA_1B = ModelShape(
    num_layers=16,
    hidden_size=2048,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=8192,
    vocab_size=128256,
    tied_embeddings=True,
)


def recipe(backend="trtllm-engine", qformat="fp8", kv=None, tp=1, batch=1, seq=2048, decoupled=False, **spec):
    return parse_recipe(
        {
            "name": "pf",
            "backend": backend,
            "target": {"model": "t", "tp_size": tp, "quantization": {"qformat": qformat, "kv_cache_dtype": kv}},
            "draft": {"model": "d", "quantization": {"qformat": qformat, "kv_cache_dtype": kv}},
            "speculative": {"max_draft_len": 4, "num_draft_tokens": 4, **spec},
            "engine": {"max_batch_size": batch, "max_input_len": 1024, "max_seq_len": seq},
            "triton": {"decoupled": decoupled},
        }
    )


def checks(findings, level):
    return [f.check for f in findings if f.level == level]


def test_draft_len_larger_than_max_fires():
    import dataclasses

    r = recipe()
    too_many = dataclasses.replace(r, speculative=dataclasses.replace(r.speculative, num_draft_tokens=6))
    assert checks(preflight.check_draft_len(too_many), "error") == ["draft_len"]
    assert preflight.check_draft_len(r) == []


def test_target_engine_built_without_max_draft_len_fires():
    findings = preflight.check_draft_len(recipe(), {"build_config": {"max_draft_len": 0}})
    assert checks(findings, "error") == ["draft_len"] and "max_draft_len 0" in findings[0].message
    assert preflight.check_draft_len(recipe(), {"build_config": {"max_draft_len": 4}}) == []


def test_different_tokenizers_fire(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    from tiny_models import make_tiny_model, make_tokenizer

    other_tok = tmp_path / "tok"
    make_tokenizer(other_tok, vocab_size=300)
    other = tmp_path / "other"
    make_tiny_model(other, other_tok, vocab_size=300)
    assert checks(preflight.check_tokenizers(tiny_llama_dir, other), "error") == ["tokenizer"]
    assert checks(preflight.check_tokenizers(tiny_llama_dir, tiny_llama_draft_dir), "error") == []


def test_fp8_below_compute_capability_89_fires():
    assert checks(preflight.check_fp8(recipe(), [A100]), "error") == ["fp8"]
    assert preflight.check_fp8(recipe(), [H100]) == []
    assert checks(preflight.check_fp8(recipe(qformat="int8_sq", kv="fp8"), [A100]), "error") == ["fp8"]
    assert preflight.check_fp8(recipe(qformat="int8_sq"), [A100]) == []
    assert checks(preflight.check_fp8(recipe(), []), "info") == ["fp8"]  # no GPU: said, not failed


def test_memory_weights_that_do_not_fit_fire():
    r = recipe(qformat="full_prec", tp=1)  # 70B in bf16 on one 80 GB GPU
    findings = preflight.check_memory(r, {"target": LLAMA_70B, "draft": LLAMA_1B}, [H100])
    assert checks(findings, "error") == ["memory"] and "weights alone do not fit" in findings[0].message


def test_memory_kv_cache_pressure_warns():
    r = recipe(tp=4, batch=64, seq=8192)  # FP8 70B on 4 GPUs, a large KV demand
    gpus = [GpuInfo(i, "H100", 80 * GIB, (9, 0)) for i in range(4)]
    findings = preflight.check_memory(r, {"target": LLAMA_70B, "draft": LLAMA_1B}, gpus)
    assert checks(findings, "warning") == ["memory"]
    ok = preflight.check_memory(recipe(tp=4, batch=1, seq=4096), {"target": LLAMA_70B, "draft": LLAMA_1B}, gpus)
    assert checks(ok, "info") == ["memory"] and not checks(ok, "error") + checks(ok, "warning")


def test_memory_too_few_gpus_fires():
    findings = preflight.check_memory(recipe(tp=4), {"target": LLAMA_70B, "draft": LLAMA_1B}, [H100])
    assert "needs 4 GPUs" in [f for f in findings if f.level == "error"][0].message


def test_draft_kv_cache_is_sized_for_the_draft():
    r = recipe(tp=1, batch=8, seq=4096)
    target = preflight.estimate(r, "target", LLAMA_70B)
    draft = preflight.estimate(r, "draft", LLAMA_1B)
    # 80 layers x 8 KV heads x 128 vs 16 layers x 8 KV heads x 64: the draft needs 1/10 of the target's KV
    assert draft.kv_bytes_per_token_per_rank * 10 == target.kv_bytes_per_token_per_rank
    assert target.kv_bytes_per_token_per_rank == 2 * 80 * 8 * 128 * 2  # bf16 KV
    fp8_kv = preflight.estimate(recipe(kv="fp8"), "target", LLAMA_70B)
    assert fp8_kv.kv_bytes_per_token_per_rank == 2 * 80 * 8 * 128  # 1 byte per value
    # FP8 70B weights: ~65 GiB of 1-byte linear weights + bf16 embeddings/lm_head
    assert 60 * GIB < target.weights_bytes_per_rank < 75 * GIB


def test_bls_batch_and_streaming_fire_on_trtllm_engine():
    assert checks(preflight.check_bls(recipe(batch=8)), "warning") == ["bls"]
    # specdeploy's own BLS streams (decoupled mode), unlike NVIDIA's (tensorrtllm_backend issue #676)
    assert checks(preflight.check_bls(recipe(decoupled=True)), "error") == []
    (sizing,) = preflight.check_bls(recipe(batch=1))  # only the engine sizing for the speculative flow, said so
    assert sizing.level == "info" and "max_input_len 2047" in sizing.message and "1024" in sizing.message
    assert preflight.check_bls(recipe(backend="cpu", qformat="int8_wo", batch=8)) == []


def test_run_all_and_raise(tmp_path, tiny_llama_dir, tiny_llama_draft_dir):
    r = recipe(qformat="fp8")
    findings = preflight.run_all(r, None, [A100], {"target": tiny_llama_dir, "draft": tiny_llama_draft_dir})
    with pytest.raises(ConfigError, match="compute capability 8.9"):
        preflight.raise_on_errors(findings)
    fine = preflight.run_all(
        recipe(qformat="int8_sq"), None, [A100], {"target": tiny_llama_dir, "draft": tiny_llama_draft_dir}
    )
    preflight.raise_on_errors(fine)
    assert {f.check for f in fine} >= {"tokenizer", "memory"}


def test_model_shape_from_trtllm_checkpoint_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 2,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_size": 16,
                "intermediate_size": 128,
                "vocab_size": 512,
                "mapping": {"tp_size": 1},
            }
        )
    )
    shape = ModelShape.from_dir(tmp_path)
    assert shape.head_dim == 16 and shape.num_kv_heads == 2


def test_nvidia_smi_parsing_and_no_gpu_probe(monkeypatch):
    gpus = parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559, 9.0\n1, NVIDIA A10G, 23028, 8.6\n")
    assert gpus[0].compute_capability == (9, 0) and gpus[1].compute_capability == (8, 6)
    assert round(gpus[0].memory_gib) == 80
    import torch

    from specdeploy.core import gpus as gpu

    monkeypatch.setattr(gpu.shutil, "which", lambda name: None)  # no nvidia-smi
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # and torch sees no CUDA device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert gpu.probe() == []


def test_doctor_gpu_lines():
    from specdeploy.ops.doctor import gpu_lines as gpu_report_lines

    lines = gpu_report_lines([A100])
    assert any("compute capability 8.0" in line and "no FP8" in line for line in lines)
    assert any(line.startswith("ok  usable backends") for line in lines)
    assert "none found" in gpu_report_lines([])[0]


def test_int8_kv_cache_with_kv_reuse_fires():
    assert checks(preflight.check_kv_cache_format(recipe(qformat="int8_sq", kv="int8")), "error") == ["kv_cache"] * 2
    assert checks(preflight.check_kv_cache_format(recipe(qformat="int4_awq", kv="fp8")), "warning") == ["kv_cache"] * 2
    assert preflight.check_kv_cache_format(recipe(kv="fp8")) == []
    assert preflight.check_kv_cache_format(recipe(backend="cpu", qformat="int8_sq", kv="int8")) == []


def test_llmapi_version_problems_are_preflight_errors():
    import dataclasses

    ok = dataclasses.replace(recipe(backend="trtllm-llmapi"), trtllm_version="1.4")
    assert checks(preflight.check_llmapi_options(ok), "info") == ["llmapi"]
    rc3 = dataclasses.replace(ok, trtllm_version="1.3.0rc3")  # straddles the renames
    assert checks(preflight.check_llmapi_options(rc3), "error") == ["llmapi"]
    logits = recipe(backend="trtllm-llmapi", use_draft_logits=True)
    assert "use_draft_logits" in preflight.check_llmapi_options(logits)[0].message
    # trtllm-engine has no LLM-API options: its backend does not list the check, so run_all never runs it
    engine_findings = preflight.run_all(recipe(), gpus=[], model_dirs={"target": None, "draft": None})
    assert "llmapi" not in checks(engine_findings, "info") + checks(engine_findings, "error")
    assert "fp8" in checks(engine_findings, "info")  # the GPU checks do run for it


# ---------------------------------------------------------------- EAGLE-3 head (draft.kind eagle3)


def eagle3_recipe(head, backend="trtllm-llmapi"):
    return parse_recipe(
        {
            "name": "pf",
            "backend": backend,
            "target": {"model": "t"},
            "draft": {"kind": "eagle3", "head": str(head)},
            "speculative": {"max_draft_len": 3, "num_draft_tokens": 3},
        }
    )


def write_config(directory, **config):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def eagle3_dirs(tmp_path):
    target = write_config(tmp_path / "target", hidden_size=4096, vocab_size=128256, num_hidden_layers=32)
    head = write_config(
        tmp_path / "head",
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=4096,
        vocab_size=128256,
        draft_vocab_size=32000,
        num_hidden_layers=1,
    )
    (head / "pytorch_model.bin").write_bytes(b"weights")  # the published heads ship .bin
    return target, head


def test_eagle3_head_matching_the_target_passes(eagle3_dirs):
    target, head = eagle3_dirs
    findings = preflight.check_eagle3_head(eagle3_recipe(head), target_dir=target)
    assert checks(findings, "error") == [] and checks(findings, "info") == ["eagle3_head"]


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_size", 2048, "hidden_size 4096"),  # a head for another model size
        ("vocab_size", 151936, "vocab_size 128256"),  # a head for another tokenizer
        ("eagle_aux_hidden_state_layer_ids", [1, 40, 76], "has 32 layers"),  # layers the target does not have
    ],
)
def test_eagle3_head_for_another_target_is_an_error_naming_both_files(eagle3_dirs, field, value, named):
    target, head = eagle3_dirs
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**config, field: value}))
    errors = [f for f in preflight.check_eagle3_head(eagle3_recipe(head), target_dir=target) if f.level == "error"]
    assert len(errors) == 1 and named in errors[0].message
    assert str(head / "config.json") in errors[0].message and str(target / "config.json") in errors[0].message
    assert "trained for this target" in errors[0].hint


def test_eagle3_head_target_hidden_size_is_what_counts(eagle3_dirs):
    # heads whose own width differs from the target's declare target_hidden_size (e.g. NVIDIA's Llama 4 heads)
    target, head = eagle3_dirs
    write_config(head, hidden_size=5120, target_hidden_size=4096, vocab_size=128256)
    assert checks(preflight.check_eagle3_head(eagle3_recipe(head), target_dir=target), "error") == []


def test_missing_eagle3_head_is_an_error_with_the_download(tmp_path, eagle3_dirs):
    target, _ = eagle3_dirs
    errors = [
        f
        for f in preflight.check_eagle3_head(eagle3_recipe(tmp_path / "nowhere"), target_dir=target)
        if f.level == "error"
    ]
    assert "no config.json" in errors[0].message and "huggingface-cli download" in errors[0].hint


def test_eagle3_head_runs_in_every_backends_preflight_and_is_quiet_otherwise(eagle3_dirs):
    target, head = eagle3_dirs
    found = preflight.run_all(eagle3_recipe(head), gpus=[H100], model_dirs={"target": target, "draft": None})
    assert "eagle3_head" in checks(found, "info") and checks(found, "error") == []
    assert preflight.check_eagle3_head(recipe(), target_dir=target) == []


def test_a_served_vocabulary_is_checked_against_the_head_before_any_build(eagle3_dirs, tmp_path):
    """draft.serve_vocab_size (backend cpu): past the head's draft vocabulary, or without the counts file beside the
    head, is an error of `specdeploy run`'s check before quantize, naming the head and the fix (before, only
    `specdeploy repo` found it)."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.recipe.config import EAGLE3_VOCAB_COUNTS

    _, head = eagle3_dirs

    def served(size):
        raw = {
            "name": "pf",
            "backend": "cpu",
            "target": {"model": "t"},
            "draft": {"kind": "eagle3", "head": str(head), "serve_vocab_size": size},
            "speculative": {"max_draft_len": 3, "num_draft_tokens": 3},
        }
        return parse_recipe(raw)

    def errors(recipe, layout=None):
        layout = layout or Layout.of(recipe, tmp_path / "elsewhere")
        return [f for f in preflight.check_served_vocabulary(recipe, layout) if f.level == "error"]

    too_many = errors(served(40000))
    assert len(too_many) == 1 and "has 32000 draft tokens" in too_many[0].message and "1..32000" in too_many[0].hint
    missing = errors(served(4096))
    assert len(missing) == 1 and str(head) in missing[0].message and EAGLE3_VOCAB_COUNTS in missing[0].message
    assert f"specdeploy draft vocab-counts {head} --data DRAFT_DATA_DIR" in missing[0].hint
    recipe = served(4096)  # the recipe's own draft data, where it has some, is the folder the fix names
    layout = Layout.of(recipe, tmp_path / "root")
    layout.draft_data.mkdir(parents=True)
    (layout.draft_data / "train.jsonl").write_text("{}\n")
    hint = errors(recipe, layout)[0].hint
    assert f"--data {layout.draft_data}," in hint
    (head / EAGLE3_VOCAB_COUNTS).write_text(json.dumps({"counts": [1] * 32000}))
    assert errors(served(4096)) == []
    assert errors(served(32000)) == []  # the whole vocabulary


def test_specdeploy_run_refuses_what_its_last_stages_would_before_quantizing(tmp_path):
    """A bad draft-length sweep, a missing prompt set, a missing EAGLE-3 head and a detached server of the same recipe
    stop `specdeploy run` before its first stage (each was found only after quantize, build and serve)."""
    import os

    from eagle3_heads import make_eagle3_head

    from specdeploy.core.artifacts import Layout, process_identity
    from specdeploy.core.errors import SpecDeployError
    from specdeploy.deploy import pipeline
    from specdeploy.triton.server_state import ServerState

    head = make_eagle3_head(tmp_path / "head", 64, 512, draft_vocab_size=64)

    def attempt(draft=None, validation=None, **overrides):
        recipe = parse_recipe(
            {
                "name": "pf",
                "backend": "cpu",
                "target": {"model": str(tmp_path / "no-model")},
                "draft": draft or {"kind": "eagle3", "head": str(head)},
                "validation": validation or {},
                "speculative": {"max_draft_len": 3, "num_draft_tokens": 3},
            }
        )
        layout = Layout.of(recipe, tmp_path / "root")
        lines = []
        with pytest.raises(SpecDeployError) as err:
            pipeline.run(recipe, layout, "pf.yaml", echo=lines.append, progress=False, **overrides)
        assert not any(line.startswith("== quantize") for line in lines) and not layout.checkpoint("target").exists()
        return err.value, layout

    assert (
        "k=5, outside 1..3" in attempt(sweep_draft_tokens=(1, 5), report_dir=str(tmp_path / "report"))[0].message
    )  # validate's own key too
    assert "nowhere.jsonl not found" in attempt(validation={"prompt_set": str(tmp_path / "nowhere.jsonl")})[0].message
    # a second prompt set (run --also-prompt-set) is checked as well, before the first stage
    assert "gone.jsonl not found" in attempt(also=((str(tmp_path / "gone.jsonl"), 4),))[0].message
    assert "must be a non-negative integer" in attempt(also=(("sharegpt:x", 4),))[0].message
    missing = attempt(draft={"kind": "eagle3", "head": str(tmp_path / "no-head")})[0]
    assert (
        "no EAGLE-3 head at" in missing.message
        and missing.hint == "set draft.head to an exported EAGLE-3 checkpoint folder"
    )
    untrained = attempt(draft={"kind": "eagle3", "head": "trained"})[0]  # `draft train` has not written it yet
    assert (
        "no EAGLE-3 head at" in untrained.message and untrained.hint == "train it with: specdeploy draft train pf.yaml"
    )
    layout = Layout.of(
        parse_recipe({"name": "pf", "target": {"model": "m"}, "draft": {"kind": "ngram"}}), tmp_path / "root"
    )
    layout.server_state.mkdir(parents=True, exist_ok=True)
    me = process_identity(os.getpid())  # this process stands in for the detached server: alive, and who it says it is
    ServerState(
        pid=me.pid,
        grpc_port=1,
        http_port=2,
        metrics_port=3,
        log="x",
        repo="r",
        started=0.0,
        start_ticks=me.start_ticks,
        cmdline=list(me.cmdline),
    ).write(layout.server_state)
    error, _ = attempt()
    assert "runs detached (pid" in error.message and "specdeploy stop pf.yaml" in error.hint


def test_specdeploy_run_refuses_a_prompt_longer_than_max_input_len_before_quantizing(tmp_path):
    """The server would refuse it only after quantize, build and serve: `run` counts each prompt of the set with the
    target's tokenizer (the bundled model's) first."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.core.errors import ConfigError
    from specdeploy.deploy import pipeline

    prompts = tmp_path / "mine.jsonl"
    prompts.write_text(json.dumps({"prompt": "word " * 80, "category": "long"}) + "\n" + '{"prompt": "Hi"}\n')
    recipe = parse_recipe(
        {
            "name": "pf",
            "backend": "cpu",
            "target": {"model": "smollm2-135m-instruct"},
            "draft": {"kind": "ngram"},
            "engine": {"max_input_len": 64, "max_seq_len": 256},
            "validation": {"prompt_set": str(prompts)},
        }
    )
    layout = Layout.of(recipe, tmp_path / "root")
    lines = []
    with pytest.raises(
        ConfigError,
        match=r"1 prompt\(s\) of .*mine.jsonl are longer than the deployment's max_input_len \(64 tokens\):"
        r" long-0 \(\d+ tokens\)",
    ):
        pipeline.run(recipe, layout, "pf.yaml", echo=lines.append, progress=False)
    assert not any(line.startswith("== quantize") for line in lines) and not layout.checkpoint("target").exists()


def test_specdeploy_run_refuses_a_served_vocabulary_without_counts_before_quantizing(tmp_path):
    """On the cpu backend `specdeploy run` checks draft.serve_vocab_size against the head before its first stage."""
    from eagle3_heads import make_eagle3_head

    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy import pipeline

    head = make_eagle3_head(tmp_path / "head", 64, 512, draft_vocab_size=64)
    recipe = parse_recipe(
        {
            "name": "pf",
            "backend": "cpu",
            "target": {"model": str(tmp_path / "no-model")},
            "draft": {"kind": "eagle3", "head": str(head), "serve_vocab_size": 8},
            "speculative": {"max_draft_len": 3, "num_draft_tokens": 3},
        }
    )
    layout = Layout.of(recipe, tmp_path / "root")
    lines = []
    with pytest.raises(ConfigError, match="draft_vocab_counts.json") as err:
        pipeline.run(recipe, layout, "pf.yaml", echo=lines.append, progress=False)
    assert "specdeploy draft vocab-counts" in err.value.hint
    assert not any(line.startswith("== quantize") for line in lines) and not layout.checkpoint("target").exists()
