"""Continuous batching with chunked prefill: which prompt chunk and which slots run each step.

Plain Python and no JAX, so it is testable without a model. Policy (in the spirit of
Orca, Yu et al. 2022, and Sarathi, Agrawal et al. 2023):

* a bounded FCFS queue; ``add`` raises ``QueueFull`` when it is at capacity;
* a request takes a free slot when its prefill starts and keeps it until it finishes;
* each step runs at most one prefill chunk of at most ``chunk_size`` tokens, plus one decode
  step for every slot whose prompt is fully cached, so running streams keep a steady TPOT
  while a long prompt is prefilled piece by piece;
* a queued request whose client is gone is dropped without being prefilled; a cancelled
  running request is finished (CANCELLED) and its slot freed at the next step.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from service.request import FinishReason, Request, RequestState


class QueueFull(Exception):
    """The waiting queue is at capacity (maps to RESOURCE_EXHAUSTED)."""


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Write prompt tokens [start, start + length) of ``request`` into ``slot``'s KV cache.

    ``is_last``: the chunk ends the prefill (``Request.prefill_len``), fixed when the chunk is
    made, before the id it samples joins the request's output."""

    request: Request
    slot: int
    start: int
    length: int
    is_last: bool = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_last", self.start + self.length == self.request.prefill_len)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What one engine step executes."""

    prefill: PrefillChunk | None
    decode: tuple[Request, ...]  # requests in DECODING state, one new token each

    @property
    def empty(self) -> bool:
        return self.prefill is None and not self.decode

    @property
    def admitted(self) -> frozenset[Request]:
        """The request whose first chunk this is, if the step's chunk starts a prompt."""
        return frozenset() if self.prefill is None or self.prefill.start else frozenset((self.prefill.request,))

    @property
    def prefills(self) -> tuple[PrefillChunk, ...]:
        """The step's prefill chunks (at most one here; ``RaggedPlan`` has several)."""
        return () if self.prefill is None else (self.prefill,)

    @property
    def num_tokens(self) -> int:
        """Real tokens: decode tokens plus the chunk's tokens."""
        return len(self.decode) + (self.prefill.length if self.prefill is not None else 0)


class Scheduler:
    """Slots, the waiting queue and the per-step plan.

    Args:
        num_slots: decode slots (rows of the KV cache), >= 1.
        max_queue: most requests waiting for a slot, >= 0.
        chunk_size: most prompt tokens prefilled per step, >= 1.
    """

    def __init__(self, num_slots: int, max_queue: int, chunk_size: int):
        self.num_slots = num_slots
        self.max_queue = max_queue
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.slots: list[Request | None] = [None] * num_slots
        self.prefills_started = 0  # requests whose first prompt chunk was scheduled

    # ---- admission ------------------------------------------------------------------------
    def add(self, request: Request, reserved: bool = False) -> None:
        """Queue a request. Raises QueueFull when ``max_queue`` requests already wait, unless
        ``reserved``: the caller counted it against the bound already (``EngineLoop.submit``,
        which leaves out the requests the free slots will take)."""
        if not reserved and len(self.waiting) >= self.max_queue:
            raise QueueFull(f"queue full: {len(self.waiting)} requests waiting (max {self.max_queue})")
        self.waiting.append(request)

    # ---- the plan ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Reap cancelled requests, then choose this step's prefill chunk and decode set."""
        self._reap_cancelled()
        chunk = self._next_prefill_chunk()
        # A request whose dispatched steps already sampled max_tokens ids is done once they land.
        decode = tuple(
            r for r in self.slots if r is not None and r.state is RequestState.DECODING and r.sampled < r.max_tokens
        )
        return StepPlan(prefill=chunk, decode=decode)

    def _reap_cancelled(self) -> None:
        kept: deque[Request] = deque()
        for r in self.waiting:
            if r.cancelled:
                r.finish(FinishReason.CANCELLED)
            else:
                kept.append(r)
        self.waiting = kept
        for running in self.slots:
            if running is not None and running.cancelled:
                running.finish(FinishReason.CANCELLED)
        self.release_finished()

    def _next_prefill_chunk(self) -> PrefillChunk | None:
        request = next((r for r in self.slots if r is not None and r.state is RequestState.PREFILLING), None)
        if request is None:
            free = self.free_slot()
            if free is None or not self.waiting:
                return None
            request = self.waiting.popleft()
            request.slot = free
            request.state = RequestState.PREFILLING
            self.slots[free] = request
            self.prefills_started += 1
        assert request.slot is not None
        length = min(self.chunk_size, request.prompt_len - request.num_cached)
        return PrefillChunk(request=request, slot=request.slot, start=request.num_cached, length=length)

    # ---- bookkeeping ------------------------------------------------------------------------
    def free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def release_finished(self) -> None:
        """Free the slots of finished requests."""
        for i, r in enumerate(self.slots):
            if r is not None and r.state is RequestState.FINISHED:
                self.slots[i] = None

    @property
    def active_slots(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def all_requests(self) -> list[Request]:
        return [r for r in self.slots if r is not None] + list(self.waiting)
