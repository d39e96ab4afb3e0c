"""Tiny random models and tokenizers for tests and dry runs (no downloads, a second to build)."""

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
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def build_quietly(recipe, root: str | Path):
    """Quantize and build `recipe`'s engines under `root` with the project's own stages; returns its Layout."""
    from specdeploy.artifacts import Layout
    from specdeploy.engine import build_recipe
    from specdeploy.quantize import quantize_recipe

    layout = Layout.of(recipe, root)
    quantize_recipe(recipe, layout, echo=lambda *_: None, progress=False)
    build_recipe(recipe, layout, echo=lambda *_: None)
    return layout


# ---------------------------------------------------------------- stand-in engines (speculative tests)
# Both satisfy the CpuEngine runtime API of CONTRACTS.md (`spec`, `new_cache(max_len)`,
# `forward(cache, LongTensor[n]) -> FloatTensor[n, vocab]`, cache `.length` / `.truncate(n)`), so the
# Executor and the speculative loop can be tested without a built engine.


class EngineSpec:
    def __init__(self, vocab_size: int, max_seq_len: int = 256, max_draft_len: int = 8):
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_input_len = max_seq_len - 1
        self.max_draft_len = max_draft_len
        self.dtype = "float32"
        self.quant_algo = None


class TokenCache:
    """A 'KV cache' that keeps the tokens themselves; `length` is the position pointer."""

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.tokens: list[int] = []
        self.state = None  # engine-specific (e.g. a transformers DynamicCache)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.length, (n, self.length)
        del self.tokens[n:]


class TableEngine:
    """A bigram language model: logits of the next token = table[last token] ([vocab, vocab]).

    Exact distributions are known, which makes statistical tests of speculative sampling cheap.
    `calls` counts forward passes and `computed` the positions run.
    """

    def __init__(self, table, max_seq_len: int = 256, max_draft_len: int = 8):
        import torch

        self.table = torch.as_tensor(table, dtype=torch.float32)  # [vocab, vocab]
        self.spec = EngineSpec(self.table.shape[0], max_seq_len, max_draft_len)
        self.calls = 0
        self.computed = 0

    @classmethod
    def random(cls, vocab_size: int, seed: int, scale: float = 2.0, **kw) -> "TableEngine":
        import torch

        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(vocab_size, vocab_size, generator=g) * scale, **kw)

    def new_cache(self, max_len: int | None = None) -> TokenCache:
        return TokenCache(max_len or self.spec.max_seq_len)

    def forward(self, cache: TokenCache, token_ids):
        ids = [int(t) for t in token_ids]
        assert cache.length + len(ids) <= cache.max_len, "cache overflow"
        self.calls += 1
        self.computed += len(ids)
        cache.tokens.extend(ids)
        return self.table[ids].clone()  # [n, vocab]


class ReferenceEngine:
    """A transformers causal LM run one position at a time over a DynamicCache.

    Row i of a forward pass over n tokens is computed exactly as a one-token step would be, so
    logits do not depend on how a sequence is split into calls (bit-identical by construction),
    which is what the CPU engine guarantees with batch-invariant kernels. Slow; for tiny models.
    """

    def __init__(self, model_dir, max_seq_len: int = 256, max_draft_len: int = 8):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.spec = EngineSpec(self.model.config.vocab_size, max_seq_len, max_draft_len)
        self.calls = 0
        self.computed = 0

    def new_cache(self, max_len: int | None = None) -> TokenCache:
        return TokenCache(max_len or self.spec.max_seq_len)

    def forward(self, cache: TokenCache, token_ids):
        import torch
        from transformers import DynamicCache

        ids = [int(t) for t in token_ids]
        assert cache.length + len(ids) <= cache.max_len, "cache overflow"
        if cache.state is None:
            cache.state = DynamicCache()
        extra = cache.state.get_seq_length() - cache.length
        if extra > 0:  # rolled back: drop the positions past the pointer
            cache.state.crop(-extra)
        self.calls += 1
        self.computed += len(ids)
        rows = []
        with torch.no_grad():
            for token in ids:
                pos = cache.length
                out = self.model(
                    input_ids=torch.tensor([[token]]),
                    position_ids=torch.tensor([[pos]]),
                    past_key_values=cache.state,
                    use_cache=True,
                )
                cache.tokens.append(token)
                rows.append(out.logits[0, -1].float())
        return torch.stack(rows)  # [n, vocab]
