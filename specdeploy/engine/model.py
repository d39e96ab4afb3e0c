"""The CPU runtime: a Llama-family decoder (Llama, Mistral, Qwen2) over a compiled engine directory.

Exact greedy parity by construction. Speculative verification scores k+1 positions in one call while
target-only decoding scores them one call at a time; both must give bit-identical logits. Two rules
make every number a function of (weights, token, position, earlier tokens) only, never of how many
rows a call carries:

1. Row-wise ops (embedding, norms, linear layers, RoPE, MLP, LM head) give each row the same bits
   whatever the number of rows. Elementwise ops and last-dimension reductions do so by nature; so do
   the GEMM kernels marked `row_invariant` in kernels.py (oneDNN's prepacked bf16 GEMM, torch's int8 and
   int4 weight-only GEMMs), which then run on the real rows only: a decode step is a 1-row GEMV. An
   engine with a kernel that is not row-invariant (MKL's fp32/fp16 GEMMs) runs every call of a target
   on exactly `spec.row_bucket` rows instead, real rows first, padding after (see compile.row_bucket_for
   for why fp32 buckets are multiples of 8).
2. Attention is computed one query row at a time over exactly the keys it may see (positions 0..p),
   in f32, so its reductions depend on p alone.

Calls longer than a chunk (prompts) are processed in consecutive chunks. A draft engine is never padded
(its tokens are only proposals, `spec.batch_invariant` is false).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from specdeploy.core.errors import BuildError, ConfigError
from specdeploy.engine import native
from specdeploy.engine.kernels import NativeLinear, PackedGemm, make_linear
from specdeploy.engine.kv_cache import KVCache
from specdeploy.engine.lm_screen import ScreenedHead
from specdeploy.engine.spec import ENGINE_WEIGHTS, UNPADDED_CHUNK, EngineSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Layer:
    def __init__(self, t: dict, spec: EngineSpec, dtype: torch.dtype, native_ops=None):
        def linear(name):
            sub = {k[len(name) + 1 :]: v for k, v in t.items() if k.startswith(name + ".")}
            return make_linear(sub, spec.quant_algo, dtype, spec.group_size, native_ops) if sub else None

        self.input_norm = t["input_norm.weight"].to(dtype)
        self.post_norm = t["post_norm.weight"].to(dtype)
        self.qkv = linear("qkv")
        self.o = linear("o")
        self.gate_up = linear("gate_up")  # fused [gate; up] when the checkpoint's scales allow it
        self.gate = linear("gate")
        self.up = linear("up")
        self.down = linear("down")
        self.kv_scale = t.get("kv_scale")

    def mlp(self, h, residual, native_ops=None):
        """residual + down(silu(gate(h)) * up(h))."""
        if self.gate_up is not None and native_ops is not None:
            return self.down(native_ops.swiglu(self.gate_up(h)), residual=residual)
        if self.gate_up is not None:
            gate, up = self.gate_up(h).chunk(2, dim=-1)  # [B, I] each
        else:
            gate, up = self.gate(h), self.up(h)
        return self.down(F.silu(gate) * up, residual=residual)

    def linears(self):
        return [x for x in (self.qkv, self.o, self.gate_up, self.gate, self.up, self.down) if x is not None]


class LazyTensors(Mapping):
    """The tensors of a safetensors file, each read from disk when asked, so the engine packs one layer at a
    time and loading holds little more than the packed weights. safetensors' own `safe_open` hands out views
    of a memory map, whose pages stay resident until it closes: +165 MB at the peak of loading the default
    target, and, with one view kept alive, for good. The format (an 8-byte little-endian header length, a
    JSON header of dtype, shape and data_offsets, then the data) is read here with plain file reads."""

    DTYPES = {
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "F32": torch.float32,
        "F64": torch.float64,
        "F8_E4M3": torch.float8_e4m3fn,
        "I8": torch.int8,
        "U8": torch.uint8,
        "I32": torch.int32,
        "I64": torch.int64,
        "BOOL": torch.bool,
    }

    def __init__(self, path: Path):
        self.file = open(path, "rb")
        size = int.from_bytes(self.file.read(8), "little")
        self.entries = json.loads(self.file.read(size))
        self.entries.pop("__metadata__", None)
        self.data_start = 8 + size

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        tensor = torch.empty(entry["shape"], dtype=self.DTYPES[entry["dtype"]])
        self.file.seek(self.data_start + begin)
        if self.file.readinto(tensor.reshape(-1).view(torch.uint8).numpy()) != end - begin:
            raise BuildError(f"{self.file.name} is truncated at {name}", "rebuild it: specdeploy build RECIPE --force")
        return tensor

    def __contains__(self, name) -> bool:
        return name in self.entries

    def __iter__(self):
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


class CpuEngine:
    """A compiled engine loaded for inference: `forward(cache, token_ids)` -> fp32 logits."""

    def __init__(self, spec: EngineSpec, tensors: dict, num_threads: int | None = None):
        if num_threads:
            torch.set_num_threads(num_threads)
        self.spec = spec
        self.dtype = DTYPES[spec.dtype]
        dtype = self.dtype
        self.native = native.ops() if dtype == torch.bfloat16 else None  # torch.ops.specdeploy_cpu or None
        self.embedding = tensors["embedding.weight"].to(dtype).contiguous()  # [vocab, hidden]
        tied = "lm_head.weight" not in tensors
        lm_head = self.embedding if tied else tensors["lm_head.weight"].to(dtype).contiguous()
        # forward_batch's lm_rows: an LM head over some rows is cut from the embedding table where the two are one
        # tensor (kept anyway); an untied head is not kept twice for it (its rows are then taken from full logits)
        self._lm_head_rows_of = lm_head if tied else None
        self._row_heads: dict[bytes, object] = {}  # lm_rows ids -> their LM head (one packed copy per id set)
        if self.native is not None and NativeLinear.supports(self.native, {"weight": lm_head}, None, None):
            self.lm_head = NativeLinear(self.native, {"weight": lm_head}, None, dtype, None)  # tied: a packed copy
        else:
            self.lm_head = PackedGemm(lm_head, None)
        # greedy rows' LM head: an int8 screen, then the bf16 rows that can win (lm_screen.py); None where it cannot run
        self.screen = ScreenedHead(self.native, lm_head, self.lm_head) if ScreenedHead.supports(self.lm_head) else None
        self.final_norm = tensors["final_norm.weight"].to(dtype)
        self.layers = []
        for i in range(spec.num_layers):
            prefix = f"layers.{i}."
            layer_tensors = {k[len(prefix) :]: tensors[k] for k in tensors if k.startswith(prefix)}
            self.layers.append(Layer(layer_tensors, spec, dtype, self.native))
        kernels = [self.lm_head] + [lin for layer in self.layers for lin in layer.linears()]
        # Rows every call of a target is padded to (None: run the real rows), and rows per chunk.
        self.pad_rows = spec.row_bucket if spec.batch_invariant and not all(k.row_invariant for k in kernels) else None
        self.chunk_rows = self.pad_rows or max(spec.row_bucket, UNPADDED_CHUNK)
        if spec.kv_cache_quant_algo is not None:
            self.kv_scales = torch.stack([layer.kv_scale.float().reshape(()) for layer in self.layers])
        else:
            self.kv_scales = None
        self.cos, self.sin = rope_tables(spec, spec.max_seq_len + self.chunk_rows)  # [positions, head_size] f32
        self.q_size = spec.num_heads * spec.head_size
        self.kv_size = spec.num_kv_heads * spec.head_size
        self.scale = 1.0 / math.sqrt(spec.head_size)
        self.decoder = self._native_decoder()

    @classmethod
    def load(cls, engine_dir: str | Path, num_threads: int | None = None) -> "CpuEngine":
        """Load an engine written by `compile_checkpoint` (the folder with config.json + model.safetensors)."""
        engine_dir = Path(engine_dir)
        spec = EngineSpec.read(engine_dir)
        weights = engine_dir / ENGINE_WEIGHTS
        if not weights.is_file():
            raise BuildError(f"{engine_dir} has no {ENGINE_WEIGHTS}", "rebuild it: specdeploy build RECIPE --force")
        with LazyTensors(weights) as tensors:
            return cls(spec, tensors, num_threads)

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
        return KVCache(
            s.num_layers, s.num_kv_heads, s.head_size, max_len, self.dtype, s.kv_cache_quant_algo, self.kv_scales
        )

    @torch.inference_mode()
    def forward(
        self, cache: KVCache, token_ids: torch.Tensor, aux_layers: tuple[int, ...] | None = None, greedy: bool = False
    ):
        """Logits [n, vocab] (fp32) of n tokens placed at positions cache.length.. ; advances cache.length by n.
        With `aux_layers` (an EAGLE-3 head's layer ids, ascending): (logits, aux) where aux [n, len * hidden]
        (compute dtype) holds the outputs of those layers for every row, concatenated in layer order. The
        logits are the same bits either way (capture only copies rows out between layers).
        greedy=True: the caller takes only each row's argmax, so the LM head may be screened (`_logits`): every
        token that can be a row's maximum keeps its exact logit, the others are -inf."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        n = token_ids.numel()
        if cache.length + n > cache.max_len:
            raise ConfigError(
                f"{cache.length} cached + {n} new tokens exceed the cache of {cache.max_len} positions",
                "shorten the prompt or generate fewer tokens (engine.max_seq_len bounds both)",
            )
        if n and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.spec.vocab_size):
            raise ConfigError(
                f"token ids must lie in [0, {self.spec.vocab_size})", "check the tokenizer matches the model"
            )
        if aux_layers is None:
            return self._forward_rows(cache, token_ids, None, greedy=greedy)
        aux: list[torch.Tensor] = []
        logits = self._forward_rows(cache, token_ids, None, self._check_aux(aux_layers), aux, greedy)
        return logits, self._join_aux(aux, aux_layers)

    def _check_aux(self, aux_layers) -> tuple[int, ...]:
        layers = tuple(aux_layers)
        if list(layers) != sorted(set(layers)) or not layers or not 0 <= layers[0] <= layers[-1] < self.spec.num_layers:
            raise ConfigError(
                f"aux_layers {list(layers)} must be distinct ascending layer ids in 0..{self.spec.num_layers - 1}",
                "check the EAGLE-3 head's eagle_aux_hidden_state_layer_ids",
            )
        return layers

    def _join_aux(self, parts: list[torch.Tensor], layers) -> torch.Tensor:
        if not parts:
            return torch.empty(0, len(layers) * self.spec.hidden_size, dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _forward_rows(
        self, cache: KVCache, token_ids: torch.Tensor, keep: int | None, aux_layers=None, aux=None, greedy: bool = False
    ) -> torch.Tensor:
        """forward's chunks; logits of the last `keep` rows only (None: all). With aux_layers, each chunk's
        aux features [m, len * hidden] are appended to the list `aux`."""
        n, step = token_ids.numel(), self.chunk_rows
        first_kept = 0 if keep is None else n - min(keep, n)
        chunks = []
        for i in range(0, n, step):
            end = min(i + step, n)
            chunks.append(
                self._forward_chunk(cache, token_ids[i:end], max(0, end - max(i, first_kept)), aux_layers, aux, greedy)
            )
        if len(chunks) == 1:  # a decode step or a verification pass: no copy of the logits
            return chunks[0]
        return torch.cat(chunks) if chunks else torch.empty(0, self.spec.vocab_size)

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: list[KVCache],
        token_ids: list[torch.Tensor],
        keep: list[int | None] | None = None,
        aux_layers: tuple[int, ...] | None = None,
        capture: list[bool] | None = None,
        greedy: list[bool] | None = None,
        lm_rows: torch.Tensor | None = None,
    ):
        """Several sequences' new tokens in one pass (in-flight batching): sequence i places token_ids[i] at
        positions caches[i].length.. and gets back the fp32 logits of its last keep[i] rows (None: all).
        lm_rows (vocabulary ids): the logits of those tokens only, in that order ([rows, len(lm_rows)]; an EAGLE-3
        head's training labels over its draft vocabulary), the bits the whole LM head gives them (its kernels reduce
        each output column alone: tests/test_batching.py).

        The row-wise ops (embedding, norms, linear layers, LM head) run once over the concatenated rows of
        every sequence, so each weight is read once for the whole batch; attention runs per sequence over
        its own cache. Rows do not depend on their neighbours (rule 1 of the module docstring), so each
        sequence's logits are bit-identical to `forward(caches[i], token_ids[i])` alone: batch invariance.
        An engine that pads its calls (a kernel that is not row-invariant) runs the sequences one by one.
        greedy[i]: sequence i takes only its rows' argmax (see `forward`); the kept rows are screened together
        where every sequence with kept rows is greedy."""
        ids = [torch.as_tensor(t, dtype=torch.long).reshape(-1) for t in token_ids]
        keep = list(keep) if keep is not None else [None] * len(ids)
        if len(caches) != len(ids) or len(keep) != len(ids):
            raise ValueError(f"{len(caches)} caches, {len(ids)} token lists and {len(keep)} keep counts must agree")
        if len(set(map(id, caches))) != len(caches):
            raise ValueError("a cache appears twice in one batch")
        for cache, t in zip(caches, ids):
            if cache.length + t.numel() > cache.max_len:
                raise ConfigError(
                    f"{cache.length} cached + {t.numel()} new tokens exceed the cache of {cache.max_len} positions",
                    "shorten the prompt or generate fewer tokens (engine.max_seq_len bounds both)",
                )
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.spec.vocab_size):
                raise ConfigError(
                    f"token ids must lie in [0, {self.spec.vocab_size})", "check the tokenizer matches the model"
                )
        layers = None if aux_layers is None else self._check_aux(aux_layers)
        capture = list(capture) if capture is not None else [True] * len(ids)
        greedy = list(greedy) if greedy is not None else [False] * len(ids)
        if self.pad_rows is not None or (len(ids) == 1 and lm_rows is None):
            logits, aux = [], []
            for cache, t, k, c, g in zip(caches, ids, keep, capture, greedy):
                parts = [] if layers is not None and c else None
                logits.append(self._forward_rows(cache, t, k, layers if parts is not None else None, parts, g))
                aux.append(None if parts is None else self._join_aux(parts, layers))
            if lm_rows is not None:
                logits = [x.index_select(-1, lm_rows) for x in logits]
            return logits if layers is None else (logits, aux)
        sizes = [t.numel() for t in ids]
        starts = [cache.length for cache in caches]
        x = self.embedding[torch.cat(ids)]  # [rows of all sequences, hidden]
        captured = []  # [rows, hidden] after each aux layer
        if self.decoder is not None and all(cache.quant_algo is None for cache in caches):
            x = self._native_batch(x, caches, starts, sizes, layers, captured)
        else:
            x = self._layers_batch(x, caches, starts, sizes, layers, captured)
        rows, offset = [], 0  # the rows whose logits are wanted, per sequence
        for n, k in zip(sizes, keep):
            take = n if k is None else min(k, n)
            rows.append(torch.arange(offset + n - take, offset + n))
            offset += n
        index = torch.cat(rows)
        if lm_rows is not None:
            logits = self._row_logits(self._norm(x[index], self.final_norm), lm_rows)  # [kept rows, len(lm_rows)]
        elif index.numel():
            argmax_only = all(g for g, r in zip(greedy, rows) if len(r))  # exact rows for one: exact rows for all
            logits = self._logits(self._norm(x[index], self.final_norm), argmax_only)  # [kept rows, vocab]
        else:
            logits = torch.empty(0, self.spec.vocab_size)
        for cache, start, n in zip(caches, starts, sizes):
            cache.length = start + n
        logits = list(torch.split(logits, [len(r) for r in rows]))
        if layers is None:
            return logits
        joined = torch.cat(captured, dim=-1)  # [rows, len * hidden]
        aux, offset = [], 0
        for n, c in zip(sizes, capture):
            aux.append(joined[offset : offset + n] if c else None)
            offset += n
        return logits, aux

    def _native_batch(self, x, caches, starts, sizes, layers, captured) -> torch.Tensor:
        """The layers over the rows of one or more sequences in one native call (csrc Decoder.forward_batch); with
        aux `layers`, forward_capture, whose copies of the sequences' rows (not padding) after those layers go to
        `captured`."""
        keys, values = [c.keys for c in caches], [c.values for c in caches]
        if layers is None:
            return self.decoder.forward_batch(x, keys, values, starts, sizes)
        x, rows = self.decoder.forward_capture(x, keys, values, starts, sizes, list(layers))
        captured.extend(rows)
        return x

    def _layers_batch(self, x, caches, starts, sizes, layers, captured) -> torch.Tensor:
        """forward_batch's layers op by op (torch ops, or native kernels where the decoder cannot run)."""
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(x, layer.input_norm))  # [rows, (heads + 2 kv_heads) * head_size]
            parts, offset = [], 0
            for cache, start, n in zip(caches, starts, sizes):  # each sequence over its own keys
                parts.append(self._attention(cache, i, qkv[offset : offset + n], start, n))
                offset += n
            x = layer.o(parts[0] if len(parts) == 1 else torch.cat(parts), residual=x)
            x = layer.mlp(self._norm(x, layer.post_norm), x, self.native)
            if layers is not None and i in layers:
                captured.append(x.clone())
        return x

    def weight_bytes(self) -> int:
        """Bytes of the weights as held in memory for inference (the embedding table and the LM head's packed
        copy both count, also when the checkpoint ties them)."""
        return self.embedding.numel() * self.embedding.element_size() + self.bytes_per_token()

    def bytes_per_token(self) -> int:
        """Weight bytes one decode step reads: every layer, the final norm and the LM head (of the embedding
        table only one row, not counted). Over memory bandwidth, the floor of a step's time."""
        total = sum(lin.nbytes() for layer in self.layers for lin in layer.linears())
        total += sum(x.numel() * x.element_size() for layer in self.layers for x in (layer.input_norm, layer.post_norm))
        return total + self.lm_head.nbytes() + self.final_norm.numel() * self.final_norm.element_size()

    # ------------------------------------------------------------------ one bucket of rows

    def _native_decoder(self):
        """All layers in one native call (csrc Decoder), where every layer runs on native kernels with a fused
        gate/up projection; else None and _forward_chunk loops over the layers in Python."""
        s = self.spec
        if self.native is None or not all(
            all(isinstance(getattr(layer, name), NativeLinear) for name in _native_linears(layer))
            for layer in self.layers
        ):
            return None
        decoder = torch.classes.specdeploy_cpu.Decoder(
            s.num_layers, s.num_heads, s.num_kv_heads, self.scale, s.norm_epsilon, self.cos, self.sin
        )
        for i, layer in enumerate(self.layers):
            _set_layer(decoder, i, layer)
        return decoder

    def _forward_chunk(
        self,
        cache: KVCache,
        ids: torch.Tensor,
        keep: int | None = None,
        aux_layers=None,
        aux=None,
        greedy: bool = False,
    ) -> torch.Tensor:
        """Logits [m, vocab] of one chunk of m rows, or of its last `keep` rows (the others skip the LM head,
        except in an engine that pads: its LM head runs on all rows, as every call). With aux_layers, the
        outputs of those layers for the m rows go to `aux` as one [m, len * hidden] tensor."""
        s, m, start = self.spec, ids.numel(), cache.length
        rows = self.pad_rows or m
        x = self.embedding[F.pad(ids, (0, rows - m))]  # [rows, hidden] (rows m.. are padding)
        captured = []
        if self.decoder is not None and cache.quant_algo is None:
            x = self._native_batch(x, [cache], [start], [m], aux_layers, captured)  # the loop below, in one native call
        else:
            for i, layer in enumerate(self.layers):
                qkv = layer.qkv(self._norm(x, layer.input_norm))  # [rows, (heads + 2 kv_heads) * head_size]
                x = layer.o(self._attention(cache, i, qkv, start, m), residual=x)
                x = layer.mlp(self._norm(x, layer.post_norm), x, self.native)
                if aux_layers is not None and i in aux_layers:
                    captured.append(x[:m].clone())
        if aux_layers is not None:
            aux.append(torch.cat(captured, dim=-1))  # [m, len * hidden]
        cache.length = start + m
        if keep is not None and keep < m and self.pad_rows is None:
            if keep <= 0:
                return torch.empty(0, s.vocab_size)
            x = x[m - keep : m]  # the LM head's rows are independent: only the kept ones are computed
            return self._logits(self._norm(x, self.final_norm), greedy)  # [keep, vocab]
        first = 0 if keep is None else m - min(keep, m)
        if greedy and self.pad_rows is None:
            return self._logits(self._norm(x[first:m], self.final_norm), True)
        logits = self.lm_head(self._norm(x, self.final_norm))  # [rows, vocab]
        return logits[first:m].float()

    def _logits(self, h: torch.Tensor, greedy: bool) -> torch.Tensor:
        """fp32 logits [rows, vocab] of the final norm's rows h. greedy: through the screen (lm_screen.py) where
        the engine has one and the rows are few enough for it to pay, exact for the tokens that can win."""
        if greedy and self.screen is not None and h.shape[0] <= self.screen.max_rows:
            return self.screen.argmax_rows(h)
        return self.lm_head(h).float()

    def _row_logits(self, h: torch.Tensor, lm_rows: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, len(lm_rows)] of the final norm's rows h over the tokens lm_rows: a GEMM over those
        rows of the LM head (1/6 of SmolLM2's for an 8,192-token draft vocabulary), or the whole head's columns."""
        if self._lm_head_rows_of is None:
            return self.lm_head(h).float().index_select(-1, lm_rows)
        key = lm_rows.to(torch.int64).numpy().tobytes()
        if key not in self._row_heads:
            weight = self._lm_head_rows_of.index_select(0, lm_rows).contiguous()  # [len(lm_rows), hidden]
            if self.native is not None and NativeLinear.supports(self.native, {"weight": weight}, None, None):
                self._row_heads[key] = NativeLinear(self.native, {"weight": weight}, None, self.dtype, None)
            else:
                self._row_heads[key] = PackedGemm(weight, None)
        return self._row_heads[key](h).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rms_norm(x, weight, self.spec.norm_epsilon)
        return rms_norm(x, weight, self.spec.norm_epsilon)

    def _attention(self, cache: KVCache, layer: int, qkv: torch.Tensor, start: int, m: int) -> torch.Tensor:
        """RoPE on q and k, k and v of rows 0..m-1 into the cache, then causal attention in f32, one query row
        at a time over exactly the keys 0..p it may see. qkv [rows, ...] -> [rows, heads * head_size]."""
        s, rows = self.spec, qkv.shape[0]
        if self.native is not None and cache.quant_algo is None:
            return self.native.attention(
                qkv,
                self.cos,
                self.sin,
                cache.keys[layer],
                cache.values[layer],
                start,
                m,
                s.num_heads,
                s.num_kv_heads,
                self.scale,
            )
        cos, sin = self.cos[start : start + rows], self.sin[start : start + rows]  # [rows, head_size]
        qk_heads, qk_size = s.num_heads + s.num_kv_heads, self.q_size + self.kv_size
        qk = apply_rope(qkv[:, :qk_size].view(rows, qk_heads, s.head_size), cos, sin)  # [rows, qk_heads, head_size]
        q, k = qk.split([s.num_heads, s.num_kv_heads], dim=1)
        cache.write(layer, start, k[:m], qkv[:m, qk_size:].view(m, s.num_kv_heads, s.head_size))
        qf = q.float().view(rows, s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_size)  # grouped by kv head
        out = []
        all_keys, all_values = cache.read(layer, start + m)  # [kv_heads, start + m, head_size] each, f32, read once
        for row in range(m):  # (a quantized cache dequantizes once per chunk, not once per row: no quadratic prefill)
            keys, values = all_keys[:, : start + row + 1], all_values[:, : start + row + 1]  # positions 0..p
            scores = torch.bmm(qf[row], keys.transpose(1, 2)).mul_(self.scale)  # [kv_heads, groups, p + 1]
            out.append(torch.bmm(torch.softmax(scores, dim=-1), values).view(1, -1))  # [1, heads * head_size]
        if rows > m:
            out.append(torch.zeros(rows - m, s.num_heads * s.head_size))
        return (out[0] if len(out) == 1 else torch.cat(out)).to(self.dtype)


def _native_linears(layer: Layer) -> tuple[str, ...]:
    """The linears a native Decoder layer runs: gate and up apart where the checkpoint keeps them apart (int8_sq:
    each has its own smoothing and activation scales), else the fused gate_up."""
    if layer.gate_up is not None:
        return ("qkv", "o", "gate_up", "down")
    return ("qkv", "o", "gate", "up", "down")


def _set_layer(decoder, index: int, layer: Layer) -> None:
    decoder.set_norms(index, layer.input_norm, layer.post_norm)
    for name in _native_linears(layer):
        decoder.set_linear(index, name, *getattr(layer, name).args())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face's LlamaRMSNorm: normalize in fp32, scale in the compute dtype."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-NeoX style rotary embedding (rotate halves) in fp32: x * cos + [-x2, x1] * sin, written as
    x * cos + roll(x, half) * signed_sin. x [B, heads, head_size], cos/signed_sin [B, head_size] (rope_tables)."""
    xf = x.float()
    rotated = xf.roll(xf.shape[-1] // 2, dims=-1)  # [x2, x1]
    return torch.addcmul(xf * cos[:, None, :], rotated, sin[:, None, :]).to(x.dtype)


def rope_tables(spec: EngineSpec, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [length, head_size] (fp32) for positions 0..length-1, with the checkpoint's theta
    and scaling. The sin table's first half is negated, so that apply_rope needs no negation."""
    inv_freq = rope_inv_freq(spec.head_size, spec.rotary_base, spec.rotary_scaling)  # [head_size / 2]
    positions = torch.arange(length, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [length, head_size / 2]
    emb = torch.cat([freqs, freqs], dim=-1)
    sign = torch.cat([-torch.ones_like(inv_freq), torch.ones_like(inv_freq)])
    return emb.cos(), emb.sin() * sign


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
