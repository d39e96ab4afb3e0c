"""In-process generation: the built CPU engines, the speculative loop, local adapters, streamed text.

`specdeploy generate RECIPE --prompt ...` uses this to try a deployment without a server. The
adapters below connect `specdeploy.speculation.loop.speculative_generate` to two `Executor`s, the way
the Triton BLS model connects it to the `tensorrt_llm_draft` and `tensorrt_llm` models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from specdeploy.core.errors import BuildError, ModelError
from specdeploy.engine.executor import Executor
from specdeploy.engine.request import EngineRequest, run
from specdeploy.speculation import loop as spec
from specdeploy.speculation import policy as pol
from specdeploy.speculation import sampling as speculation_sampling
from specdeploy.speculation.loop import Proposal, SpecStats
from specdeploy.speculation.ngram import (
    NGramPool,
    NGramProposer,
    NGramSettings,
    SuffixProposer,
    SuffixSettings,
    settings_from_recipe,
    suffix_settings_from_recipe,
)
from specdeploy.speculation.sampling import SamplingParams

# ---------------------------------------------------------------- local adapters


class ExecutorProposer:
    """Proposer over a draft Executor: generate k tokens from the whole sequence (prefix KV reuse
    makes that cost only the new positions)."""

    def __init__(self, executor: Executor, end_id: int | None = None, bad_words: Sequence[Sequence[int]] = ()):
        self.executor = executor
        self.end_id = end_id
        self.bad_words = [list(w) for w in bad_words]

    def propose(self, sequence: list[int], num_tokens: int, sampling: SamplingParams, return_logits: bool) -> Proposal:
        request = EngineRequest(
            input_ids=sequence,
            max_new_tokens=num_tokens,
            sampling=sampling,
            end_id=self.end_id,
            bad_words=self.bad_words,
            return_logits=return_logits,
        )
        chunk = run(self.executor, request)
        return Proposal(chunk.token_ids, chunk.logits)


class ExecutorVerifier:
    """Verifier over a target Executor: one pass over sequence + draft, request_output_len = k + 1
    (or `output_len` plain tokens when the policy falls back to a plain run)."""

    def __init__(
        self,
        executor: Executor,
        end_id: int | None = None,
        stop_words: Sequence[Sequence[int]] = (),
        bad_words: Sequence[Sequence[int]] = (),
    ):
        self.executor = executor
        self.end_id = end_id
        self.stop_words = [list(w) for w in stop_words]
        self.bad_words = [list(w) for w in bad_words]

    def verify(
        self,
        sequence: list[int],
        draft_tokens: list[int],
        draft_logits: torch.Tensor | None,
        sampling: SamplingParams,
        output_len: int | None = None,
    ) -> list[int]:
        assert output_len is None or not draft_tokens, "a plain run has no draft"
        request = EngineRequest(
            input_ids=sequence,
            max_new_tokens=output_len or len(draft_tokens) + 1,
            sampling=sampling,
            end_id=self.end_id,
            stop_words=self.stop_words,
            bad_words=self.bad_words,
            draft_tokens=draft_tokens or None,
            draft_logits=draft_logits if draft_tokens else None,
        )
        return run(self.executor, request).token_ids


def target_only_generate(
    target: Executor,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: SamplingParams = speculation_sampling.GREEDY,
    end_id: int | None = None,
    stop_words: Sequence[Sequence[int]] = (),
    bad_words: Sequence[Sequence[int]] = (),
    should_stop=None,
) -> Iterator[list[int] | SpecStats]:
    """The unaccelerated control: the target alone, streamed; same event shape as speculative_generate.
    `should_stop()` is polled between decode steps (finish_reason "cancelled" once it turns true)."""
    request = EngineRequest(
        input_ids=list(prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        end_id=end_id,
        stop_words=[list(w) for w in stop_words],
        bad_words=[list(w) for w in bad_words],
        streaming=True,
        is_cancelled=should_stop,
    )
    yield from _streamed(target, request, SpecStats(), rounds=False)


def fused_generate(
    target: Executor,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_draft_tokens: int,
    sampling: SamplingParams = speculation_sampling.GREEDY,
    end_id: int | None = None,
    stop_words: Sequence[Sequence[int]] = (),
    should_stop=None,
) -> Iterator[list[int] | SpecStats]:
    """draft.kind eagle3: the target Executor runs its EAGLE-3 head inside (Executor(head=...), the fused
    loop of specdeploy.engine.executor), streamed; same event shape as speculative_generate. A sampled request's
    drafts are verified by token match (the target's own draws: the same tokens as the target alone, seed for seed)."""
    request = EngineRequest(
        input_ids=list(prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        end_id=end_id,
        stop_words=[list(w) for w in stop_words],
        streaming=True,
        is_cancelled=should_stop,
        num_draft_tokens=num_draft_tokens,
    )
    stats = SpecStats(
        policy="eagle3-fused" if target.fuses(request) else "eagle3-fused (no draft tokens asked: target alone)"
    )
    yield from _streamed(target, request, stats, rounds=True)


def _streamed(
    target: Executor, request: EngineRequest, stats: SpecStats, rounds: bool
) -> Iterator[list[int] | SpecStats]:
    """The executor's tokens as they come, then `stats` with the finished request's counts; `rounds`: also the fused
    loop's drafts and rounds (the same RoundStats fields) and its prefill time."""
    for chunk in target.generate(request):
        stats.output_tokens += len(chunk.token_ids)
        if chunk.token_ids:
            yield chunk.token_ids
        if not chunk.finished:
            continue
        s = chunk.stats
        stats.target_iterations, stats.target_time_s = s.iterations, s.forward_time_s
        stats.finish_reason = chunk.finish_reason
        if rounds:
            stats.draft_time_s = s.draft_time_s
            stats.drafted, stats.accepted = s.drafted, s.accepted
            stats.accepted_per_round = list(s.accepted_per_round)
            stats.k_per_round = list(s.k_per_round)
            stats.lookup_per_round = list(s.lookup_per_round)
            stats.draft_s_per_round, stats.target_s_per_round = list(s.draft_s_per_round), list(s.target_s_per_round)
            stats.prefill_s = s.first_forward_time_s
    yield stats


# ---------------------------------------------------------------- loading


def load_engine(engine_dir: Path, role: str, recipe_path: str = "RECIPE"):
    """Load a built CPU engine, or say which command builds it."""
    engine_dir = Path(engine_dir)
    if not (engine_dir / "config.json").is_file():
        raise BuildError(
            f"no {role} engine at {engine_dir}",
            f"build it with: specdeploy build {recipe_path}",
        )
    try:
        from specdeploy.engine.model import CpuEngine
    except ImportError as exc:  # the runtime is a separate part of the package
        raise BuildError(f"the CPU engine runtime is not available: {exc}", "reinstall specdeploy") from exc
    return CpuEngine.load(engine_dir)


def load_eagle3_head(recipe, layout, target_engine, recipe_path: str = "RECIPE"):
    """draft.kind eagle3: the head named by draft.head ('trained': the one `specdeploy draft train` exported),
    checked against the target engine, its linears held as draft.head_weights says, scoring the draft tokens
    draft.serve_vocab_size keeps."""
    from specdeploy.engine.eagle3 import Eagle3Head
    from specdeploy.recipe.config import EAGLE3_HEAD_TRAINED

    trained = recipe.draft.head == EAGLE3_HEAD_TRAINED
    head_dir = layout.eagle3_head_source(recipe.draft.head)
    if not (head_dir / "config.json").is_file():
        fix = (
            f"train it with: specdeploy draft train {recipe_path}"
            if trained
            else "set draft.head to an exported EAGLE-3 checkpoint folder"
        )
        raise BuildError(f"no EAGLE-3 head at {head_dir}", fix)
    return Eagle3Head.load(head_dir, target_engine, recipe.draft.cpu_head_weights, recipe.draft.serve_vocab_size)


def load_tokenizer(engine_dir: Path, model: str):
    """The tokenizer saved with the engine, else the one of the source model."""
    from transformers import AutoTokenizer

    source = Path(engine_dir)
    if not (source / "tokenizer_config.json").is_file():
        from specdeploy.core.model_store import resolve

        source = resolve(model)
    try:
        return AutoTokenizer.from_pretrained(str(source))
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"cannot load a tokenizer from {source}: {exc}", "check that the model directory has its tokenizer files"
        ) from exc


@dataclass
class Session:
    """Target executor, the draft (an Executor, n-gram or suffix settings), the deployment's speculation policy
    state (specdeploy.speculation.policy.SharedPolicy, shared by every request of the session) and the tokenizer."""

    tokenizer: object
    target: Executor
    draft: Executor | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    ngram: NGramSettings | None = None  # draft.kind ngram
    suffix: SuffixSettings | None = None  # draft.kind suffix
    deployment: pol.SharedPolicy = field(default_factory=lambda: pol.SharedPolicy(pol.PolicySettings()))
    ngram_pool: NGramPool | None = None  # the public pool (is_public_pool)

    def __post_init__(self):
        if self.ngram is not None and self.ngram.is_public_pool and self.ngram_pool is None:
            self.ngram_pool = NGramPool(self.ngram)

    eagle3: bool = False  # draft.kind eagle3: `target` runs the head inside (Executor.head)

    @classmethod
    def from_recipe(
        cls, recipe, layout, speculative: bool = True, recipe_path: str = "RECIPE", max_cached_sequences: int = 2
    ) -> "Session":
        target_engine = load_engine(layout.engine("target"), "target", recipe_path)
        if recipe.draft.is_eagle3:
            head = load_eagle3_head(recipe, layout, target_engine, recipe_path) if speculative else None
            return cls(
                load_tokenizer(layout.engine("target"), recipe.target.model),
                Executor(
                    target_engine,
                    max_cached_sequences,
                    head=head,
                    draft_p_min=recipe.speculative.draft_p_min,
                    draft_policy=recipe.speculative.policy,
                    lookup_threshold=recipe.draft.lookup_threshold,
                ),
                eagle3=head is not None,
                deployment=pol.SharedPolicy(pol.PolicySettings.from_recipe(recipe.speculative)),
            )
        ngram = settings_from_recipe(recipe) if recipe.draft.is_ngram else None
        suffix = suffix_settings_from_recipe(recipe) if recipe.draft.is_suffix else None
        use_draft_model = speculative and recipe.draft.has_weights_of_its_own
        draft_engine = load_engine(layout.engine("draft"), "draft", recipe_path) if use_draft_model else None
        tokenizer = load_tokenizer(layout.engine("target"), recipe.target.model)
        return cls(
            tokenizer,
            Executor(target_engine, max_cached_sequences),
            Executor(draft_engine, max_cached_sequences) if draft_engine is not None else None,
            ngram=ngram if speculative else None,
            suffix=suffix if speculative else None,
            deployment=pol.SharedPolicy(pol.PolicySettings.from_recipe(recipe.speculative)),
        )

    @property
    def can_speculate(self) -> bool:
        return self.draft is not None or self.ngram is not None or self.suffix is not None or self.eagle3

    def proposer(self):
        """A Proposer for one request: over the draft Executor, the suffix automaton over the request's text, or an
        n-gram proposer (its own pool, or the session's public one)."""
        if self.ngram is not None:
            return NGramProposer(self.ngram, self.ngram_pool)
        if self.suffix is not None:
            return SuffixProposer(self.suffix)
        return ExecutorProposer(self.draft, self.end_id)

    @property
    def end_id(self) -> int | None:
        return getattr(self.tokenizer, "eos_token_id", None)

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Token ids of the prompt: as is (like the Triton preprocessing model), or wrapped in the
        tokenizer's chat template as one user turn when `chat` and the tokenizer has one."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return list(self.tokenizer(prompt)["input_ids"])

    def stream(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        num_draft_tokens: int = 0,
        sampling: SamplingParams = speculation_sampling.GREEDY,
        use_draft_logits: bool = False,
    ) -> Iterator[list[int] | SpecStats]:
        """Speculative when a draft is loaded and num_draft_tokens > 0, else the target alone. Each round's k
        comes from the session's policy (recipe speculative.policy), capped by num_draft_tokens."""
        if not self.can_speculate or num_draft_tokens <= 0:
            return target_only_generate(self.target, prompt_ids, max_new_tokens, sampling, self.end_id, self.stop_words)
        if (
            self.eagle3
        ):  # the fused loop: up to num_draft_tokens a round (policy cost: the engine's measured costs decide)
            return fused_generate(
                self.target, prompt_ids, max_new_tokens, num_draft_tokens, sampling, self.end_id, self.stop_words
            )
        return spec.speculative_generate(
            self.proposer(),
            ExecutorVerifier(self.target, self.end_id, self.stop_words),
            prompt_ids,
            max_new_tokens,
            num_draft_tokens,
            sampling,
            self.end_id,
            self.stop_words,
            use_draft_logits,
            policy=self.deployment.request(),
        )


class TextStream:
    """Incremental detokenization: feed token ids, get the newly printable text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def push(self, token_ids: Sequence[int]) -> str:
        self.tokens.extend(token_ids)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return ""
        new, self.text = text[len(self.text) :], text
        return new


@dataclass
class LocalResult:
    text: str
    token_ids: list[int]
    stats: SpecStats
    wall_time_s: float
    first_token_time_s: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_time_s if self.wall_time_s else 0.0


def generate(
    session: Session,
    prompt: str,
    max_new_tokens: int,
    num_draft_tokens: int = 0,
    sampling: SamplingParams = speculation_sampling.GREEDY,
    use_draft_logits: bool = False,
    on_text=None,
    chat: bool = False,
) -> LocalResult:
    """Generate from a text prompt; `on_text(str)` receives the text as it streams."""
    prompt_ids = session.encode(prompt, chat)
    text = TextStream(session.tokenizer)
    start = time.perf_counter()
    first = 0.0
    stats = SpecStats()
    for item in session.stream(prompt_ids, max_new_tokens, num_draft_tokens, sampling, use_draft_logits):
        if isinstance(item, SpecStats):
            stats = item
            continue
        if not first:
            first = time.perf_counter() - start
        piece = text.push(item)
        if piece and on_text is not None:
            on_text(piece)
    wall = time.perf_counter() - start
    return LocalResult(text.text, text.tokens, stats, wall, first)


def stats_lines(result: LocalResult, speculative: bool) -> list[str]:
    """The statistics `specdeploy generate` prints after the text."""
    s = result.stats
    lines = [
        f"output tokens      {len(result.token_ids)} ({s.finish_reason or 'done'})",
        (
            f"tokens/s           {result.tokens_per_s:.1f} "
            f" ({1000 * result.wall_time_s / max(1, len(result.token_ids)):.1f} ms/token, first token"
            f" {1000 * result.first_token_time_s:.0f} ms)"
        ),
        f"target iterations  {s.target_iterations}",
    ]
    if speculative:
        lines += [
            (
                f"policy             {s.policy}; speculated in {sum(1 for k in s.k_per_round if k > 0)} of {s.rounds}"
                f" rounds ({s.speculated_share:.0%})"
            ),
            f"k per round        {k_timeline(s.k_per_round)}",
            f"drafted            {s.drafted}",
            f"accepted           {s.accepted}",
            f"acceptance rate    {s.acceptance_rate:.1%}",
            f"acceptance length  {s.acceptance_length:.2f} tokens per target call",
            f"time in draft      {s.draft_time_s:.3f} s",
        ]
    lines.append(f"time in target     {s.target_time_s:.3f} s (wall {result.wall_time_s:.3f} s)")
    return lines


def k_timeline(ks: Sequence[int], width: int = 48) -> str:
    """The draft length each round asked for, as runs ("4x12 0x30 1 0x8"), cut to about `width` characters."""
    runs: list[list[int]] = []
    for k in ks:
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    text = " ".join(f"{k}x{n}" if n > 1 else str(k) for k, n in runs)
    return text if len(text) <= width else text[: width - 3].rsplit(" ", 1)[0] + " ..."
