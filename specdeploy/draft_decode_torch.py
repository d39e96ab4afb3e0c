"""The target answering for `specdeploy draft data` with torch (draft.data.backend: torch): its Hugging Face weights on
a GPU where torch sees one, many rows at a time.

Why this is written here: the data stage's CPU engine writes ~200 answer tokens/s on 2 cores, and EAGLE-3 heads are
trained on ~10^7 of them. On a GPU, Hugging Face `generate` made 17,343 tokens/s at 1,024 rows on an H200
(docs/eagle3-train.md), far under what a 135M model allows: its per-step work is Python and cache bookkeeping, and
its sampled rows share one random stream, so a row's sample depends on the rows beside it. `TorchGenerator` keeps
the model's own modules (norms, projections, rotary embedding: the numerics are Hugging Face's) and writes only the
loop around them: a preallocated KV cache per layer, left-padded rows, the last position's logits only, and sampling
by the Gumbel-max trick with noise hashed from (the job's seed, the step, the token), so a sampled answer depends on
its seed and prompt alone, never on its batch. Greedy answers on a GPU are bf16 and may differ from the CPU engine's
in a late token where two logits tie closely; both are the target's answers.

Same interface as `draft_generation.Generator` (run / journal / tokens / busy_s): the prompt sources, self-instruct
and the journal (resume) are shared. Llama-architecture models (Llama, SmolLM2, Mistral without a sliding window,
Qwen2); anything else is refused with the fix (backend engine).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from specdeploy.draft_generation import Job, Journal
from specdeploy.durations import duration_text
from specdeploy.errors import ConfigError

SUPPORTED = ("llama", "mistral", "qwen2")
PREFILL_ROWS = 64  # rows prefilled per pass: bounds the prefill's activations, not the batch
_M32 = 0xFFFFFFFF


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gumbel_noise(seeds, step: int, vocab: int):
    """Gumbel(0, 1) noise [rows, vocab] from a counter-based hash of (seed, step, token): the same numbers for a row
    whatever rows share its batch, on any device. Integer steps stay under 2^63 (31-bit multipliers on 32-bit
    values), so int64 arithmetic never overflows."""
    import torch

    folded = (seeds ^ (seeds >> 31)) & 0x7FFFFFFF
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (folded[:, None] * 0x61C88647 + (step * 0x27D4EB2F + 0x165667B1) + v[None, :]) & _M32
    for mult in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x = x ^ (x >> 16)
        x = (x * mult) & _M32
    x = x ^ (x >> 15)
    u = ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)  # (0, 1), 24 bits: exact in float32
    return -torch.log(-torch.log(u))


class TorchGenerator:
    """Runs jobs (draft_generation.Job) in batches of `batch_size` rows through the target's Hugging Face weights;
    journals each finished one; shows progress with an ETA."""

    def __init__(self, model_dir: Path, end_id: int, journal: Journal, echo, on_sample: Callable[[str], None] | None,
                 batch_size: int, device: str | None = None, dtype: str | None = None):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        if config.model_type not in SUPPORTED or getattr(config, "sliding_window", None) and config.model_type == "mistral":
            raise ConfigError(f"draft.data.backend torch decodes Llama-architecture models ({', '.join(SUPPORTED)}); the "
                              f"target {model_dir} is {config.model_type!r}", "set draft.data.backend: engine (the recipe's built CPU engine)")
        self.device = device or device_name()
        self.dtype = getattr(torch, dtype) if dtype else (torch.bfloat16 if self.device == "cuda" else torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=self.dtype).to(self.device).eval()
        self.end_id = end_id
        self.journal = journal
        self.echo = echo
        self.on_sample = on_sample
        self.batch_size = max(1, int(batch_size))
        self.max_batch_size = self.batch_size
        self.tokens = 0
        self.live_tokens = 0
        self.busy_s = 0.0

    # ------------------------------------------------------------ the loop

    def run(self, jobs: list[Job], label: str, total: int, done_before: int) -> None:
        """Generate every job not in the journal yet, longest prompts first in batches of similar length."""
        todo = [j for j in jobs if j.key not in self.journal.done]
        if not todo:
            return
        todo.sort(key=lambda j: (-len(j.input_ids), j.key))
        start = time.monotonic()
        tokens0 = self.live_tokens
        done = done_before + len(jobs) - len(todo)
        try:
            for i in range(0, len(todo), self.batch_size):
                batch = todo[i : i + self.batch_size]
                for job, tokens, reason in zip(batch, *self.decode(batch)):
                    self.journal.add(job.key, tokens, reason)
                    self.tokens += len(tokens)
                    done += 1
                    if self.on_sample is not None:
                        self.on_sample(job.key)
                elapsed = time.monotonic() - start
                rate = (self.live_tokens - tokens0) / elapsed if elapsed else 0.0
                eta = elapsed / (done - done_before - len(jobs) + len(todo)) * (total - done)
                self.echo(f"{label}: {done}/{total}, {rate:.1f} tokens/s, ETA {duration_text(eta)} ({self.device}, {len(batch)} rows)")
        finally:
            self.busy_s += time.monotonic() - start

    def decode(self, batch: list[Job]) -> tuple[list[list[int]], list[str]]:
        """The answers to one batch: (token lists, each ending with the end token when it ended; reasons
        "end_id" | "length")."""
        import torch

        with torch.inference_mode():
            return self._decode(batch)

    def _decode(self, batch: list[Job]):
        import torch
        import torch.nn.functional as F
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        model, dev = self.model, self.device
        cfg = model.config
        inner = model.model
        rows = len(batch)
        lengths = torch.tensor([len(j.input_ids) for j in batch], device=dev)
        width = int(lengths.max())
        limits = torch.tensor([j.max_new_tokens for j in batch], device=dev)
        steps = int(limits.max())
        pad = width - lengths  # left padding per row
        ids = torch.zeros(rows, width, dtype=torch.long, device=dev)
        for r, job in enumerate(batch):
            ids[r, width - len(job.input_ids):] = torch.tensor(job.input_ids, device=dev)
        n_kv = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        span = width + steps
        layers = inner.layers
        k_cache = [torch.zeros(rows, n_kv, span, head_dim, dtype=self.dtype, device=dev) for _ in layers]
        v_cache = [torch.zeros_like(k) for k in k_cache]
        cols = torch.arange(span, device=dev)
        key_ok = cols[None, :] >= pad[:, None]  # [rows, span]: a row's own tokens (and everything it generates)

        group = cfg.num_attention_heads // n_kv

        def forward(x_ids, positions, at: int, row_slice: slice):
            """The final norm of the last position for rows `row_slice`, writing K/V at cache columns at..at+len."""
            q_len = x_ids.shape[1]
            h = inner.embed_tokens(x_ids)
            cos, sin = inner.rotary_emb(h, positions)
            q_pos = torch.arange(at, at + q_len, device=dev)
            keys = cols[: at + q_len]
            mask = (keys[None, None, :] <= q_pos[None, :, None]) & key_ok[row_slice, None, : at + q_len]
            mask = mask | (keys[None, None, :] == q_pos[None, :, None])  # a pad query sees itself: no NaN
            # the query heads that share a KV head fold into its query rows (head h reads KV head h // group, as
            # transformers' repeat_kv): no copy of the cache per step, and any SDPA kernel that takes a mask
            mask = mask[:, None].repeat(1, 1, group, 1)  # [rows, 1, group * q_len, keys]
            for li, layer in enumerate(layers):
                attn = layer.self_attn
                x = layer.input_layernorm(h)
                b = x.shape[0]
                q = attn.q_proj(x).view(b, q_len, -1, head_dim).transpose(1, 2)
                k = attn.k_proj(x).view(b, q_len, -1, head_dim).transpose(1, 2)
                v = attn.v_proj(x).view(b, q_len, -1, head_dim).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                k_cache[li][row_slice, :, at : at + q_len] = k
                v_cache[li][row_slice, :, at : at + q_len] = v
                q = q.reshape(b, n_kv, group * q_len, head_dim)
                out = F.scaled_dot_product_attention(q, k_cache[li][row_slice, :, : at + q_len], v_cache[li][row_slice, :, : at + q_len],
                                                     attn_mask=mask, scale=attn.scaling)
                out = out.reshape(b, n_kv * group, q_len, head_dim).transpose(1, 2).reshape(b, q_len, -1)
                h = h + attn.o_proj(out)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            return inner.norm(h[:, -1])

        positions = (torch.arange(width, device=dev)[None, :] - pad[:, None]).clamp(min=0)
        last = []
        for r0 in range(0, rows, PREFILL_ROWS):
            part = slice(r0, min(rows, r0 + PREFILL_ROWS))
            last.append(forward(ids[part], positions[part], 0, part))
        hidden = torch.cat(last)
        seeds = torch.tensor([j.seed & 0x7FFF_FFFF_FFFF_FFFF for j in batch], dtype=torch.int64, device=dev)
        temps = torch.tensor([j.temperature or 1.0 for j in batch], dtype=torch.float32, device=dev)
        sampled = torch.tensor([j.temperature is not None for j in batch], device=dev)
        out = torch.zeros(rows, steps, dtype=torch.long, device=dev)
        alive = torch.ones(rows, dtype=torch.bool, device=dev)
        ended = torch.zeros(rows, dtype=torch.bool, device=dev)
        made = torch.zeros(rows, dtype=torch.long, device=dev)
        everything = slice(0, rows)
        for step in range(steps):
            logits = model.lm_head(hidden).float()
            token = logits.argmax(-1)
            if bool(sampled.any()):
                noisy = (logits / temps[:, None] + gumbel_noise(seeds, step, logits.shape[-1])).argmax(-1)
                token = torch.where(sampled, noisy, token)
            token = torch.where(alive, token, torch.full_like(token, self.end_id))
            out[:, step] = token
            made += alive.long()
            ended |= alive & (token == self.end_id)
            alive &= (token != self.end_id) & (made < limits)
            if not bool(alive.any()) or step + 1 == steps:
                break
            hidden = forward(token[:, None], (lengths + step)[:, None], width + step, everything)
        made_l, ended_l, out_l = made.tolist(), ended.tolist(), out.tolist()
        tokens = [out_l[r][: made_l[r]] for r in range(rows)]
        self.live_tokens += sum(made_l)
        return tokens, ["end_id" if ended_l[r] else "length" for r in range(rows)]
