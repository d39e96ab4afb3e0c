"""In-flight (continuous) batching over one Executor: `BatchScheduler` steps every active request together, the
engine passes of all of them in one batched forward, as TensorRT-LLM's batch manager does."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from typing import Callable, Iterator

from specdeploy.core.errors import ConfigError
from specdeploy.engine.eagle3 import HeadPass
from specdeploy.engine.executor import EnginePass, Executor
from specdeploy.engine.native import standing_team
from specdeploy.engine.request import EngineRequest, GenerationChunk


class _Job:
    """A request in a BatchScheduler: its steps generator and the queue its consumer reads."""

    def __init__(self, request: EngineRequest):
        self.request = request
        self.steps: Iterator | None = None
        self.out: queue.SimpleQueue = queue.SimpleQueue()  # GenerationChunk | BaseException
        self.closed = False  # the consumer stopped reading (cancelled, or gone)


class BatchScheduler:
    """In-flight (continuous) batching over one Executor, as TensorRT-LLM's batch manager does.

    A background thread steps every active request together: each request runs until it needs an
    engine pass (`Executor.steps` yields a `EnginePass`), then the passes of all active requests (decode
    rows, k + 1 verification rows, prefill chunks of `prefill_chunk` positions) run in one
    `engine.forward_batch`: the linear layers once over all rows, attention per sequence over its own
    KV cache. Requests join and leave between steps; at most `max_batch_size` are active, the others
    wait in arrival order. Rows are computed independently of their neighbours (see
    specdeploy.engine.model), so a request's tokens and logits do not depend on what it was batched
    with. The KV caches come from the executor's one pool (prefix reuse across requests and rounds).

    Requests in the fused EAGLE-3 loop also ask for head forwards (`HeadPass`: catch-up on the target's features,
    then one per draft token): before each engine step the scheduler runs those of all requests together, one
    `Eagle3Head.forward_batch` (the head's linears once over every request's rows, attention per sequence), until
    every request waits for its engine pass. A head forward over 2 rows costs ~1.1 one-row forwards on these CPUs
    (docs/benchmarks.md "The heads of the requests in flight in one forward"), so two requests drafting side by side
    pay about one head's time, not two.

    `generate(request)` is called from any thread and yields the request's chunks as `Executor.generate`
    does; closing it early (cancellation) drops the request at the next step and frees its cache."""

    def __init__(self, executor: Executor, max_batch_size: int, load: Callable[[], Executor] | None = None):
        if max_batch_size < 1:
            raise ConfigError(f"max_batch_size is {max_batch_size}, must be >= 1", "set engine.max_batch_size >= 1")
        self.executor = executor
        self.max_batch_size = max_batch_size
        self.steps_run = 0  # batched engine steps so far
        self.max_active = 0  # the most requests that shared one step
        self.head_steps_run = 0  # batched EAGLE-3 head forwards so far (the fused loop's catch-up and draft steps)
        self.max_head_batch = 0  # the most requests that shared one head forward
        self._cond = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._stopped = False
        self._paused = 0
        loaded, failure = threading.Event(), []

        def main():
            try:
                if load is not None:
                    self.executor = load()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                failure.append(exc)
                return
            finally:
                loaded.set()
            self._loop()

        self._thread = threading.Thread(target=main, name="specdeploy-batch-scheduler", daemon=True)
        self._thread.start()
        loaded.wait()
        if failure:
            raise failure[0]

    @classmethod
    def loading(cls, load: Callable[[], Executor], max_batch_size: int) -> "BatchScheduler":
        """A scheduler whose executor `load()` builds in the scheduler's own thread, so that the engine's OpenMP
        work (loading, prepacking, every step) runs in that one thread. torch's OpenMP (libgomp) gives every
        thread that runs a parallel region its own team; a second team on a machine with as many cores as one
        team has threads makes all of them sleep between regions instead of spinning, and a step then took
        several times longer (docs/benchmarks.md "In-flight batching")."""
        return cls(None, max_batch_size, load)  # type: ignore[arg-type]

    def generate(self, request: EngineRequest) -> Iterator[GenerationChunk]:
        job = _Job(request)
        with self._cond:
            if self._stopped:
                raise ConfigError("the batch scheduler was closed", "the model is unloading; send the request again")
            self._waiting.append(job)
            self._cond.notify()
        try:
            while True:
                item = job.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            job.closed = True
            with self._cond:
                self._cond.notify()

    @contextlib.contextmanager
    def paused(self):
        """No step starts inside this block (requests queue up): lets a test or a caller line requests up."""
        with self._cond:
            self._paused += 1
        try:
            yield self
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify()

    def waiting(self) -> int:
        """Requests queued, not yet active."""
        with self._cond:
            return len(self._waiting)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        active: list[_Job] = []
        while True:
            with self._cond:
                while not self._stopped and (self._paused or (not self._waiting and not active)):
                    self._cond.wait()
                if self._stopped:
                    break
                while self._waiting and len(active) < self.max_batch_size:
                    active.append(self._waiting.popleft())  # join between steps
            # one standing team for the step (the requests' own work between passes, the EAGLE-3 head's included, and
            # the pass): its helper threads are woken once, not once per parallel loop (engine/native.standing_team)
            with standing_team(getattr(self.executor.engine, "native", None)):
                pending: dict[_Job, EnginePass | HeadPass] = {}
                for job in list(active):
                    self._step_to(job, pending, active)
                # the EAGLE-3 head's forwards first (catch-up and draft steps of the fused loop), the requests'
                # together, until every request waits for its engine pass
                while heads := [(job, item) for job, item in pending.items() if isinstance(item, HeadPass)]:
                    self.max_head_batch = max(self.max_head_batch, len(heads))
                    if self._run(self.executor.run_head_passes, heads, pending, active):
                        self.head_steps_run += 1
                        for job, _ in heads:
                            self._step_to(job, pending, active)
                work = list(pending.items())  # (job, engine pass)
                if not work:
                    continue
                self.max_active = max(self.max_active, len(work))
                if self._run(self.executor.run_passes, work, pending, active):
                    self.steps_run += 1
        for job in active + list(self._waiting):
            job.out.put(ConfigError("the batch scheduler was closed", "the model is unloading; send the request again"))
            self._drop(job)

    def _step_to(self, job: _Job, pending: dict, active: list[_Job]) -> None:
        """Advance the job to its next pass (pending[job]), or take it out of `active` when it is done."""
        step = self._advance(job)
        if step is None:
            pending.pop(job, None)
            active.remove(job)  # leave between steps
        else:
            pending[job] = step

    def _run(self, run, work: list, pending: dict, active: list[_Job]) -> bool:
        """run([pass of each (job, pass) in work]); a failure fails the requests of this step (the others go on)."""
        try:
            run([item for _, item in work])
            return True
        except Exception as exc:  # noqa: BLE001 - handed to each request's consumer
            for job, _ in work:
                job.out.put(exc)
                self._drop(job)
                pending.pop(job, None)
                active.remove(job)
            return False

    def _advance(self, job: _Job) -> "EnginePass | HeadPass | None":
        """Run the job's steps up to its next engine or head pass (sending its chunks on the way); None when the
        job is done, failed or closed (its steps are then closed and its cache back in the pool)."""
        if job.closed:
            self._drop(job)
            return None
        try:
            if job.steps is None:
                job.steps = self.executor.steps(job.request)
            item = next(job.steps)
            while not isinstance(item, (EnginePass, HeadPass)):
                job.out.put(item)
                item = next(job.steps)
            return item
        except StopIteration:
            self._drop(job)
            return None
        except Exception as exc:  # a refused request (ConfigError) or a failure in its processing
            job.out.put(exc)
            self._drop(job)
            return None

    @staticmethod
    def _drop(job: _Job) -> None:
        if job.steps is not None:
            try:
                job.steps.close()
            except Exception:  # noqa: BLE001  (a failed pass may leave the cache inconsistent: it is discarded)
                pass
            job.steps = None
