"""When a request ends before its tokens do: its deadline, the client's cancellation, TensorRT-LLM's `stop`.

`CancelCheck` (cancelled, timed out or stopped; asked of the stub at most every interval), `RunningRequests` (a
model instance's running requests by id, for `stop`), `request_cancel_check` (a Triton request's check), and the
BLS's draft/target calls in time slices, so that a cancellation reaches inside a round (`call_in_slices`).
"""

from __future__ import annotations

import contextlib


def deadline_s(request_timeout_us: int, default_s: float) -> float | None:
    """Seconds a request may run on the server: its own Triton `timeout` (microseconds, tritonclient's
    `timeout=`) when set, else the model's `request_timeout_s` parameter; None: no deadline."""
    if request_timeout_us and request_timeout_us > 0:
        return request_timeout_us / 1e6
    return default_s if default_s and default_s > 0 else None


class CancelCheck:
    """`request.is_cancelled()` at most every `interval_s` (each call is a round trip to the server
    process) plus the request's deadline; `reason` is "cancelled" or "timeout" once it fires."""

    def __init__(self, is_cancelled, deadline_s: float | None, interval_s: float = 0.05, clock=None):
        import time

        self._clock = clock or time.monotonic
        self._is_cancelled = is_cancelled
        self._deadline = None if deadline_s is None else self._clock() + deadline_s
        self._interval = interval_s
        self._next = self._clock() + interval_s
        self.deadline_s = deadline_s
        self.reason: str | None = None

    def __call__(self) -> bool:
        if self.reason is None:
            now = self._clock()
            if self._deadline is not None and now > self._deadline:
                self.reason = "timeout"
            elif now >= self._next:
                self._next = now + self._interval
                if self._is_cancelled():
                    self.reason = "cancelled"
        return self.reason is not None

    def stop(self) -> None:
        """End the request early on purpose (TensorRT-LLM's `stop`): it finishes with what it has."""
        if self.reason is None:
            self.reason = "stopped"

    def ask_now(self) -> bool:
        """`is_cancelled()` now, not throttled; True: the request is to end (cancelled, timed out or stopped).

        False means the question went through the stub's queue to the server and back (a stub caches a True
        answer and no longer asks), which `HeldResponses.release` relies on."""
        if self.reason is None and self._is_cancelled():
            self.reason = "cancelled"
        return self.reason is not None


class RunningRequests:
    """The running requests of a model instance by Triton request id, so that TensorRT-LLM's `stop`
    input (a second request with the same id and stop=true) can end them: their CancelCheck then
    reads "stopped", and the executor finishes them with the tokens they have (not an error)."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()
        self._checks: dict[str, list[CancelCheck]] = {}

    @contextlib.contextmanager
    def registered(self, request_id: str, check: CancelCheck):
        if not request_id:  # without an id a request cannot be stopped this way
            yield
            return
        with self._lock:
            self._checks.setdefault(request_id, []).append(check)
        try:
            yield
        finally:
            with self._lock:
                checks = self._checks.get(request_id, [])
                checks.remove(check)
                if not checks:
                    self._checks.pop(request_id, None)

    def stop(self, request_id: str) -> int:
        """Stop every running request with this id; how many there were."""
        with self._lock:
            checks = list(self._checks.get(request_id, [])) if request_id else []
        for check in checks:
            check.stop()
        return len(checks)


def request_cancel_check(request, default_timeout_s: float, lock=None) -> CancelCheck:
    """The request's CancelCheck; `lock` (the model's StubLock) is held around `is_cancelled` when other threads
    of the stub may be calling triton_python_backend_utils at the same time."""
    try:
        timeout_us = int(request.timeout())
    except Exception:  # older stubs have no timeout()
        timeout_us = 0
    is_cancelled = getattr(request, "is_cancelled", lambda: False)
    if lock is not None:
        unlocked = is_cancelled

        def is_cancelled():
            with lock:
                return unlocked()

    return CancelCheck(is_cancelled, deadline_s(timeout_us, default_timeout_s))


# ---------------------------------------------------------------- BLS calls in time slices (cancellation inside a
# round) A BLS request's draft/target calls do not see the client's cancellation of the BLS request. So
# each call carries a short Triton timeout: the engine model stops at it (between prefill chunks and
# tokens, its KV stays cached), the BLS checks its own request, and re-sends the call if it goes on;
# the re-sent call reuses the cached prefix, so it resumes where the expired one stopped.

CANCEL_CHECK_INTERVAL_S = 0.5


class SliceExpired(Exception):
    """A BLS call ran out of its time slice before it finished."""


class ParentStopped(Exception):
    """The BLS request was cancelled or passed its deadline while one of its calls ran."""


def is_slice_expiry(message: str) -> bool:
    """An engine model's error for a call stopped at its own timeout (tensorrt_llm's deadline text,
    or Triton's queue timeout)."""
    return "server-side deadline" in message or "timeout expired" in message.lower()


def run_slice_s(output_len: int, per_token_s: float, active: int) -> float:
    """The first time slice of a plain run: a slice that expires mid-run loses every token it generated, so it
    allows twice the run's time at the per-token cost measured so far, times the requests in flight (their steps
    share the target, so a token costs more than one request alone measured), plus a second for the prompt's
    prefill; a slice sized for one request alone expired in most runs at concurrency 2 (docs/stages.md "3. repo")."""
    return 2.0 * max(1, active) * output_len * per_token_s + 1.0


def call_in_slices(attempt, stop_check, slice_s: float, max_attempts: int = 10_000):
    """`attempt(slice_s)` until it returns, checking `stop_check()` (a CancelCheck) after each expired
    slice. An attempt that expired after generating tokens lost them (only prefill work stays cached),
    so the next slice is twice as long: a call always finishes, however slow its decode steps."""
    for _ in range(max_attempts):
        try:
            return attempt(slice_s)
        except SliceExpired as exc:
            if stop_check():
                what = "ran past its server-side deadline" if stop_check.reason == "timeout" else "was cancelled"
                raise ParentStopped(f"the request {what} during this call") from None
            if _generated_before_expiry(str(exc)):
                slice_s *= 2
    raise ParentStopped(f"the call did not finish in {max_attempts} time slices")


def _generated_before_expiry(message: str) -> bool:
    import re

    match = re.search(r"after (\d+) tokens", message)
    return match is None or int(match.group(1)) > 0
