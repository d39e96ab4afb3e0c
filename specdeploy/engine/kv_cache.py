"""The KV cache of one sequence: preallocated, indexed by absolute position; rollback moves a pointer.

Values are those of the compute dtype (k and v as the layer computed them), or FP8 (E4M3) / INT8 with the
checkpoint's per-layer `kv_cache_scaling_factor` (stored = quantize(k / scale), read = stored * scale rounded
to the compute dtype), as TensorRT-LLM does. An unquantized cache stores the compute dtype itself (k after RoPE
and v are rounded to it by the layer), as TensorRT-LLM's default KV cache does; attention computes in f32 and reads
bf16 exactly as f32 (`read`, and the native kernels' loads). A batched decode step reads every sequence's cache:
f32 storage, the earlier choice, made 4 sequences' steps at 100 positions cost 1.39 one-sequence steps against
1.21 for one sequence's 4 rows, and the gap grew with the positions (docs/benchmarks.md).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0


class KVCache:
    """Keys and values of every layer for positions [0, max_len); `length` is how many are valid."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_size: int,
        max_len: int,
        dtype: torch.dtype,
        quant_algo: str | None = None,
        scales: torch.Tensor | None = None,  # [num_layers] f32, with quant_algo
    ):
        self.max_len = max_len
        self.dtype = dtype
        self.quant_algo = quant_algo
        self.scales = None if scales is None else [float(s) for s in scales]
        storage = {None: dtype, "FP8": torch.float8_e4m3fn, "INT8": torch.int8}[quant_algo]
        shape = (num_layers, num_kv_heads, max_len, head_size)  # [layer, kv_head, position, head_size]
        # Uninitialised: attention reads only positions < length, all written first. Pages are touched as
        # positions are written, so a pool of long caches costs memory for the positions in use only.
        self.keys = torch.empty(shape, dtype=storage)
        self.values = torch.empty(shape, dtype=storage)
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget every position >= length (a rejected draft); the memory is reused by the next write."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [n, kv_heads, head_size] at positions start..start+n-1."""
        n = k.shape[0]
        self.keys[layer, :, start : start + n] = self._store(layer, k).transpose(0, 1)
        self.values[layer, :, start : start + n] = self._store(layer, v).transpose(0, 1)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions [0, end) (values of the compute dtype, in f32): two [kv_heads, end,
        head_size]."""
        k = self.keys[layer, :, :end]
        v = self.values[layer, :, :end]
        if self.quant_algo is None:
            return k.float(), v.float()  # no copy for f32 storage
        scale = self.scales[layer]
        return (k.float() * scale).to(self.dtype).float(), (v.float() * scale).to(self.dtype).float()

    def _store(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        if self.quant_algo is None:
            return x.to(self.dtype)  # the compute dtype's rounding
        x = x.float() / self.scales[layer]
        if self.quant_algo == "FP8":
            return x.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return x.round_().clamp_(-128.0, 127.0).to(torch.int8)

    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()
