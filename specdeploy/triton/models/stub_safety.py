"""Living with the python backend's stub: what a model keeps and locks so that the stub's heap stays whole.

`HeldResponses` (decoupled BLS calls' response iterators, released only once the stub's own thread is done with
them), `StubLock` (one lock for every triton_python_backend_utils call made from more than one thread) and `send`
(a response sender's send that frees none of the response's tensors inside the stub).
"""

from __future__ import annotations

from specdeploy.triton.models.cancellation import CancelCheck


class HeldResponses:
    """The response iterators of a stub's decoupled BLS calls, kept until the stub's own thread is done with them.

    In tritonserver 2.51's python backend (r24.10), a decoupled call that ends queues its iterator's cleanup for
    the stub's stub-to-parent thread, which drops the stub's reference to it. If the model had dropped its own
    references first, the iterator, its responses and their tensors are freed on that thread, and a tensor frees
    its numpy array without holding the GIL (`PbTensor::~PbTensor`; python_backend b771f4f, r24.12, holds it)
    while the model's thread runs Python: the Python heap is corrupted and the stub dies with SIGSEGV in whatever
    it allocates next ("Stub process is not healthy"; 1 in ~60 rounds of 6 concurrent streams in
    tests/test_triton_server.py before this). `request.is_cancelled()` goes through the same queue and waits for
    its answer, so once it answered, every cleanup queued before it is done and the iterators held so far are
    owned by the model alone: released then, on the model's thread, with the GIL."""

    def __init__(self):
        self._held: list = []

    def hold(self, iterator):
        self._held.append(iterator)
        return iterator

    def release(self, check: CancelCheck | None) -> None:
        """Drop the held iterators if `check.ask_now()` went through the queue (else keep them for a later call)."""
        if self._held and check is not None and not check.ask_now():
            self._held.clear()

    def clear(self) -> None:
        """At `finalize`, not later: a response freed at the stub's teardown would touch its shared memory after it is
        gone."""
        self._held.clear()

    def __len__(self) -> int:
        return len(self._held)


def send(sender, response, flags: int) -> None:
    """`sender.send(response, flags=flags)`, the response's tensors kept alive by the model until the send is done.

    In tritonserver 2.51's python backend (r24.10), `ResponseSender::Send` releases the GIL and then drops the
    response's output tensors that the request did not ask for (`InferResponse::PruneOutputTensors`,
    src/response_sender.cc, added by python_backend bfabfdb). A tensor dropped there frees its numpy array without
    the GIL (`PbTensor::~PbTensor`; fixed in python_backend b771f4f, r24.12, which takes the GIL there) while another
    of the model's threads runs Python: the Python heap is corrupted and the stub dies with SIGSEGV in whatever it
    allocates next. In-flight batching made it frequent: a request thread sends its answer to a BLS that asked for a
    few outputs while the scheduler thread builds the next step (docs/triton-stub-workarounds.md: without this hold a
    stub died within 2-16 rounds of test_batching's served requests, with it none did in 450 rounds). Holding the
    tensors' Python handles here leaves the stub only a reference to drop; the tensors are freed when this
    function returns, with the GIL."""
    held = response.output_tensors() if response is not None and not response.has_error() else None
    try:
        sender.send(response, flags=flags)
    finally:
        del held


class StubLock:
    """One lock for every triton_python_backend_utils call a stub makes from more than one thread.

    The python backend's stub is not safe for that: its response sender releases the GIL while it sends, and a
    tensor built meanwhile in another thread corrupted the stub's heap ("munmap_chunk(): invalid pointer", a
    faulthandler stack in `_response` beside another thread in `send`; tests/test_batching.py, in-flight batching).
    A request thread holds it for all its work and lets go only while it waits for the engine (`released_while`)."""

    def __init__(self):
        import threading

        self._lock = threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc):
        self._lock.release()

    def released_while(self, items):
        """Iterate `items` (a generator that blocks for each item) without the lock while it blocks."""
        iterator = iter(items)
        while True:
            self._lock.release()
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self._lock.acquire()
            yield item
