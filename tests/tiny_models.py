"""Tiny random models, tokenizers and recipes for the tests (no downloads, a second to build).

Test code: it lives under tests/, so the package ships none (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding lets a small draft model propose tokens that a large target verifies.",
    "def add(a, b):\n    return a + b\n",
    "Triton Inference Server serves models over HTTP and gRPC.",
    "Once upon a time there was a little robot who wanted to learn to paint.",
    "Q: What is the capital of France? A: Paris.",
] * 20

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}


def make_tokenizer(path: str | Path, vocab_size: int = 512) -> None:
    """Train a byte-level BPE tokenizer on a fixed corpus and save it as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)
    fast.save_pretrained(str(path))


def tiny_llama_config(vocab_size: int = 512, **overrides):
    from transformers import LlamaConfig

    params = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    params.update(overrides)
    return LlamaConfig(**params)


def make_tiny_model(path: str | Path, tokenizer_dir: str | Path, seed: int = 0, model_config=None, **overrides) -> None:
    """Save a random-initialized causal LM (Llama by default) with the tokenizer from tokenizer_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = model_config or tiny_llama_config(**overrides)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.eval()
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(path))


# How long a test waits for a real tritonserver to load its python models: a guard against a hang, never a claim
# about speed. Loading takes ~10 s idle and took over 180 s on a 2-core machine at load average 15-80.
SERVER_READY_TIMEOUT_S = 900

TINY_QUANT = {"calib_size": 4, "calib_max_seq_length": 32}  # calibration small enough for a test


def make_tiny_pair(root: str | Path, tokenizer_dir: str | Path, **overrides) -> tuple[Path, Path]:
    """A tiny target (seed 0) and a one-layer draft (seed 1) sharing `tokenizer_dir`, under `root`."""
    target_dir, draft_dir = Path(root) / "target-hf", Path(root) / "draft-hf"
    make_tiny_model(target_dir, tokenizer_dir, seed=0, **overrides)
    make_tiny_model(draft_dir, tokenizer_dir, seed=1, num_hidden_layers=1, **overrides)
    return target_dir, draft_dir


def tiny_pair_recipe(name: str, target_dir, draft_dir, **sections) -> dict:
    """A cpu recipe over the pair: FP8 target, INT8 weight-only draft; `sections` are merged into the top-level ones."""
    raw = {
        "name": name,
        "target": {"model": str(target_dir), "quantization": {**TINY_QUANT, "qformat": "fp8"}},
        "draft": {"model": str(draft_dir), "quantization": {**TINY_QUANT, "qformat": "int8_wo"}},
        "speculative": {"max_draft_len": 4, "num_draft_tokens": 3},
        "triton": {"startup_timeout_s": SERVER_READY_TIMEOUT_S},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def build_quietly(recipe, root: str | Path):
    """Quantize and build `recipe`'s engines under `root` with the project's own stages; returns its Layout."""
    from specdeploy.core.artifacts import Layout
    from specdeploy.deploy.cpu_build import build_recipe
    from specdeploy.quantize.stage import quantize_recipe

    layout = Layout.of(recipe, root)
    quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *_: None)
    return layout
