"""One step's inputs on the host (``RaggedBatch``), built from the scheduler's plan by ``build``:
the flat batch of tokens, the rows' page tables and the per-row state the step installs. The
batch carries everything the runner needs for the step, so the runner keeps no request state
and a job over several processes mirrors the step alone.

The flat batch (``Geometry``) is one region of n = D + P tokens for each of the engine's data
replicas (N = replicas x n). A region's decode region [0, D) holds its replica's decode tokens
(each attends on its own), then padding, D a decode bucket; its prefill region [D, n) holds
prefill chunks, each starting at a multiple of ``seq_block`` from D and padded to whole blocks,
P a prefill bucket, so that attention may read a sequence's keys once per block. Region r holds
only tokens of replica r's rows, whose page tables number the pages of replica r's pool.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from model.attention.base import power_of_two_buckets
from service.engine.request import SamplingOptions
from service.engine.scheduler import StepPlan

SEQ_BLOCK = 64  # tokens per block of the prefill region (one read of a sequence's keys each)
MIN_DECODE = 8  # the smallest decode region beside a prefill region (all rows when there are fewer)
MIN_WINDOW = 128  # tokens: the smallest attention window a windowed backend compiles


@dataclasses.dataclass(frozen=True)
class RowInstall:
    """A request's per-row state, installed in row ``row`` with the first step after its
    admission: its sampling parameters, whether it wants log-probabilities, its EOS ids, and,
    when it uses penalties, its token history (the prompt's ids and the ids it already
    generated, which a preempted request brings back)."""

    row: int
    sampling: SamplingOptions
    logprobs: bool
    eos_ids: tuple[int, ...]
    history: tuple[tuple[int, ...], tuple[int, ...]] | None = None


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """One step's inputs, laid out as the module docstring says.

    Attributes:
        tokens: [N] int32 input ids (those with ``source`` 1 are read on the device).
        positions: [N] int32, each token's position in its sequence; -1 for padding.
        rows: [N] int32, each token's row (its sequence); -1 for padding.
        source: [N] int32: 0 the id is ``tokens``'s, 1 it is the id the previous step sampled
            for the token's row (still on the device).
        generated: [N] bool, the token is a decode token (its id is a generated one, counted
            in the row's history for the penalties).
        last_index: [S] int32, for each row the index in [0, N) of the token whose logits it
            samples from, within its replica's region (that region's first index for rows that
            sample nothing).
        ban_eos: [S] bool, the row's sampled id may not be one of its EOS ids.
        page_tables: [S, max_pages] int32, each row's pages in order, numbered within its
            replica's pool.
        num_real: real tokens (the rest are padding).
        max_position: the largest position of a real token (-1: none).
        decode_tokens: D, each region's decode region's length.
        installs: rows whose state the step installs first (``RowInstall``).
        window_pages: the attention window the step runs with, in pages; 0: the smallest
            window bucket covering ``max_position`` (``Geometry.window``). A wider one is set
            where the step runs in a larger compiled program (``Geometry.widen``).
        token_mask: [d R, W] int32, the packed token mask (``model.sampling.apply_token_mask``;
            ``service.engine.constraint.TokenMasks`` fills it) of each sampling slot, in
            ``Geometry.samplers``' order (a speculating row's slots each the mask after the drafts
            before it), or None: no row is constrained.
        drafted: [N] bool, the token is followed in its row by a draft id (speculative decoding:
            a decode token or a draft id before the row's last token), so it samples too, to
            verify that draft; or None: no row speculates. A speculating row's tokens are
            consecutive in the decode region, its ``last_index`` the last of them.
    """

    tokens: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    source: np.ndarray
    generated: np.ndarray
    last_index: np.ndarray
    ban_eos: np.ndarray
    page_tables: np.ndarray
    num_real: int
    max_position: int
    decode_tokens: int
    installs: tuple[RowInstall, ...] = ()
    window_pages: int = 0
    token_mask: np.ndarray | None = None
    drafted: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The shapes one engine's steps take: S rows over ``replicas`` data replicas, pages of
    ``page_size`` positions, up to ``max_pages`` per sequence, the buckets of each region and of
    the attention window (the backend's: ``AttentionBackend.window_buckets``).

    Programs = decode x prefill x window buckets; the decode region is a power of two up to the
    rows of a replica or its ``verify_tokens`` (speculative decoding's), from 1 in a decode-only step and from ``MIN_DECODE`` beside prefill
    chunks (``decode_bucket``: every padding row costs a decode step about what a real one
    does, so a single stream of a 64-row server paid for 8); the prefill region 0 tokens or a power of two
    times ``seq_block`` up to ``max_num_batched_tokens`` (rounded up to a block), or up to one
    chunk (at most ``max_seq_len`` tokens) per row where that is less.
    """

    num_slots: int
    replicas: int
    page_size: int
    max_pages: int
    seq_block: int
    decode_buckets: tuple[int, ...]
    prefill_buckets: tuple[int, ...]
    window_buckets: tuple[int, ...]
    verify_tokens: int = 0

    @classmethod
    def make(
        cls,
        num_slots: int,
        replicas: int,
        page_size: int,
        max_seq_len: int,
        chunk_size: int,
        max_num_batched_tokens: int,
        window_buckets: list[int],
        verify_tokens: int = 0,
    ) -> Geometry:
        """The geometry of an engine of these sizes; ``window_buckets``: the attention backend's
        (``AttentionBackend.window_buckets``); ``verify_tokens``: the tokens a replica's decode
        region holds while sequences speculate (``EngineConfig.verify_tokens``; 0: none)."""
        max_pages = -(-max_seq_len // page_size)
        seq_block = min(SEQ_BLOCK, chunk_size)  # a chunk pads to a whole block: no bigger than a chunk

        def blocks_of(n: int) -> int:
            return -(-n // seq_block) * seq_block

        rows = num_slots // replicas
        # No chunk is longer than a sequence may be: a server of short sequences compiles no
        # prefill region it could never fill.
        region = min(blocks_of(max_num_batched_tokens), rows * blocks_of(min(chunk_size, max_seq_len)))
        return cls(
            num_slots=num_slots,
            replicas=replicas,
            page_size=page_size,
            max_pages=max_pages,
            seq_block=seq_block,
            decode_buckets=tuple(power_of_two_buckets(1, max(rows, verify_tokens))),
            prefill_buckets=(0, *power_of_two_buckets(seq_block, region)),
            window_buckets=tuple(window_buckets),
            verify_tokens=verify_tokens,
        )

    @property
    def rows_per_replica(self) -> int:
        return self.num_slots // self.replicas

    @property
    def decode_capacity(self) -> int:
        """The most tokens of one replica's decode region, and the most ids it samples in a step:
        one per row, or ``verify_tokens`` while sequences speculate."""
        return max(self.rows_per_replica, self.verify_tokens)

    def replica_of(self, row: int) -> int:
        """The data replica serving ``row`` (rows [r S/d, (r + 1) S/d) are replica r's)."""
        return row // self.rows_per_replica

    @property
    def mixed_decode_buckets(self) -> tuple[int, ...]:
        """The decode buckets of steps with a prefill region: from ``MIN_DECODE`` (fewer
        programs; the chunks' tokens cost more than a few padding rows there)."""
        return tuple(b for b in self.decode_buckets if b >= min(MIN_DECODE, self.rows_per_replica))

    def decode_bucket(self, num_tokens: int, mixed: bool = False) -> int:
        """The decode region's length for ``num_tokens`` decode tokens (<= ``decode_capacity``), in
        a step with a prefill region when ``mixed``."""
        return pick_bucket(num_tokens, self.mixed_decode_buckets if mixed else self.decode_buckets)

    def prefill_bucket(self, num_tokens: int) -> int:
        """The prefill region's length for ``num_tokens`` (chunks already padded to blocks)."""
        return pick_bucket(num_tokens, self.prefill_buckets)

    def sample_slots(self, decode_tokens: int, prefill_tokens: int) -> int:
        """R: the most ids one replica samples in a step of these regions (one per decode
        token, one per chunk, each chunk at least a block), and no more than its
        ``decode_capacity``. The step computes logits for R slots per replica, not for every
        row: a single stream on a server of 64 rows made the LM head and the sampler run 64
        rows each step."""
        return min(self.decode_capacity, decode_tokens + prefill_tokens // self.seq_block)

    def samplers(self, batch: RaggedBatch) -> tuple[np.ndarray, np.ndarray]:
        """The batch's sampling tokens in ``sample_slots`` slots per replica: (rows [d R] int32,
        -1 for an empty slot; the index in [0, N) of each slot's token, an empty slot its
        region's first). Row s samples when the token at ``last_index[s]`` is its own (a row
        that samples nothing points at its region's first token, a decode slot no prefilling
        row holds), and so does every ``drafted`` token. A replica's slots are in the order of
        their tokens, so a speculating row's are consecutive, in position order.

        Raises:
            ValueError: more tokens sample in a replica than its slots.
        """
        d = self.replicas
        n = len(batch.tokens) // d
        R = self.sample_slots(batch.decode_tokens, n - batch.decode_tokens)
        rows = np.full(d * R, -1, np.int32)
        index = np.repeat(np.arange(d, dtype=np.int32) * n, R)
        sampling = np.flatnonzero(batch.rows[batch.last_index] == np.arange(self.num_slots))
        tokens = batch.last_index[sampling]
        if batch.drafted is not None:
            tokens = np.union1d(tokens, np.flatnonzero(batch.drafted))
        tokens = np.sort(tokens)
        for r in range(d):
            mine = tokens[tokens // n == r]
            if len(mine) > R:
                raise ValueError(f"{len(mine)} tokens of replica {r} sample, in a step of {R} sampling slots")
            rows[r * R : r * R + len(mine)] = batch.rows[mine]
            index[r * R : r * R + len(mine)] = mine
        return rows, index

    def window(self, max_position: int) -> int:
        """The window bucket covering positions up to ``max_position`` (-1: none)."""
        return pick_bucket(max(max_position, 0) // self.page_size + 1, self.window_buckets)

    def padded(self, length: int) -> int:
        """A chunk of ``length`` tokens padded to whole blocks."""
        return -(-length // self.seq_block) * self.seq_block

    def widen(self, batch: RaggedBatch, decode_tokens: int, prefill_tokens: int, window_pages: int) -> RaggedBatch:
        """``batch`` laid out in larger regions (``decode_tokens`` + ``prefill_tokens`` per
        replica, each at least ``batch``'s) and run over ``window_pages`` pages: the same tokens
        at the same offsets of each region's decode and prefill parts, more padding after each,
        ``last_index`` following its tokens. A step of it samples the same ids as ``batch``'s
        (padding attends to nothing and a wider window only adds masked pages): what a step
        runs while its own program compiles (``Runner.step``).

        Raises:
            ValueError: a region or the window smaller than ``batch``'s.
        """
        d = self.replicas
        D, n = batch.decode_tokens, len(batch.tokens) // d
        D2, n2 = decode_tokens, decode_tokens + prefill_tokens
        if D2 < D or prefill_tokens < n - D or window_pages < self.window(batch.max_position):
            raise ValueError(
                f"regions of {D2} + {prefill_tokens} tokens over {window_pages} pages do not hold a batch of "
                f"{D} + {n - D} tokens up to position {batch.max_position}"
            )
        wide = self.empty_batch(D2, prefill_tokens)
        old = np.arange(len(batch.tokens))
        # Each token's index in the wider layout: same region, same offset in its part.
        region, offset = old // n, old % n
        new = region * n2 + np.where(offset < D, offset, offset - D + D2)
        for name in ("tokens", "positions", "rows", "source", "generated"):
            getattr(wide, name)[new] = getattr(batch, name)
        drafted = None
        if batch.drafted is not None:
            drafted = np.zeros(len(wide.tokens), bool)
            drafted[new] = batch.drafted
        token_mask = None
        if batch.token_mask is not None:  # each replica's slots keep their order, in more slots
            R, R2 = self.sample_slots(D, n - D), self.sample_slots(D2, prefill_tokens)
            token_mask = np.full((d * R2, batch.token_mask.shape[1]), -1, np.int32)
            for r in range(d):
                token_mask[r * R2 : r * R2 + R] = batch.token_mask[r * R : (r + 1) * R]
        last = batch.last_index.astype(np.int64)
        last_index = (last // n * n2 + np.where(last % n < D, last % n, last % n - D + D2)).astype(np.int32)
        return dataclasses.replace(
            batch,
            tokens=wide.tokens,
            positions=wide.positions,
            rows=wide.rows,
            source=wide.source,
            generated=wide.generated,
            drafted=drafted,
            token_mask=token_mask,
            last_index=last_index,
            decode_tokens=D2,
            window_pages=window_pages,
        )

    def empty_batch(self, decode_tokens: int, prefill_tokens: int) -> RaggedBatch:
        """All padding: ``replicas`` regions of ``decode_tokens`` + ``prefill_tokens`` tokens,
        every row sampling from its region's first token, page tables all page 0."""
        S, n = self.num_slots, decode_tokens + prefill_tokens
        N = self.replicas * n
        return RaggedBatch(
            tokens=np.zeros(N, np.int32),
            positions=np.full(N, -1, np.int32),
            rows=np.full(N, -1, np.int32),
            source=np.zeros(N, np.int32),
            generated=np.zeros(N, bool),
            last_index=(np.arange(S, dtype=np.int32) // self.rows_per_replica * n).astype(np.int32),
            ban_eos=np.zeros(S, bool),
            page_tables=np.zeros((S, self.max_pages), np.int32),
            num_real=0,
            max_position=-1,
            decode_tokens=decode_tokens,
        )


def pick_bucket(n: int, buckets: tuple[int, ...] | list[int]) -> int:
    """The smallest bucket >= n.

    Raises:
        ValueError: n exceeds the largest.
    """
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def build(plan: StepPlan, geometry: Geometry, page_tables: np.ndarray, in_flight: int | None = None) -> RaggedBatch:
    """The flat batch of ``plan``: each replica's decode tokens, then each chunk from a block
    boundary of its prefill region; the rows' page tables (``page_tables``, the scheduler's,
    copied); each admitted request's ``RowInstall``.

    Args:
        plan: the scheduler's plan.
        geometry: the runner's shapes.
        page_tables: [S, max_pages] int32, the scheduler's.
        in_flight: the number of the dispatched step whose ids are not on the host yet (None:
            every sampled id is): a decode token fed by it reads its id on the device.

    Raises:
        ValueError: a region does not fit the largest bucket.
    """
    d, S_r = geometry.replicas, geometry.rows_per_replica
    decode_of, padded_of = [0] * d, [0] * d  # each replica's region holds its own rows' tokens
    for t in plan.decode:
        decode_of[t.slot // S_r] += 1 + len(t.draft)
    for c in plan.prefills:
        padded_of[c.slot // S_r] += geometry.padded(c.length)
    D = geometry.decode_bucket(max(decode_of), mixed=any(padded_of))
    batch = geometry.empty_batch(D, geometry.prefill_bucket(max(padded_of)))
    n = len(batch.tokens) // d
    tokens, positions, rows, source = batch.tokens, batch.positions, batch.rows, batch.source
    last_index, ban = batch.last_index, batch.ban_eos
    drafted = np.zeros(len(tokens), bool) if any(t.draft for t in plan.decode) else None
    at = [replica * n for replica in range(d)]  # the next free decode position of each region
    for t in plan.decode:
        j, k = t.slot // S_r, len(t.draft)
        i, at[j] = at[j], at[j] + 1 + k
        positions[i], rows[i], batch.generated[i] = t.position, t.slot, True
        if in_flight is not None and t.fed_by == in_flight:
            source[i] = 1
        else:
            tokens[i] = t.request.output_ids[-1]
        if k:  # the draft ids follow at the next positions; each token before the last verifies one
            assert drafted is not None
            tokens[i + 1 : i + 1 + k] = t.draft
            positions[i + 1 : i + 1 + k] = np.arange(t.position + 1, t.position + 1 + k, dtype=np.int32)
            rows[i + 1 : i + 1 + k], batch.generated[i + 1 : i + 1 + k] = t.slot, True
            drafted[i : i + k] = True
        last_index[t.slot], ban[t.slot] = i + k, t.ban_eos
    at = [replica * n + D for replica in range(d)]  # each region's next chunk start
    for c in plan.prefills:
        j = c.slot // S_r
        i, at[j] = at[j], at[j] + geometry.padded(c.length)
        tokens[i : i + c.length] = c.request.prefill_ids(c.start, c.length)
        positions[i : i + c.length] = np.arange(c.start, c.start + c.length, dtype=np.int32)
        rows[i : i + c.length] = c.slot
        if c.is_last:
            last_index[c.slot], ban[c.slot] = i + c.length - 1, c.ban_eos
    installs = tuple(
        RowInstall(
            row=r.slot,
            sampling=r.sampling,
            logprobs=r.logprobs is not None,
            eos_ids=tuple(sorted(r.eos_ids)),
            # A decoding row's newest id is this step's decode token, which the step counts.
            history=(tuple(r.prompt_ids), tuple(r.output_ids[: -1 if r in plan.reinstalled else None]))
            if r.sampling.penalized
            else None,
        )
        for r in sorted(plan.admitted | plan.reinstalled, key=lambda r: r.slot or 0)
        if r.slot is not None
    )
    return dataclasses.replace(
        batch,
        page_tables=page_tables.copy(),
        drafted=drafted,
        num_real=plan.num_tokens,
        max_position=int(positions.max()),
        installs=installs,
    )
