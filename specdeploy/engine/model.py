"""The CPU runtime: a Llama-family decoder (Llama, Mistral, Qwen2) over a compiled engine directory.

Exact greedy parity by construction. Speculative verification scores k+1 positions in one call while
target-only decoding scores them one call at a time; both must give bit-identical logits. Two rules
make every number a function of (weights, token, position, earlier tokens) only, never of how many
rows a call carries:

1. Every row-wise op (embedding, norms, linear layers, RoPE, MLP, LM head) runs on a tensor of exactly
   `spec.row_bucket` rows: real rows first, padding after. The GEMM kernels see one shape, hence one
   reduction order, whatever the number of real rows (a row's place in the block must not matter either:
   see compile.row_bucket_for for why fp32 buckets are multiples of 8). Weights are prepacked once.
2. Attention is computed one query row at a time over exactly the keys it may see (positions 0..p),
   so its reductions depend on p alone.

A call with more rows than the bucket (a prompt) is processed in consecutive bucket-sized chunks.
These rules hold on engines built with a max_draft_len (targets, `spec.batch_invariant`). A draft engine
is not padded (its tokens are only proposals): it runs each call's rows as they come, in chunks of up to
`row_bucket` rows, so its one-row decode steps pay for one row only.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from specdeploy.engine.kernels import PackedGemm, make_linear
from specdeploy.engine.kv_cache import KVCache
from specdeploy.engine.spec import ENGINE_WEIGHTS, EngineSpec
from specdeploy.errors import BuildError, ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Layer:
    def __init__(self, t: dict, spec: EngineSpec, dtype: torch.dtype):
        rows = spec.row_bucket if spec.batch_invariant else 1  # decode steps of a draft are one row
        def linear(name):
            sub = {k[len(name) + 1 :]: v for k, v in t.items() if k.startswith(name + ".")}
            return make_linear(sub, spec.quant_algo, dtype, spec.group_size, rows) if sub else None

        self.input_norm = t["input_norm.weight"].to(dtype)
        self.post_norm = t["post_norm.weight"].to(dtype)
        self.qkv = linear("qkv")
        self.o = linear("o")
        self.gate_up = linear("gate_up")  # fused [gate; up] when the checkpoint's scales allow it
        self.gate = linear("gate")
        self.up = linear("up")
        self.down = linear("down")
        self.kv_scale = t.get("kv_scale")

    def mlp(self, h):
        if self.gate_up is not None:
            gate, up = self.gate_up(h).chunk(2, dim=-1)  # [B, I] each
        else:
            gate, up = self.gate(h), self.up(h)
        return self.down(F.silu(gate) * up)

    def linears(self):
        return [x for x in (self.qkv, self.o, self.gate_up, self.gate, self.up, self.down) if x is not None]


class CpuEngine:
    """A compiled engine loaded for inference: `forward(cache, token_ids)` -> fp32 logits."""

    def __init__(self, spec: EngineSpec, tensors: dict, num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        dtype = self.dtype
        self.embedding = tensors["embedding.weight"].to(dtype).contiguous()  # [vocab, hidden]
        lm_head = self.embedding if "lm_head.weight" not in tensors else tensors["lm_head.weight"].to(dtype).contiguous()
        self.lm_head = PackedGemm(lm_head, None, spec.row_bucket if spec.batch_invariant else 1)  # tied: a packed copy
        self.final_norm = tensors["final_norm.weight"].to(dtype)
        self.layers = []
        for i in range(spec.num_layers):
            prefix = f"layers.{i}."
            self.layers.append(Layer({k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, spec, dtype))
        if spec.kv_cache_quant_algo is not None:
            self.kv_scales = torch.stack([layer.kv_scale.float().reshape(()) for layer in self.layers])
        else:
            self.kv_scales = None
        self.cos, self.sin = rope_tables(spec, spec.max_seq_len + spec.row_bucket)  # [positions, head_size] f32
        self.q_size = spec.num_heads * spec.head_size
        self.kv_size = spec.num_kv_heads * spec.head_size
        self.scale = 1.0 / math.sqrt(spec.head_size)

    @classmethod
    def load(cls, engine_dir: str | Path, num_threads: int | None = None) -> "CpuEngine":
        """Load an engine written by `compile_checkpoint` (the folder with config.json + model.safetensors)."""
        from safetensors.torch import load_file

        engine_dir = Path(engine_dir)
        spec = EngineSpec.read(engine_dir)
        weights = engine_dir / ENGINE_WEIGHTS
        if not weights.is_file():
            raise BuildError(f"{engine_dir} has no {ENGINE_WEIGHTS}", "rebuild it: specdeploy build RECIPE --force")
        return cls(spec, load_file(str(weights)), num_threads)

    # ------------------------------------------------------------------ public API

    def new_cache(self, max_len: int | None = None) -> KVCache:
        """An empty KV cache for one sequence of up to max_len (default: the engine's max_seq_len) tokens."""
        max_len = max_len or self.spec.max_seq_len
        if max_len > self.spec.max_seq_len:
            raise ConfigError(
                f"a cache of {max_len} positions exceeds the engine's max_seq_len ({self.spec.max_seq_len})",
                "rebuild the engine with a larger engine.max_seq_len",
            )
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_size, max_len, self.dtype, s.kv_cache_quant_algo, self.kv_scales)

    @torch.inference_mode()
    def forward(self, cache: KVCache, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] (fp32) of n tokens placed at positions cache.length.. ; advances cache.length by n."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = token_ids.numel()
        if cache.length + n > cache.max_len:
            raise ConfigError(
                f"{cache.length} cached + {n} new tokens exceed the cache of {cache.max_len} positions",
                "shorten the prompt or generate fewer tokens (engine.max_seq_len bounds both)",
            )
        if n and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.spec.vocab_size):
            raise ConfigError(f"token ids must lie in [0, {self.spec.vocab_size})", "check the tokenizer matches the model")
        bucket = self.spec.row_bucket
        chunks = [self._forward_chunk(cache, token_ids[i : i + bucket]) for i in range(0, n, bucket)]
        return torch.cat(chunks) if chunks else torch.empty(0, self.spec.vocab_size)

    def weight_bytes(self) -> int:
        """Bytes of the weights as held in memory for inference (embedding and LM head counted once if tied)."""
        total = sum(lin.nbytes() for layer in self.layers for lin in layer.linears())
        total += sum(x.numel() * x.element_size() for layer in self.layers for x in (layer.input_norm, layer.post_norm))
        total += self.embedding.numel() * self.embedding.element_size()
        if self.lm_head.weight is not self.embedding:  # packed (bf16) or untied
            total += self.lm_head.nbytes()
        return total

    # ------------------------------------------------------------------ one bucket of rows

    def _forward_chunk(self, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
        s, m, start = self.spec, ids.numel(), cache.length
        bucket = s.row_bucket if s.batch_invariant else m
        padded = torch.zeros(bucket, dtype=torch.long)
        padded[:m] = ids
        x = self.embedding[padded]  # [B, hidden] (B = the bucket; rows m.. are padding)
        cos, sin = self.cos[start : start + bucket], self.sin[start : start + bucket]  # [B, head_size]
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, s.norm_epsilon)
            qkv = layer.qkv(h)  # [B, (heads + 2 kv_heads) * head_size]
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = apply_rope(q.view(bucket, s.num_heads, s.head_size), cos, sin)  # [B, heads, head_size]
            k = apply_rope(k.view(bucket, s.num_kv_heads, s.head_size), cos, sin)  # [B, kv_heads, head_size]
            cache.write(i, start, k[:m], v.view(bucket, s.num_kv_heads, s.head_size)[:m])
            attn = self._attention(cache, i, q, start, m)  # [B, heads * head_size]
            x = x + layer.o(attn)
            x = x + layer.mlp(rms_norm(x, layer.post_norm, s.norm_epsilon))
        x = rms_norm(x, self.final_norm, s.norm_epsilon)
        logits = self.lm_head(x)  # [B, vocab]
        cache.length = start + m
        return logits[:m].float()

    def _attention(self, cache: KVCache, layer: int, q: torch.Tensor, start: int, m: int) -> torch.Tensor:
        """Causal attention, one query row at a time over exactly the keys 0..p it may see."""
        s = self.spec
        out = torch.zeros(q.shape[0], s.num_heads * s.head_size, dtype=self.dtype)  # padding rows stay 0
        for row in range(m):
            keys, values = cache.read(layer, start + row + 1)  # [kv_heads, p + 1, head_size] each
            o = F.scaled_dot_product_attention(
                q[row].unsqueeze(1).unsqueeze(0),  # [1, heads, 1, head_size]
                keys.unsqueeze(0),
                values.unsqueeze(0),
                scale=self.scale,
                enable_gqa=s.num_heads != s.num_kv_heads,
            )  # [1, heads, 1, head_size]
            out[row] = o.reshape(-1)
        return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's LlamaRMSNorm: normalize in fp32, scale in the compute dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX style rotary embedding (rotate halves) in fp32. x [B, heads, head_size], cos/sin [B, head_size]."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)


def rope_tables(spec: EngineSpec, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_size] (fp32) for positions 0..length-1, with the checkpoint's theta and scaling."""
    inv_freq = rope_inv_freq(spec.head_size, spec.rotary_base, spec.rotary_scaling)  # [head_size / 2]
    positions = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [length, head_size / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rope_inv_freq(head_size: int, base: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies as transformers computes them (default, linear, llama3)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    kind = rope_scaling_type(scaling)
    if kind is None:
        return inv_freq
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_scaling_type(scaling: dict | None) -> str | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    return None if kind in (None, "default") else kind
