"""Scheduling over a paged KV cache: ragged steps under a token budget, admission by pages,
prefix hits and preemption.

Plain Python and no JAX, so it is testable without a model. Policy, as vLLM's V1 scheduler
(Kwon et al. 2023, §4.5; the token budget of Sarathi, Agrawal et al. 2023):

* each step first gives every decoding sequence its one token, oldest first; a sequence whose
  next token needs a page when none is free or evictable preempts the newest running sequence
  (its pages go back at once, it waits at the head of the queue and is recomputed later: its
  prompt and the ids it already streamed are prefilled again, so the client sees nothing of
  it), or, when it is the newest itself, is preempted;
* then prompts fill ``max_num_batched_tokens`` (decode tokens have their own region): the chunks of prompts already
  being prefilled, then new requests in arrival order (preempted ones first), each chunk at most
  ``chunk_size`` tokens, while a row (slot) is free and the block manager can hold the whole
  prompt; admission never preempts, and a step that preempted admits nothing. The sequences of
  one request with n > 1 (``Request.group``) are admitted one first, the rest once its prompt
  is prefilled: they then share its prompt's full pages (later requests are admitted past
  them meanwhile); A prompt's cached prefix (``BlockManager.allocate``'s
  match) is skipped: only the rest is prefilled;
* a cancelled request is finished and its pages returned at the next step; a finished one's
  at once (``release_finished``).

Rows: a running sequence holds one of ``num_slots`` rows of the step's per-sequence arrays
(page table, sampling parameters, token history) from admission until it finishes or is
preempted. ``page_tables`` [num_slots, max_pages] is kept here, row by row, as pages are
allocated and added.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from service.block_manager import BlockManager, OutOfPages
from service.request import FinishReason, Request, RequestState
from service.scheduler import PrefillChunk, QueueFull


@dataclasses.dataclass(frozen=True)
class RaggedPlan:
    """What one ragged step runs: one token for each of ``decode``, then ``prefills``' chunks.

    ``admitted``: the requests whose first chunk since admission is in ``prefills`` (their
    row's sampling parameters and history must be installed before the step runs).
    """

    prefills: tuple[PrefillChunk, ...]
    decode: tuple[Request, ...]
    admitted: frozenset[Request] = frozenset()

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decode

    @property
    def prefill(self) -> PrefillChunk | None:
        """The first prefill chunk (the one-chunk view ``StepPlan`` readers use), or None."""
        return self.prefills[0] if self.prefills else None

    @property
    def num_tokens(self) -> int:
        """Real tokens: decode tokens plus chunk tokens."""
        return len(self.decode) + sum(c.length for c in self.prefills)


class PagedScheduler:
    """Rows, the waiting queue, the block manager and the per-step ragged plan.

    Args:
        num_slots: rows, the most sequences running at once (vLLM's ``max_num_seqs``), >= 1.
        max_queue: most new requests waiting (preempted ones wait outside this bound), >= 0.
        chunk_size: most tokens of one prompt per step, >= 1.
        max_num_batched_tokens: most prefill tokens per step (chunks charged in whole
            ``chunk_align`` units; at least one unit), >= 1. Decode tokens are not counted: each
            step has one position per row for them.
        blocks: the pool's pages.
        max_seq_len: the longest sequence; the page tables have room for it.
        chunk_align: each chunk is charged to the budget rounded up to a multiple of this (the
            engine pads every chunk to whole blocks of its prefill region), >= 1.

    Raises:
        ValueError: sizes out of range.
    """

    def __init__(
        self,
        num_slots: int,
        max_queue: int,
        chunk_size: int,
        max_num_batched_tokens: int,
        blocks: BlockManager,
        max_seq_len: int,
        chunk_align: int = 1,
    ):
        if num_slots < 1 or chunk_size < 1 or max_queue < 0:
            raise ValueError(f"bad sizes: num_slots {num_slots}, chunk_size {chunk_size}, max_queue {max_queue}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.num_slots = num_slots
        self.max_queue = max_queue
        self.chunk_size = chunk_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_align = max(1, chunk_align)
        self.blocks = blocks
        self.max_pages = -(-max_seq_len // blocks.page_size)
        self.page_tables = np.zeros((num_slots, self.max_pages), np.int32)
        self.waiting: deque[Request] = deque()
        self.resuming: deque[Request] = deque()  # preempted, recomputed before new requests
        self.slots: list[Request | None] = [None] * num_slots
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.prefills_started = 0
        self.preemptions = 0
        self._committed: dict[Request, int] = {}  # pages passed to commit_full_pages, per request

    # ---- admission ------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request. Raises QueueFull when ``max_queue`` requests already wait."""
        if len(self.waiting) >= self.max_queue:
            raise QueueFull(f"queue full: {len(self.waiting)} requests waiting (max {self.max_queue})")
        self.waiting.append(request)

    # ---- the plan ---------------------------------------------------------------------------
    def schedule(self) -> RaggedPlan:
        """Reap cancelled requests, then choose this step's decode tokens and prefill chunks,
        reserving their pages (preempting where decode tokens need pages)."""
        self._reap_cancelled()
        preempted = self.preemptions
        decode = self._decode_tokens()
        # Decode tokens ride in a region of their own (one position per row); prefill chunks
        # share the budget in whole aligned units (each chunk is charged whole units).
        align = self.chunk_align
        budget = max(align, self.max_num_batched_tokens // align * align)
        chunks: list[PrefillChunk] = []
        for r in self.running:
            if budget <= 0:
                break
            if r.state is RequestState.PREFILLING:
                chunks.append(self._chunk(r, budget))
                budget -= -(-chunks[-1].length // align) * align
        admitted = []
        # No admission in a step that had to preempt: the pages just freed would be taken back
        # at once and the next step would preempt again (vLLM's scheduler holds back likewise).
        while budget > 0 and self.preemptions == preempted:
            new = self._admit()
            if new is None:
                break
            admitted.append(new)
            chunks.append(self._chunk(new, budget))
            budget -= -(-chunks[-1].length // align) * align
        return RaggedPlan(prefills=tuple(chunks), decode=tuple(decode), admitted=frozenset(admitted))

    def _decode_tokens(self) -> list[Request]:
        decode: list[Request] = []
        for r in list(self.running):
            # Preempted by an older sequence earlier in this loop, or done once its ids land.
            if r.state is not RequestState.DECODING or r.slot is None or r.sampled >= r.max_tokens:
                continue
            while True:
                try:
                    added = self.blocks.grow(r, 1)
                    break
                except OutOfPages:
                    self._preempt(self.running[-1])  # the newest; r itself when it is
                    if r.slot is None:
                        break
            if r.slot is None:
                continue
            self._set_pages(r, added)
            decode.append(r)
        return decode

    def _admit(self) -> Request | None:
        """Move the next preempted or waiting request into a free row, with pages for its whole
        prompt (the cached prefix shared); None when there is no row, no request or no room."""
        free = self.free_slot()
        queue = self.resuming if self.resuming else self.waiting
        if free is None or not queue:
            return None
        r = queue[0] if queue is self.resuming else next((w for w in queue if not self._waits_for_sibling(w)), None)
        if r is None:
            return None
        if r.sampled != len(r.output_ids):
            return None  # a preempted request's last id has not landed: its ids are not known yet
        try:
            alloc = self.blocks.allocate(r, r.prompt_ids + r.output_ids, use_prefix_cache=r.prefix_cache)
        except OutOfPages:
            return None
        queue.remove(r)
        r.slot = free
        r.state = RequestState.PREFILLING
        r.num_cached = alloc.num_cached_tokens
        self.slots[free] = r
        self.running.append(r)
        self.page_tables[free, : len(alloc.page_table)] = alloc.page_table
        self._committed[r] = alloc.num_cached_tokens // self.blocks.page_size
        self.prefills_started += 1
        return r

    def _waits_for_sibling(self, r: Request) -> bool:
        """Whether ``r`` is held back because a sequence of its group (the same request's n > 1)
        is still to write full pages of the shared prompt: admitted after, ``r`` hits them."""
        if r.group is None or not r.prefix_cache:
            return False
        full = r.prompt_len // self.blocks.page_size * self.blocks.page_size
        return any(
            o.group == r.group and o.state is RequestState.PREFILLING and o.num_cached < full for o in self.running
        )

    def _chunk(self, r: Request, budget: int) -> PrefillChunk:
        assert r.slot is not None
        length = min(self.chunk_size, r.prefill_len - r.num_cached, budget)
        return PrefillChunk(request=r, slot=r.slot, start=r.num_cached, length=length)

    def _set_pages(self, r: Request, added: list[int]) -> None:
        if added:
            assert r.slot is not None
            n = len(self.blocks.page_table(r))
            self.page_tables[r.slot, n - len(added) : n] = added

    def _preempt(self, victim: Request) -> None:
        """Return ``victim``'s pages and row; it waits at the head of the queue, to be prefilled
        again from position 0 over its prompt and the ids it generated."""
        self._release(victim)
        victim.state = RequestState.WAITING
        victim.num_cached = 0
        victim.last_token_from = None
        victim.preemptions += 1
        self.resuming.appendleft(victim)
        self.preemptions += 1

    def _release(self, r: Request) -> None:
        self.blocks.free(r)
        self._committed.pop(r, None)
        assert r.slot is not None
        self.slots[r.slot] = None
        r.slot = None
        self.running.remove(r)

    def _reap_cancelled(self) -> None:
        for queue in (self.waiting, self.resuming):
            for r in [r for r in queue if r.cancelled or r.state is RequestState.FINISHED]:
                queue.remove(r)
                r.finish(FinishReason.CANCELLED)  # no-op for one already finished
        for r in self.running:
            if r.cancelled:
                r.finish(FinishReason.CANCELLED)
        self.release_finished()

    # ---- after dispatch ---------------------------------------------------------------------
    def commit(self, plan: RaggedPlan) -> None:
        """Register the full pages the plan's dispatched writes completed in the prefix cache
        (call after the loop advanced ``num_cached``). Only ids known on the host count: a
        decoding sequence's newest ids may still be on the device, and are registered a step
        later."""
        ps = self.blocks.page_size
        for r in (*(c.request for c in plan.prefills), *plan.decode):
            if r.slot is None or not r.prefix_cache:
                continue
            known = min(r.num_cached, r.prefill_len)
            if known // ps > self._committed.get(r, 0):
                self.blocks.commit_full_pages(r, r.prefill_ids(0, known))
                self._committed[r] = known // ps

    # ---- bookkeeping ------------------------------------------------------------------------
    def free_slot(self) -> int | None:
        return next((i for i, r in enumerate(self.slots) if r is None), None)

    def release_finished(self) -> None:
        """Return the pages and rows of finished requests; drop finished ones that wait to resume."""
        for r in [r for r in self.running if r.state is RequestState.FINISHED]:
            self._release(r)
        for r in [r for r in self.resuming if r.state is RequestState.FINISHED]:
            self.resuming.remove(r)

    @property
    def active_slots(self) -> int:
        return len(self.running)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting) + len(self.resuming)

    def all_requests(self) -> list[Request]:
        return list(self.running) + list(self.resuming) + list(self.waiting)
