"""Stand-in engines for the speculative loop and the Executor tests: exact distributions, counted calls.

Both satisfy the CPU engine's runtime API (`spec`, `new_cache(max_len)`, `forward(cache, LongTensor[n]) ->
FloatTensor[n, vocab]`, cache `.length` / `.truncate(n)`; specdeploy/engine/model.py), so the Executor and the
speculative loop are tested without a built engine.
"""

from __future__ import annotations


class StandinSpec:
    """The fields of specdeploy.engine.spec.EngineSpec that the Executor and the loop read."""

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
        self.spec = StandinSpec(self.table.shape[0], max_seq_len, max_draft_len)
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
        self.spec = StandinSpec(self.model.config.vocab_size, max_seq_len, max_draft_len)
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
