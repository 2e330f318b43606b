"""The scheduler: which decode tokens and prefill chunks each step runs, under a token budget,
with admission by pages, prefix hits and preemption; and the one owner of request state.

Plain Python and no JAX, so it is testable without a model. A step is ``schedule()`` (choose,
reserve pages, and advance each chosen request by what the step will compute: cached tokens,
sampled ids, prefill -> decode) and, once the step's ids are on the host,
``postprocess(plan, host)`` (hand each sampled id to its request, which checks EOS, stop strings
and ``max_tokens``; register full pages in the prefix cache; free finished requests). Nothing
else changes a request. Policy, as vLLM's V1 scheduler
(Kwon et al. 2023, §4.5; the token budget of Sarathi, Agrawal et al. 2023):

* each step first gives every decoding sequence its one token, oldest first; a sequence whose
  next token needs a page when none is free or evictable preempts the newest running sequence
  (its pages go back at once, it waits at the head of the queue and is recomputed later: its
  prompt and the ids it already streamed are prefilled again, so the client sees nothing of
  it), or, when it is the newest itself, is preempted;
* then prompts fill ``max_num_batched_tokens`` (decode tokens have their own region): the
  chunks of prompts already being prefilled, then new requests in arrival order (preempted ones
  first), each chunk at most ``chunk_size`` tokens, while a row is free and the block manager
  can hold the whole prompt; admission never preempts, and a replica that preempted in a step
  admits nothing in it. The sequences of one request with n > 1 (``Request.group``) are
  admitted one first, the rest once its prompt's full pages are in the prefix cache: they then
  share them (later requests are admitted past them meanwhile). A prompt's cached prefix
  (``BlockManager.allocate``'s match) is skipped: only the rest is prefilled;
* a cancelled request is finished and its pages returned at the next step; a finished one's
  when its step is postprocessed.

Pipelining: the engine loop schedules and dispatches step N + 1 before step N's ids reach the
host. A decode token whose input id step N sampled records it (``DecodeToken.fed_by``), and the
batch reads that id on the device; ``schedule`` counts a dispatched id as sampled at once
(``Request.sampled``), so ``max_tokens`` and ``min_tokens`` hold for ids not yet on the host.

Rows: a running sequence holds one of ``num_slots`` rows of the step's per-sequence arrays
(page table, sampling parameters, token history) from admission until it finishes or is
preempted. ``page_tables`` [num_slots, max_pages] is kept here, row by row, as pages are
allocated and added.

Speculative decoding (a ``proposer``, ``service.engine.ngram``): after the step's tokens are
chosen, each decoding sequence whose ids are all on the host proposes up to k draft ids, oldest
first, while its replica's step samples fewer than ``verify_tokens`` positions
(``service.engine.config.verify_tokens``: 1 + k, at least 8; so from 8 sequences decoding in a
replica on, none speculates: verifying would cost the batch more compute than it saves) and
pages are free (drafts never preempt); they ride after its decode token, each position sampling
the id that follows it (``DecodeToken.draft``). ``postprocess`` keeps the longest run of drafts
equal to the ids the target sampled, plus the target's id after it (``accepted_run``), and gives
back the rejected positions and their pages. A draft is deterministic, so sampling the target
at every position and keeping the drafts it reproduces is Leviathan et al.'s (2023, §2.3)
rejection rule with q a point mass: the id kept at each position is distributed as the target's
(seeded draws depend only on seed and position, so a seeded request's ids are those it samples
without speculation). A row with penalties samples each position under its history up to it
(``Runner``; a row whose drafts were rejected has its history written again,
``StepPlan.reinstalled``); a row with a constraint proposes only the drafts its grammar allows,
and each of its positions samples under the grammar's mask after the drafts before it
(``service.engine.constraint.TokenMasks``). A sequence whose
proposal finds nothing or has nothing accepted waits 1, 3, 7, ... (at most ``MAX_DRAFT_WAIT``)
decode steps before it proposes again, so a stream that never matches keeps the pipelined loop
(``wants_landed``).

Data replicas (a layout's ``data`` axis, ``Runner.replicas``): each replica serves rows
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
from collections.abc import Iterable

import numpy as np

from service.engine.block_manager import BlockManager, OutOfPages
from service.engine.config import verify_tokens
from service.engine.ngram import Proposer
from service.engine.output import MASKED_LOGPROB, HostStep
from service.engine.request import FinishReason, Request, RequestState, TokenLogprob


class QueueFull(Exception):
    """The waiting queue is at capacity (maps to RESOURCE_EXHAUSTED)."""


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """Write tokens [start, start + length) of ``request``'s prompt (followed by the ids it
    already generated, when it is recomputed) into its pages, from row ``slot``.

    ``is_last``: the chunk ends the prefill (``Request.prefill_len``), so its last token samples
    the next id; ``ban_eos``: that id may not be an EOS id (``min_tokens`` not reached). Both
    fixed when the chunk is made."""

    request: Request
    slot: int
    start: int
    length: int
    is_last: bool = False
    ban_eos: bool = False


@dataclasses.dataclass(frozen=True)
class DecodeToken:
    """One token of a decoding ``request`` at ``position`` (its newest id, whose key and value
    this step writes), from row ``slot``. ``fed_by``: the step that sampled that id (the batch
    reads it on the device when that step's ids are not on the host yet); ``ban_eos``: the id
    it samples may not be an EOS id; ``draft``: the draft ids proposed to follow it, at
    positions ``position`` + 1 .., each verified by the id sampled before it."""

    request: Request
    slot: int
    position: int
    fed_by: int | None
    ban_eos: bool = False
    draft: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What step number ``step`` runs: one token for each of ``decode``, then ``prefills``'
    chunks. ``admitted``: the requests whose first chunk since admission is in ``prefills``
    (their row's sampling parameters and token history are installed with the step);
    ``reinstalled``: decoding requests with penalties whose drafts were rejected, their token
    history written whole again (the step before counted those drafts)."""

    step: int
    prefills: tuple[PrefillChunk, ...] = ()
    decode: tuple[DecodeToken, ...] = ()
    admitted: frozenset[Request] = frozenset()
    reinstalled: frozenset[Request] = frozenset()

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decode

    @property
    def num_tokens(self) -> int:
        """Real tokens: decode tokens, their draft ids and chunk tokens."""
        return len(self.decode) + self.drafted + sum(c.length for c in self.prefills)

    @property
    def drafted(self) -> int:
        """Draft ids the step verifies."""
        return sum(len(d.draft) for d in self.decode)

    @property
    def samplers(self) -> tuple[tuple[Request, int], ...]:
        """(request, row) of every token that samples an id: each decode token, each last chunk."""
        return tuple((d.request, d.slot) for d in self.decode) + tuple(
            (c.request, c.slot) for c in self.prefills if c.is_last
        )


MAX_DRAFT_WAIT = 15  # decode steps a sequence waits at most between proposals after misses


def accepted_run(draft: tuple[int, ...], sampled: list[int]) -> list[int]:
    """The ids a verified draft yields: ``sampled[j]`` is the target's id at the position after
    the decode token's + j (j = 0 .. len(draft)), so draft[j] stands while it equals
    ``sampled[j]``; the first id that differs (or, all standing, the last) is the target's own.
    Returns the kept drafts and that id: 1 .. len(draft) + 1 ids."""
    out = []
    for j, proposed in enumerate(draft):
        out.append(sampled[j])
        if sampled[j] != proposed:
            return out
    out.append(sampled[len(draft)])
    return out


def bans_eos(request: Request) -> bool:
    """Whether the next id ``request`` samples may not be an EOS id: it has sampled fewer than
    ``min_tokens`` ids and does not ignore EOS (an ignored EOS id is an ordinary output id, so
    nothing needs banning)."""
    return not request.ignore_eos and request.sampled < request.min_tokens


def token_logprob(host: HostStep, row: int, top_n: int | None) -> TokenLogprob | None:
    """Row ``row``'s log-probability record with ``top_n`` alternatives (None when not asked;
    fewer where a token mask allowed fewer ids: masked ones are no alternative)."""
    if top_n is None:
        return None
    top = tuple(
        (int(host.top_ids[row, i]), float(host.top_logprobs[row, i]))
        for i in range(top_n)
        if host.top_logprobs[row, i] > MASKED_LOGPROB
    )
    return TokenLogprob(token_id=int(host.ids[row]), logprob=float(host.logprob[row]), top=top)


class Scheduler:
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
        proposer: proposes draft ids for speculative decoding (None: none are), at most
            ``proposer.k`` per sequence and step, and none past a replica's ``verify_tokens``
            sampled positions.

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
        proposer: Proposer | None = None,
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
        self._steps = 0  # steps scheduled so far: the next plan's number
        self.proposer = proposer
        self.max_draft_wait = MAX_DRAFT_WAIT  # 0: a sequence proposes at every step whatever it missed
        # Speculative decoding's totals (metrics): draft ids verified and accepted, steps that
        # verified any, and how many proposals kept 0, 1, .. k drafts.
        self.drafts_proposed = self.drafts_accepted = self.draft_steps = 0
        self.accepted_lengths = [0] * (proposer.k + 1 if proposer else 1)
        self._reinstall: set[Request] = set()  # penalized rows whose rejected drafts were counted
        self._verifying: set[int] = set()  # steps with draft ids, dispatched and not yet postprocessed

    def _set_pools(self, pools: list[BlockManager]) -> None:
        if not pools or self.num_slots % len(pools) or len({b.page_size for b in pools}) != 1:
            raise ValueError(f"{len(pools)} block managers for {self.num_slots} rows: one per replica, one page size")
        self.pools = pools
        self.rows_per_replica = self.num_slots // len(pools)
        self.page_size = pools[0].page_size
        self.max_pages = -(-self.max_seq_len // self.page_size)

    @property
    def verify_tokens(self) -> int:
        """The sampled positions speculating sequences' drafts fill a replica's step up to (0: no
        proposer); ``Geometry.decode_capacity`` holds them."""
        return verify_tokens(self.proposer.k) if self.proposer else 0

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
    def schedule(self) -> StepPlan:
        """Reap cancelled requests, then choose the next step's decode tokens and prefill chunks,
        reserving their pages (preempting where decode tokens need pages), and advance each
        chosen request by what the step computes: its cached tokens, and for a token that
        samples its sampled count (a last chunk also moves it to DECODING)."""
        self._reap_cancelled()
        self._preempted_in = set()
        step = self._steps
        self._steps += 1
        decode = [self._decode_token(r, step) for r in self._decode_requests()]
        # Decode tokens ride in a region of their own (one position per row); prefill chunks
        # share each replica's budget in whole aligned units (each chunk is charged whole units).
        align = self.chunk_align
        budgets = [max(align, self.max_num_batched_tokens // align * align)] * len(self.pools)
        chunks: list[PrefillChunk] = []
        for r in list(self.running):
            replica = self.replica_of(r)
            if r.state is RequestState.PREFILLING and budgets[replica] > 0:
                chunks.append(self._chunk(r, budgets[replica], step))
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
            chunks.append(self._chunk(new, budgets[replica], step))
            budgets[replica] -= -(-chunks[-1].length // align) * align
        reinstalled = frozenset(r for r in self._reinstall if r.slot is not None and r not in admitted)
        self._reinstall.clear()
        if self.proposer is not None:
            decode = self._with_drafts(decode, chunks)
            if any(t.draft for t in decode):
                self._verifying.add(step)
        return StepPlan(
            step=step, prefills=tuple(chunks), decode=tuple(decode), admitted=frozenset(admitted),
            reinstalled=reinstalled,
        )  # fmt: skip

    def _speculates(self, r: Request) -> bool:
        """Whether ``r`` may propose draft ids: the engine speculates, ``r`` opts in and decodes,
        and its constraint, if any, can go on (not complete, not at a dead end)."""
        c = r.constraint
        return (
            self.proposer is not None
            and r.speculative
            and r.state is RequestState.DECODING
            and (c is None or not (c.complete or c.at_dead_end))
        )

    def wants_landed(self) -> bool:
        """Whether the next ``schedule`` should see every dispatched id on the host first: a step
        that verifies draft ids is in flight, or a decoding sequence will propose draft ids
        (which start from its newest id), in a replica with room for them."""
        if self.proposer is None:
            return False
        if self._verifying:
            # A sequence's next token follows the ids its verification keeps: only then is its
            # position known (the rejected drafts' are given back).
            return True
        decoding = [0] * len(self.pools)
        for r in self.running:
            decoding[self.replica_of(r)] += r.state is RequestState.DECODING
        return any(
            self._speculates(r) and r.draft_wait == 0 and decoding[self.replica_of(r)] < self.verify_tokens - 1
            for r in self.running
        )

    def _with_drafts(self, decode: list[DecodeToken], chunks: list[PrefillChunk]) -> list[DecodeToken]:
        """``decode`` with draft ids proposed for the sequences that speculate, oldest first,
        while their replica's decode region has room (one proposal round for all of them:
        ``Proposer.propose_batch``, or one sequence at a time where the proposer is not
        ``batched``, so that a short proposal leaves its room to the next); each draft's positions
        are reserved (a sequence without free pages for them keeps none) and counted as sampled."""
        assert self.proposer is not None
        room = [self.verify_tokens] * len(self.pools)  # sampled positions left for drafts in each replica
        for t in decode:
            room[t.slot // self.rows_per_replica] -= 1
        for c in chunks:
            room[c.slot // self.rows_per_replica] -= c.is_last
        wants: dict[int, int] = {}  # index in ``decode`` -> most ids its sequence may propose
        proposals: dict[int, list[int] | None] = {}
        for i, t in enumerate(decode):
            r, replica = t.request, t.slot // self.rows_per_replica
            landed = r.sampled == len(r.output_ids) + 1  # every id but this token's own is on the host
            if not self._speculates(r) or r.draft_wait > 0 or not landed or t.ban_eos or room[replica] <= 0:
                r.draft_wait = max(0, r.draft_wait - 1)
                continue
            k = min(self.proposer.k, room[replica], r.max_tokens - r.sampled)
            if k > 0:  # else its last id: nothing may follow it
                wants[i] = k
                if self.proposer.batched:
                    room[replica] -= k  # proposed below, all at once
                else:  # proposed now: what it did not use is left for the next sequence
                    proposals[i] = self.proposer.propose_batch([(r, k)])[0]
                    room[replica] -= len(proposals[i] or ())
        if not wants:
            return decode
        if self.proposer.batched:
            proposals = dict(
                zip(wants, self.proposer.propose_batch([(decode[i].request, k) for i, k in wants.items()]), strict=True)
            )
        out = list(decode)
        for i, k in wants.items():
            t, proposal = decode[i], proposals[i]
            if proposal is None:  # not ready (a draft model catching up): no miss
                continue
            r, draft = t.request, tuple(proposal[:k])
            if r.constraint is not None and draft:
                # Only the drafts its grammar allows (each would be rejected under its mask),
                # checked without advancing it: the masks of their positions are filled with it.
                assert r.constraint.taken == len(r.output_ids)
                draft = draft[: r.constraint.matcher.validate_tokens(list(draft))]
            if not draft:
                self._missed(r)
                continue
            try:
                added = self._blocks(r).grow(r, len(draft))
            except OutOfPages:
                continue
            self._set_pages(r, added)
            r.num_cached += len(draft)
            r.sampled += len(draft)
            out[i] = dataclasses.replace(t, draft=draft)
        return out

    def _missed(self, r: Request) -> None:
        """``r``'s proposal found nothing or had nothing accepted: it waits longer each time."""
        r.draft_misses += 1
        r.draft_wait = min(self.max_draft_wait, 2**r.draft_misses - 1)

    def _decode_token(self, r: Request, step: int) -> DecodeToken:
        assert r.slot is not None
        token = DecodeToken(request=r, slot=r.slot, position=r.num_cached, fed_by=r.sampled_by, ban_eos=bans_eos(r))
        r.num_cached += 1
        r.sampled += 1
        r.sampled_by = step
        return token

    def _decode_requests(self) -> list[Request]:
        """The running sequences that decode in this step, each with a page for its token."""
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
        if r.preemptions == 0:  # a recomputation's hits are not the prompt's
            r.cached_tokens = min(alloc.num_cached_tokens, r.prompt_len)
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
        """Whether ``r`` is held back because a running sequence of its group (the same
        request's n > 1) has not yet registered the shared prompt's full pages in the prefix
        cache (``postprocess``): admitted after, ``r`` hits them."""
        if r.group is None or not r.prefix_cache:
            return False
        full_pages = r.prompt_len // self.page_size
        return any(o.group == r.group and self._committed.get(o, 0) < full_pages for o in self.running)

    def _chunk(self, r: Request, budget: int, step: int) -> PrefillChunk:
        assert r.slot is not None
        length = min(self.chunk_size, r.prefill_len - r.num_cached, budget)
        last = r.num_cached + length == r.prefill_len
        chunk = PrefillChunk(
            request=r, slot=r.slot, start=r.num_cached, length=length, is_last=last, ban_eos=last and bans_eos(r)
        )
        r.num_cached += length
        if last:
            r.state = RequestState.DECODING
            r.sampled += 1
            r.sampled_by = step
        return chunk

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
        victim.sampled_by = None
        victim.preemptions += 1
        self.resuming.appendleft(victim)
        self.preemptions += 1

    def _release(self, r: Request) -> None:
        self._blocks(r).free(r)
        if self.proposer is not None:
            self.proposer.forget(r)
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

    # ---- after the step ---------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, host: HostStep) -> None:
        """Step ``plan``'s ids are on the host (``host``, one row per row): hand each sampled id
        to its request (``Request.accept_token``: EOS, stop strings, ``max_tokens``, the streamed
        chunk), register the full pages whose ids are known in the prefix cache, and free the
        requests that finished. A request preempted after the step was dispatched still takes
        its id (it is part of its output, and its recomputation starts from it); requests that
        ended meanwhile are skipped."""
        drafted = {d.request: d.draft for d in plan.decode if d.draft}
        for r, row in plan.samplers:
            if r in drafted:
                self._verify(r, row, drafted[r], host)
            elif r.state is not RequestState.FINISHED:
                r.accept_token(int(host.ids[row]), token_logprob(host, row, r.logprobs))
        if drafted:
            self.draft_steps += 1
        self._verifying.discard(plan.step)
        self._commit(r for r in (*(c.request for c in plan.prefills), *(d.request for d in plan.decode)))
        self.release_finished()

    def _verify(self, r: Request, row: int, draft: tuple[int, ...], host: HostStep) -> None:
        """Hand ``r`` the ids its verified ``draft`` yields (``accepted_run``), until one ends it,
        and give back the positions of the rejected drafts: their pages, and their count in
        ``num_cached`` and ``sampled`` (their keys and values, past ``num_cached``, are written
        over before any step reads them)."""
        slots = host.slots_of(row)
        assert len(slots) == len(draft) + 1, (len(slots), draft)
        kept = accepted_run(draft, [int(host.ids[i]) for i in slots])
        for i, token in zip(slots, kept, strict=False):
            if r.state is RequestState.FINISHED:
                break
            r.accept_token(token, token_logprob(host, int(i), r.logprobs))
        accepted = len(kept) - 1
        rejected = len(draft) - accepted
        r.draft_proposed += len(draft)
        r.draft_accepted += accepted
        self.drafts_proposed += len(draft)
        self.drafts_accepted += accepted
        self.accepted_lengths[accepted] += 1
        if accepted:
            r.draft_misses = 0
        else:
            self._missed(r)
        r.num_cached -= rejected
        r.sampled -= rejected
        if r.slot is not None and r.state is not RequestState.FINISHED:
            self._blocks(r).shrink(r, r.num_cached)
            if rejected and r.sampling.penalized:
                self._reinstall.add(r)

    def advance_grammars(self, plan: StepPlan, host: HostStep) -> None:
        """Advance the constrained requests' grammars over step ``plan``'s ids (``host``) ahead of
        its ``postprocess`` (``Request.take_ahead``), so the next step's masks can be filled
        before the rest of this step's bookkeeping."""
        drafted = {d.request: d.draft for d in plan.decode if d.draft}
        for r, row in plan.samplers:
            if r.constraint is not None and r.state is not RequestState.FINISHED:
                ids = [int(host.ids[row])]
                if r in drafted:  # the ids its verification keeps
                    ids = accepted_run(drafted[r], [int(host.ids[i]) for i in host.slots_of(row)])
                for ahead, token in enumerate(ids):
                    if not r.take_ahead(token, ahead):
                        break

    def _commit(self, requests: Iterable[Request]) -> None:
        """Register in the prefix cache the full pages of ``requests`` whose ids are known on the
        host (a later step may still be writing their keys: it runs before any step that could
        read them)."""
        ps = self.page_size
        for r in requests:
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
