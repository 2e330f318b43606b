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
  prompt; admission never preempts, and a replica that preempted in a step admits nothing in
  it. The sequences of
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

Data replicas (a layout's ``data`` axis, ``PagedEngine.replicas``): each replica serves rows
[r S/d, (r + 1) S/d) from its own pool, one ``BlockManager`` each (page numbers are the
replica's own; prefixes are shared within a replica). Each replica has the whole token budget
for its own chunks (it runs them in its own region of the step, in parallel with the others).
A new request goes to a replica with a free row and budget left: the one with the longest cached
prefix of its prompt, then the one running fewest sequences (vLLM's data-parallel ranks each
have their own scheduler and cache; SGLang's router places requests by cached prefix). A
sequence that needs a page preempts the newest sequence of its own replica.
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
        blocks: the pool's pages: one ``BlockManager``, or one per data replica (all of the same
            page size; their number divides ``num_slots``).
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
        blocks: BlockManager | list[BlockManager],
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
        self.max_seq_len = max_seq_len
        self._set_pools(blocks if isinstance(blocks, list) else [blocks])
        self.page_tables = np.zeros((num_slots, self.max_pages), np.int32)
        self.waiting: deque[Request] = deque()
        self.resuming: deque[Request] = deque()  # preempted, recomputed before new requests
        self.slots: list[Request | None] = [None] * num_slots
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.prefills_started = 0
        self.preemptions = 0
        self._committed: dict[Request, int] = {}  # pages passed to commit_full_pages, per request
        self._retired_prefix_tokens = (0, 0)  # prefix_tokens() of pools replaced by repartition
        self._preempted_in: set[int] = set()  # replicas that preempted in this step

    def _set_pools(self, pools: list[BlockManager]) -> None:
        if not pools or self.num_slots % len(pools) or len({b.page_size for b in pools}) != 1:
            raise ValueError(f"{len(pools)} block managers for {self.num_slots} rows: one per replica, one page size")
        self.pools = pools
        self.rows_per_replica = self.num_slots // len(pools)
        self.page_size = pools[0].page_size
        self.max_pages = -(-self.max_seq_len // self.page_size)

    @property
    def blocks(self) -> BlockManager:
        """The block manager, with one data replica (with several: ``pools``)."""
        if len(self.pools) != 1:
            raise AttributeError(f"{len(self.pools)} data replicas: each has its own pool (PagedScheduler.pools)")
        return self.pools[0]

    def replica_of(self, r: Request) -> int:
        """The data replica of a running request's row."""
        assert r.slot is not None
        return r.slot // self.rows_per_replica

    def _blocks(self, r: Request) -> BlockManager:
        return self.pools[self.replica_of(r)]

    # ---- admission ------------------------------------------------------------------------
    def add(self, request: Request, reserved: bool = False) -> None:
        """Queue a request. Raises QueueFull when ``max_queue`` requests already wait, unless
        ``reserved``: the caller counted it against the bound already (``EngineLoop.submit``,
        which leaves out the requests the free slots will take)."""
        if not reserved and len(self.waiting) >= self.max_queue:
            raise QueueFull(f"queue full: {len(self.waiting)} requests waiting (max {self.max_queue})")
        self.waiting.append(request)

    # ---- the plan ---------------------------------------------------------------------------
    def schedule(self) -> RaggedPlan:
        """Reap cancelled requests, then choose this step's decode tokens and prefill chunks,
        reserving their pages (preempting where decode tokens need pages)."""
        self._reap_cancelled()
        self._preempted_in = set()
        decode = self._decode_tokens()
        # Decode tokens ride in a region of their own (one position per row); prefill chunks
        # share each replica's budget in whole aligned units (each chunk is charged whole units).
        align = self.chunk_align
        budgets = [max(align, self.max_num_batched_tokens // align * align)] * len(self.pools)
        chunks: list[PrefillChunk] = []
        for r in self.running:
            replica = self.replica_of(r)
            if r.state is RequestState.PREFILLING and budgets[replica] > 0:
                chunks.append(self._chunk(r, budgets[replica]))
                budgets[replica] -= -(-chunks[-1].length // align) * align
        admitted = []
        # No admission to a replica that had to preempt in this step: the pages just freed would
        # be taken back at once and the next step would preempt again (vLLM's scheduler holds
        # back likewise).
        for replica in self._preempted_in:
            budgets[replica] = 0
        while any(b > 0 for b in budgets):
            new = self._admit(budgets)
            if new is None:
                break
            replica = self.replica_of(new)
            admitted.append(new)
            chunks.append(self._chunk(new, budgets[replica]))
            budgets[replica] -= -(-chunks[-1].length // align) * align
        return RaggedPlan(prefills=tuple(chunks), decode=tuple(decode), admitted=frozenset(admitted))

    def _decode_tokens(self) -> list[Request]:
        decode: list[Request] = []
        for r in list(self.running):
            # Preempted by an older sequence earlier in this loop, or done once its ids land.
            if r.state is not RequestState.DECODING or r.slot is None or r.sampled >= r.max_tokens:
                continue
            while True:
                try:
                    added = self._blocks(r).grow(r, 1)
                    break
                except OutOfPages:
                    replica = self.replica_of(r)
                    # The newest of r's replica (r itself when it is): only its pages help.
                    self._preempt([o for o in self.running if self.replica_of(o) == replica][-1])
                    if r.slot is None:
                        break
            if r.slot is None:
                continue
            self._set_pages(r, added)
            decode.append(r)
        return decode

    def _admit(self, budgets: list[int]) -> Request | None:
        """Move the next preempted or waiting request into a free row of a replica with budget
        left (``budgets``, per replica), with pages for its whole prompt (the cached prefix
        shared); None when there is no row, no request or no room."""
        rows: dict[int, int] = {}
        for i in range(len(self.pools)):
            row = self.free_slot(i) if budgets[i] > 0 else None
            if row is not None:
                rows[i] = row
        queue = self.resuming if self.resuming else self.waiting
        if not rows or not queue:
            return None
        r = queue[0] if queue is self.resuming else next((w for w in queue if not self._waits_for_sibling(w)), None)
        if r is None:
            return None
        if r.sampled != len(r.output_ids):
            return None  # a preempted request's last id has not landed: its ids are not known yet
        ids = r.prompt_ids + r.output_ids
        for replica in self._placement(r, ids, list(rows)):
            try:
                alloc = self.pools[replica].allocate(r, ids, use_prefix_cache=r.prefix_cache)
                break
            except OutOfPages:
                continue
        else:
            return None
        free = rows[replica]
        queue.remove(r)
        r.slot = free
        r.state = RequestState.PREFILLING
        r.num_cached = alloc.num_cached_tokens
        self.slots[free] = r
        self.running.append(r)
        self.page_tables[free, : len(alloc.page_table)] = alloc.page_table
        self._committed[r] = alloc.num_cached_tokens // self.page_size
        self.prefills_started += 1
        return r

    def _placement(self, r: Request, ids: list[int], replicas: list[int]) -> list[int]:
        """``replicas`` in the order ``r`` tries them: the longest cached prefix of ``ids`` first
        (when ``r`` uses the prefix cache), then the fewest running sequences, then the lowest."""
        if len(replicas) == 1:
            return replicas
        running = [0] * len(self.pools)
        for o in self.running:
            running[self.replica_of(o)] += 1
        hit = {i: self.pools[i].match_prefix(ids).num_tokens if r.prefix_cache else 0 for i in replicas}
        return sorted(replicas, key=lambda i: (-hit[i], running[i], i))

    def _waits_for_sibling(self, r: Request) -> bool:
        """Whether ``r`` is held back because a sequence of its group (the same request's n > 1)
        is still to write full pages of the shared prompt: admitted after, ``r`` hits them."""
        if r.group is None or not r.prefix_cache:
            return False
        full = r.prompt_len // self.page_size * self.page_size
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
            n = len(self._blocks(r).page_table(r))
            self.page_tables[r.slot, n - len(added) : n] = added

    def _preempt(self, victim: Request) -> None:
        """Return ``victim``'s pages and row; it waits at the head of the queue, to be prefilled
        again from position 0 over its prompt and the ids it generated."""
        self._preempted_in.add(self.replica_of(victim))
        self._release(victim)
        victim.state = RequestState.WAITING
        victim.num_cached = 0
        victim.last_token_from = None
        victim.preemptions += 1
        self.resuming.appendleft(victim)
        self.preemptions += 1

    def _release(self, r: Request) -> None:
        self._blocks(r).free(r)
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
        ps = self.page_size
        for r in (*(c.request for c in plan.prefills), *plan.decode):
            if r.slot is None or not r.prefix_cache:
                continue
            known = min(r.num_cached, r.prefill_len)
            if known // ps > self._committed.get(r, 0):
                self._blocks(r).commit_full_pages(r, r.prefill_ids(0, known))
                self._committed[r] = known // ps

    # ---- bookkeeping ------------------------------------------------------------------------
    def free_slot(self, replica: int | None = None) -> int | None:
        """The lowest free row (of ``replica``'s rows, when given), or None."""
        rows = range(self.num_slots) if replica is None else range(
            replica * self.rows_per_replica, (replica + 1) * self.rows_per_replica
        )  # fmt: skip
        return next((i for i in rows if self.slots[i] is None), None)

    def repartition(self, pools: list[BlockManager]) -> None:
        """Serve from ``pools`` from now on (a live switch to a layout with another number of
        data replicas): every running sequence is preempted (newest first, so the oldest resumes
        first), its pages and the old pools' cached prefixes dropped; each is recomputed from
        its prompt and the ids it already streamed. A request that could not fit one new
        replica's pool even alone (prompt + max_tokens) fails with a message saying so, rather
        than waiting forever at the head of the queue. Call between steps, with every
        dispatched step's ids landed."""
        for r in reversed(list(self.running)):
            self._preempt(r)
        self._retired_prefix_tokens = self.prefix_tokens()  # the counters stay monotonic
        self.page_tables[:] = 0
        self._set_pools(pools)
        room = min(b.num_pages for b in pools) * self.page_size
        for queue in (self.resuming, self.waiting):
            for r in [r for r in queue if r.prompt_len + r.max_tokens > room]:
                queue.remove(r)
                r.fail(
                    f"the layout switch left each data replica a pool of {room} tokens, fewer than this "
                    f"request's {r.prompt_len} prompt + {r.max_tokens} max_tokens"
                )

    def page_counts(self) -> dict[str, int]:
        """Pages of all replicas' pools: ``used`` (held by a sequence), ``cached`` (held by no
        sequence, kept for the prefix cache, evictable), ``free`` (empty): the block managers'
        counts, summed."""
        return {
            "used": sum(b.num_used for b in self.pools),
            "cached": sum(b.num_cached for b in self.pools),
            "free": sum(b.num_free for b in self.pools),
        }

    @property
    def num_pages(self) -> int:
        return sum(b.num_pages for b in self.pools)

    def prefix_tokens(self) -> tuple[int, int]:
        """Prompt tokens looked up in the prefix cache and found there, over all replicas and
        every pool served since this scheduler started (totals: they never decrease)."""
        queried, hits = self._retired_prefix_tokens
        return queried + sum(b.queried_tokens for b in self.pools), hits + sum(b.hit_tokens for b in self.pools)

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
