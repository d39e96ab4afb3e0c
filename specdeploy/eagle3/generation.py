"""The target answering for `specdeploy draft data`: its chat template as token ids (`ChatFormat`), generations
run through a BatchScheduler many at a time (`Generator`), each finished one appended to a journal (`Journal`) so
that an interrupted run resumes where it stopped."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from specdeploy.core.durations import duration_text
from specdeploy.core.errors import ConfigError

_MARK = "\u2063SPECDEPLOY-USER-TURN\u2063"  # stands in for a user turn's content when cutting the template


# ---------------------------------------------------------------- the chat template


class ChatFormat:
    """The target's chat template as token ids: a conversation ready for the answer, and a user turn's prefix."""

    def __init__(self, tokenizer):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the target's tokenizer has no chat template; EAGLE-3 training data is chat-formatted",
                "use an instruct (chat) target model whose tokenizer has a chat template",
            )
        self.tokenizer = tokenizer
        self.end_id = tokenizer.eos_token_id
        if self.end_id is None:
            raise ConfigError("the target's tokenizer has no end (eos) token", "use a tokenizer with an eos token")
        bos = getattr(tokenizer, "bos_token_id", None)
        probe = list(tokenizer("x", add_special_tokens=True).input_ids)
        self._bos = bos if bos is not None and probe and probe[0] == bos else None  # the tokenizer's own BOS

    def _ids(self, text: str) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if self._bos is not None and (not ids or ids[0] != self._bos):
            ids.insert(0, self._bos)  # what the server's preprocessing (add_special_tokens) would send
        return ids

    def prompt_ids(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": r, "content": c} for r, c in messages], tokenize=False, add_generation_prompt=True
        )
        return self._ids(text)

    def answer_ids(self, text: str) -> list[int]:
        """An assistant turn's content as the target would have written it after prompt_ids: its tokens and the end
        token (an answer the target writes ends with it too)."""
        return [*self.tokenizer(text, add_special_tokens=False).input_ids, self.end_id]

    def user_turn_prefix(self) -> list[int]:
        """The ids the template writes before a (first) user turn's content, system prompt included."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=False
        )
        if _MARK not in text:
            raise ConfigError(
                "the chat template does not show the user's content; self_instruct cannot find a user turn",
                "remove self_instruct from draft.data.sources",
            )
        return self._ids(text.split(_MARK, 1)[0])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([i for i in ids if i != self.end_id], skip_special_tokens=True)


# ---------------------------------------------------------------- the journal (resume)


class Journal:
    """Finished generations, one JSON line each ({"key", "tokens", "reason"}), in the work folder."""

    def __init__(self, path: Path):
        self.path = path
        self.done: dict[str, dict] = {}
        good = []
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    self.done[entry["key"]] = entry
                    good.append(line)
                except (ValueError, KeyError, TypeError):
                    break  # a line cut by the interruption, and anything after it
            path.write_text("".join(g + "\n" for g in good), encoding="utf-8")
        self._fh = open(path, "a", encoding="utf-8")

    def add(self, key: str, tokens: list[int], reason: str) -> None:
        entry = {"key": key, "tokens": tokens, "reason": reason}
        self._fh.write(json.dumps(entry) + "\n")
        self._fh.flush()
        self.done[key] = entry

    def close(self) -> None:
        self._fh.close()


# ---------------------------------------------------------------- generation


@dataclass
class Job:
    key: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float | None  # None: greedy
    seed: int


class Generator:
    """Runs jobs through a BatchScheduler over the target engine; journals each finished one; shows progress."""

    def __init__(self, scheduler, end_id: int, journal: Journal, echo, on_sample: Callable[[str], None] | None):
        self.scheduler = scheduler
        self.end_id = end_id
        self.journal = journal
        self.echo = echo
        self.on_sample = on_sample
        self.tokens = 0  # answer tokens of the generations journaled in this run
        self.live_tokens = 0  # tokens generated in this run so far, unfinished generations included
        self.busy_s = 0.0
        self._lock = threading.Lock()

    def _one(self, job: Job):
        from specdeploy.engine.request import EngineRequest
        from specdeploy.speculation.sampling import GREEDY, SamplingParams

        # top_p 1.0: sampled from the whole distribution; TensorRT-LLM (and the CPU engine) decode greedily when
        # neither top_k nor top_p is set, whatever the temperature (specdeploy.speculation.sampling.is_greedy)
        sampling = (
            GREEDY if job.temperature is None else SamplingParams(temperature=job.temperature, top_p=1.0, seed=job.seed)
        )
        request = EngineRequest(
            input_ids=job.input_ids,
            max_new_tokens=job.max_new_tokens,
            sampling=sampling,
            end_id=self.end_id,
            streaming=True,
        )  # streamed: the progress line counts tokens as they come
        tokens: list[int] = []
        reason = None
        for chunk in self.scheduler.generate(request):
            tokens.extend(chunk.token_ids)
            with self._lock:
                self.live_tokens += len(chunk.token_ids)
            reason = chunk.finish_reason
        return job, tokens, reason

    def run(self, jobs: list[Job], label: str, total: int, done_before: int) -> None:
        """Generate every job not in the journal yet; `total` and `done_before` (jobs done before `jobs`) are for the
        progress line."""
        todo = [j for j in jobs if j.key not in self.journal.done]
        if not todo:
            return
        start = time.monotonic()
        tokens0 = self.live_tokens
        done = done_before + len(jobs) - len(todo)
        resumed = done  # journaled by an earlier run: not this run's pace
        last_print = 0.0
        workers = self.scheduler.max_batch_size
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="draft-data")
        try:
            futures = [pool.submit(self._one, j) for j in todo]
            for future in as_completed(futures):
                job, tokens, reason = future.result()
                self.journal.add(job.key, tokens, reason)
                self.tokens += len(tokens)
                done += 1
                if self.on_sample is not None:
                    self.on_sample(job.key)
                now = time.monotonic()
                if now - last_print >= 5.0 or done == total:
                    last_print = now
                    elapsed = now - start
                    rate = (self.live_tokens - tokens0) / elapsed if elapsed else 0.0
                    per_job = elapsed / (done - resumed)
                    eta = per_job * (total - done)
                    self.echo(f"{label}: {done}/{total}, {rate:.1f} tokens/s, ETA {duration_text(eta)}")
        except BaseException:
            for f in futures if "futures" in locals() else []:
                f.cancel()
            raise
        finally:
            self.busy_s += time.monotonic() - start
            pool.shutdown(wait=False, cancel_futures=True)
