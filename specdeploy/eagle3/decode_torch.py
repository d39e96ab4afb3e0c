"""The target answering for `specdeploy draft data` with torch (draft.data.backend: torch): its Hugging Face weights on
a GPU where torch sees one, many rows at a time.

Why this is written here: the data stage's CPU engine is far too slow for the ~10^7 answer tokens EAGLE-3 heads are
trained on (docs/eagle3-data.md "On a GPU"), and on a GPU Hugging Face `generate` stays far under what a 135M model
allows (docs/eagle3-train.md "On a GPU"): its per-step work is Python and cache bookkeeping, and
its sampled rows share one random stream, so a row's sample depends on the rows beside it. `TorchGenerator` keeps
the model's own modules (norms, projections, rotary embedding: the numerics are Hugging Face's) and writes only the
loop around them: a preallocated KV cache per layer, batch_size slots each holding one answer at its own positions
(a slot whose answer ended takes the next prompt: continuous batching), the last position's logits only, and sampling
by the Gumbel-max trick with noise hashed from (the job's seed, the token's index in its answer, the token), so a
sampled answer depends on its seed and prompt alone, never on its slot or batch. Greedy answers on a GPU are bf16 and
may differ from the CPU engine's in a late token where two logits tie closely; both are the target's answers.

Same interface as `draft_generation.Generator` (run / journal / tokens / busy_s): the prompt sources, self-instruct
and the journal (resume) are shared. Llama-architecture models (Llama, SmolLM2, Mistral without a sliding window,
Qwen2); anything else is refused with the fix (backend engine).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from specdeploy.core.durations import duration_text
from specdeploy.core.errors import ConfigError
from specdeploy.eagle3.generation import Job, Journal

SUPPORTED = ("llama", "mistral", "qwen2")
PREFILL_ROWS = 64  # rows prefilled per pass: bounds the prefill's activations, not the batch
_M32 = 0xFFFFFFFF


def device_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def gumbel_noise(seeds, steps, vocab: int):
    """Gumbel(0, 1) noise [rows, vocab] from a counter-based hash of (seed, step, token), `steps` one for all rows or
    one per row (the answer's own token index): the same numbers for a row whatever rows share its batch, on any
    device. Integer steps stay under 2^63 (31-bit multipliers on 32-bit values), so int64 arithmetic never overflows."""
    import torch

    folded = (seeds ^ (seeds >> 31)) & 0x7FFFFFFF
    steps = torch.as_tensor(steps, dtype=torch.int64, device=seeds.device).expand(seeds.shape[0])
    v = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = (folded[:, None] * 0x61C88647 + ((steps[:, None] & _M32) * 0x27D4EB2F + 0x165667B1) + v[None, :]) & _M32
    for mult in (0x7FEB352D, 0x2C1B3C6D, 0x297A2D39):
        x = x ^ (x >> 16)
        x = (x * mult) & _M32
    x = x ^ (x >> 15)
    u = ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)  # (0, 1), 24 bits: exact in float32
    return -torch.log(-torch.log(u))


class TorchGenerator:
    """Runs jobs (draft_generation.Job) through the target's Hugging Face weights, `batch_size` answers at a time
    (slots refilled as answers end); journals each finished one; shows progress with an ETA."""

    def __init__(
        self,
        model_dir: Path,
        end_id: int,
        journal: Journal,
        echo,
        on_sample: Callable[[str], None] | None,
        batch_size: int,
        device: str | None = None,
        dtype: str | None = None,
    ):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        if (
            config.model_type not in SUPPORTED
            or getattr(config, "sliding_window", None)
            and config.model_type == "mistral"
        ):
            raise ConfigError(
                f"draft.data.backend torch decodes Llama-architecture models ({', '.join(SUPPORTED)}); the "
                f"target {model_dir} is {config.model_type!r}",
                "set draft.data.backend: engine (the recipe's built CPU engine)",
            )
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
        """Generate every job not in the journal yet (longest prompts first), journaling each as it ends."""
        todo = [j for j in jobs if j.key not in self.journal.done]
        if not todo:
            return
        todo.sort(key=lambda j: (-len(j.input_ids), j.key))
        start = last_print = time.monotonic()
        done = done_before + len(jobs) - len(todo)
        done_here = 0
        try:
            for job, tokens, reason in self.stream(todo):
                self.journal.add(job.key, tokens, reason)
                self.tokens += len(tokens)
                done += 1
                done_here += 1
                if self.on_sample is not None:
                    self.on_sample(job.key)
                now = time.monotonic()
                if now - last_print >= 5.0 or done == total:
                    last_print = now
                    rate = self.live_tokens / (self.busy_s + now - start)
                    eta = (now - start) / done_here * (total - done)
                    self.echo(
                        f"{label}: {done}/{total}, {rate:.1f} tokens/s, ETA {duration_text(eta)} ({self.device}, "
                        f"{self.batch_size} rows)"
                    )
        finally:
            self.busy_s += time.monotonic() - start

    def decode(self, batch: list[Job]) -> tuple[list[list[int]], list[str]]:
        """The answers to `batch`, in its order: (token lists, each ending with the end token when it ended; reasons
        "end_id" | "length")."""
        answers = {job.key: (tokens, reason) for job, tokens, reason in self.stream(batch)}
        return [answers[j.key][0] for j in batch], [answers[j.key][1] for j in batch]

    def stream(self, jobs: list[Job]):
        """(job, tokens, reason) for every job of `jobs`, as each ends: batch_size slots decode one token a step, and a
        slot whose answer ended takes the next job (continuous batching: a long answer never holds short ones'
        slots idle). Each row keeps its own positions, so what a job gets never depends on its slot or neighbours."""
        import torch

        with torch.inference_mode():
            yield from _Slots(self, jobs).run()


class _Slots:
    """The state of TorchGenerator.stream: per slot its job, cached length, answer so far; the KV cache per layer
    [slots, kv heads, span, head dim], a slot's sequence from column 0."""

    def __init__(self, gen: TorchGenerator, jobs: list[Job]):
        import torch

        self.gen, self.model, self.dev = gen, gen.model, gen.device
        cfg = self.model.config
        self.inner = self.model.model
        self.queue = list(reversed(jobs))  # popped from the end: jobs' order
        rows = self.rows = min(gen.batch_size, len(jobs))
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = cfg.num_attention_heads // self.n_kv
        span = max(len(j.input_ids) + j.max_new_tokens for j in jobs)
        self.widest = max(j.max_new_tokens for j in jobs)
        self.k_cache = [
            torch.zeros(rows, self.n_kv, span, self.head_dim, dtype=gen.dtype, device=self.dev)
            for _ in self.inner.layers
        ]
        self.v_cache = [torch.zeros_like(k) for k in self.k_cache]
        self.cols = torch.arange(span, device=self.dev)
        self.every = torch.arange(rows, device=self.dev)
        self.job: list[Job | None] = [None] * rows
        long = dict(dtype=torch.long, device=self.dev)
        self.length = torch.zeros(rows, **long)  # tokens in the cache
        self.made = torch.zeros(rows, **long)  # answer tokens so far
        self.limit = torch.ones(rows, **long)
        self.seeds = torch.zeros(rows, **long)
        self.temps = torch.ones(rows, dtype=torch.float32, device=self.dev)
        self.sampled = torch.zeros(rows, dtype=torch.bool, device=self.dev)
        self.alive = torch.zeros(rows, dtype=torch.bool, device=self.dev)
        self.out = torch.zeros(rows, self.widest, **long)
        self.hidden = torch.zeros(rows, cfg.hidden_size, dtype=gen.dtype, device=self.dev)

    def run(self):
        import torch

        end_id = self.gen.end_id
        while True:
            free = [s for s in range(self.rows) if self.job[s] is None]  # the host's view: no wait on the device
            # refill once an eighth of the slots is free (one prefill pass for several), or when nothing else runs
            if (
                self.queue
                and free
                and (len(free) >= max(1, self.rows // 8) or len(self.queue) <= len(free) or len(free) == self.rows)
            ):
                self._prefill(free[: len(self.queue)])
            if all(job is None for job in self.job):
                return
            logits = self.model.lm_head(self.hidden).float()
            token = logits.argmax(-1)
            if any(job is not None and job.temperature is not None for job in self.job):
                noisy = (logits / self.temps[:, None] + gumbel_noise(self.seeds, self.made, logits.shape[-1])).argmax(
                    -1
                )
                token = torch.where(self.sampled, noisy, token)
            at = self.made.clamp(max=self.widest - 1)  # a finished slot keeps its last token there
            self.out[self.every, at] = torch.where(self.alive, token, self.out[self.every, at])
            self.made += self.alive.long()
            ended = self.alive & (token == end_id)
            finished = ended | (self.alive & (self.made >= self.limit))
            self.alive &= ~finished
            done = finished.tolist()  # the one wait on the device per step
            if any(done):
                made, stopped = self.made.tolist(), ended.tolist()
                for s in (s for s in range(self.rows) if done[s]):
                    self.gen.live_tokens += made[s]
                    job, self.job[s] = self.job[s], None
                    yield job, self.out[s, : made[s]].tolist(), "end_id" if stopped[s] else "length"
            if any(job is not None for job in self.job):
                self.hidden = self._decode_step(torch.where(self.alive, token, 0))  # a free slot's row: any valid id
                self.length += self.alive.long()

    def _prefill(self, slots: list[int]) -> None:
        """Put the next jobs into `slots`: their prompts' K/V from column 0, the last position's hidden state."""
        import torch

        for r0 in range(0, len(slots), PREFILL_ROWS):
            part = slots[r0 : r0 + PREFILL_ROWS]
            jobs = [self.queue.pop() for _ in part]
            lengths = torch.tensor([len(j.input_ids) for j in jobs], device=self.dev)
            width = int(lengths.max())
            ids = torch.zeros(len(jobs), width, dtype=torch.long, device=self.dev)
            for r, job in enumerate(jobs):
                ids[r, : len(job.input_ids)] = torch.tensor(job.input_ids, device=self.dev)
            index = torch.tensor(part, device=self.dev)
            keys = self.cols[:width]
            # causal over a row's own tokens; a padding query past a row's end sees the row's tokens (no NaN)
            mask = (keys[None, None, :] <= keys[None, :, None]) & (keys[None, None, :] < lengths[:, None, None])
            positions = keys[None, :].expand(len(jobs), width)

            def attend(li, q, k, v):
                self.k_cache[li][index, :, :width] = k
                self.v_cache[li][index, :, :width] = v
                return q, k, v, mask

            h = self._layers(ids, positions, attend)
            self.hidden[index] = h[torch.arange(len(jobs), device=self.dev), lengths - 1]
            self.length[index] = lengths
            self.made[index] = 0
            self.limit[index] = torch.tensor([j.max_new_tokens for j in jobs], device=self.dev)
            self.seeds[index] = torch.tensor([j.seed & 0x7FFF_FFFF_FFFF_FFFF for j in jobs], device=self.dev)
            self.temps[index] = torch.tensor([j.temperature or 1.0 for j in jobs], dtype=torch.float32, device=self.dev)
            self.sampled[index] = torch.tensor([j.temperature is not None for j in jobs], device=self.dev)
            self.alive[index] = True
            for s, job in zip(part, jobs):
                self.job[s] = job

    def _decode_step(self, token):
        """Every slot's next position: K/V written at its own column `length`, attention over its own columns."""
        at = self.length
        n = int(at.max()) + 1
        mask = self.cols[None, None, :n] <= at[:, None, None]  # [rows, 1 query, keys]

        def attend(li, q, k, v):
            self.k_cache[li][self.every, :, at] = k[:, :, 0]
            self.v_cache[li][self.every, :, at] = v[:, :, 0]
            return q, self.k_cache[li][:, :, :n], self.v_cache[li][:, :, :n], mask

        return self._layers(token[:, None], at[:, None], attend)[:, -1]

    def _layers(self, ids, positions, attend):
        """The target's decoder over `ids` [rows, q] at `positions`, its modules as Hugging Face runs them; `attend`
        stores a layer's K/V and says what to attend over. Returns the final norm's output [rows, q, hidden]."""
        import torch.nn.functional as F
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        inner, hd, group = self.inner, self.head_dim, self.group
        rows, q_len = ids.shape
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        for li, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(rows, q_len, -1, hd).transpose(1, 2)
            k = attn.k_proj(x).view(rows, q_len, -1, hd).transpose(1, 2)
            v = attn.v_proj(x).view(rows, q_len, -1, hd).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q, keys, values, mask = attend(li, q, k, v)
            # the query heads that share a KV head fold into its query rows (head h reads KV head h // group, as
            # transformers' repeat_kv): no copy of the cache, and any SDPA kernel that takes a mask
            q = q.reshape(rows, self.n_kv, group * q_len, hd)
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask[:, None].repeat(1, 1, group, 1), scale=attn.scaling
            )
            h = h + attn.o_proj(
                out.reshape(rows, self.n_kv * group, q_len, hd).transpose(1, 2).reshape(rows, q_len, -1)
            )
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return inner.norm(h)
