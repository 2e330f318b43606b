"""A draft model: draft ids for speculative decoding from a smaller model with the target's
tokenizer (Leviathan et al. 2023; Chen et al. 2023; llama.cpp's ``-md``, vLLM's draft-model
proposer).

The draft model has a ``Runner`` of its own on the target's devices, with its own page pool: one
``BlockManager`` per data replica of it, and a page table per row. A speculating sequence uses
the draft runner's row of its own number (``Request.slot``). Each round of proposals
(``propose_batch``), for all the sequences that speculate in the step at once:

1. **Roll back and catch up.** The pool holds a sequence's ids up to where they still equal the
   target's (the ids it wrote there are kept beside it, so the drafts the target rejected go:
   ``BlockManager.shrink``). The ids after that, all on the host (the bonus id after an accepted
   run, or the whole prompt on a sequence's first round), are written; a long catch-up by one
   step of chunks that sample nothing a round (the target's other streams wait for no more),
   the sequence proposing nothing until it is caught up.
2. **Draft.** The step that writes a sequence's last ids samples its first draft id; up to k - 1
   more steps each run its newest draft id, read on the device from the step before
   (``source`` 1), and sample the next; with ``p_min``, a sequence stops after a draft its model
   gives less probability. Every row samples greedily (temperature 0; with ``p_min`` the rows
   also return their ids' log-probabilities), so each draft is the draft model's argmax: a point mass, which the target's
   verifier (``service.engine.scheduler.accepted_run``) keeps exactly where it equals the
   target's own draw. The output distribution stays the target's whatever the draft model is.
3. The drafts reach the host: each step's before the next where a confidence cut stops a
   sequence's drafting early (``p_min``), else all in one copy.

Drafts at positions the target later rejects stay in the pool until the next round rolls them
back; a sequence that leaves its row (finished, preempted) gives its pages back (``forget``).
No prefix cache: each sequence writes its own prompt once, so sequences that share a prefix in
the target's pool need more of the draft's, where a sequence without pages drafts nothing.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from service.engine.batch import Geometry, RaggedBatch, RowInstall
from service.engine.block_manager import BlockManager, OutOfPages
from service.engine.config import EngineConfig
from service.engine.output import StepOutput
from service.engine.request import Request, SamplingOptions
from service.engine.runner import Runner


@dataclasses.dataclass
class _Written:
    """What the draft pool holds for a sequence: the ids at positions 0 .. len(ids) - 1 (the
    first ``checked`` known to be the sequence's own; the rest drafts not yet verified), from
    row ``row``."""

    row: int
    ids: list[int]
    checked: int = 0


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Tokens of one row in a draft step: ``ids`` at positions ``start`` ..; ``from_prev``: one
    token, the id the step before sampled for the row (on the device); ``samples``: its last
    token's next id is a draft."""

    row: int
    start: int
    ids: tuple[int, ...] = ()
    from_prev: bool = False
    samples: bool = True

    @property
    def length(self) -> int:
        return 1 if self.from_prev else len(self.ids)


def draft_engine_config(target: EngineConfig) -> EngineConfig:
    """The draft runner's settings from the target runner's (``Runner.ecfg``, its pool size
    resolved): the same rows, sizes, dtypes, kernels and speculative settings (so its decode
    buckets hold the catch-up and drafts of the sequences a target step verifies), and a pool of
    the target's tokens plus k and a page per row, at most every row's longest sequence: a
    sequence holds its ids and k - 1 drafts there, so the draft pool has room whenever the
    target's does without shared prefixes (both split over the same data replicas)."""
    ps, k, S = target.page_size, target.speculative_tokens, target.num_slots
    per_row = -(-(target.max_seq_len + k) // ps) * ps
    tokens = (
        min(S * per_row, target.kv_cache_tokens + S * (-(-k // ps) + 1) * ps) if target.kv_cache_tokens else S * per_row
    )
    return dataclasses.replace(target, kv_cache_tokens=tokens, kv_cache_memory=0)


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


class DraftModelProposer:
    """Proposes up to ``k`` ids per sequence with a draft model's greedy steps.

    Args:
        runner: the draft model's runner (its rows as many as the target's, its pool sized for
            every row's longest sequence plus k: ``draft_engine_config``).
        k: most ids proposed per sequence and round, >= 1.
        p_min: a sequence's drafting stops after a draft whose probability under the draft model
            is below this (llama.cpp's ``--draft-p-min``): the ids after an unsure one are
            mostly rejected, and each costs a draft step. 0: always k drafts, chained on the
            device without a look at the host between steps. In [0, 1).

    Not thread-safe: the engine loop's thread calls it (through ``Scheduler.schedule``).
    """

    name = "draft"  # the proposer's label in the metrics
    batched = True  # one round of draft steps for all of a step's sequences

    def __init__(self, runner: Runner, k: int, p_min: float = 0.0):
        if k < 1 or not 0.0 <= p_min < 1.0:
            raise ValueError(f"need k >= 1 and 0 <= p_min < 1, got {k} and {p_min}")
        self.runner, self.k, self.p_min = runner, k, p_min
        g = runner.geometry
        self.pools = [BlockManager(runner.pages_per_replica, runner.ecfg.page_size) for _ in range(runner.replicas)]
        self.page_tables = np.zeros((g.num_slots, g.max_pages), np.int32)
        self._written: dict[Request, _Written] = {}
        self.steps = 0  # draft-model steps run (catch-up and drafting)
        self._rows_installed = False  # the rows' sampling parameters (``_step``)
        self.rounds = 0  # rounds of proposals that ran the draft model
        self.seconds = 0.0  # wall time of those rounds, drafts on the host (the engine loop waits for it)

    def warmup(self, full: bool = False) -> float:
        """Compile the draft runner's programs (``Runner.warmup``). Returns the seconds spent."""
        return self.runner.warmup(full=full)

    def close(self) -> None:
        """Compile nothing more in the background (the engine stops)."""
        self.runner.abandon_compiles()

    def _pool(self, row: int) -> BlockManager:
        return self.pools[self.runner.geometry.replica_of(row)]

    def forget(self, request: Request) -> None:
        """``request`` left its row (finished, cancelled, preempted): its pages go back."""
        written = self._written.pop(request, None)
        if written is not None:
            self._pool(written.row).free(request)

    # ---- a round ----------------------------------------------------------------------------
    def propose_batch(self, wants: list[tuple[Request, int]]) -> list[list[int] | None]:
        """Up to ``k`` draft ids for each (request, k) of ``wants``: running requests whose ids
        are all on the host, each in its own row. A request whose pages do not fit the draft
        pool gets [] (so does one with k < 1); one whose catch-up is longer than a round runs
        (a first round's prompt: one prefill step's budget a round, so that the target's other
        streams wait for no more than one such step) gets None, and drafts once caught up."""
        rounds: list[tuple[Request, _Written, list[int], int]] = []  # (request, pool state, ids, k)
        for r, k in wants:
            assert r.slot is not None
            ids = r.prompt_ids + r.output_ids
            if k >= 1 and self._reserve(r, ids, k):
                rounds.append((r, self._written[r], ids, k))
        out: dict[Request, list[int] | None] = {}
        if rounds:
            t0 = time.perf_counter()
            drafts = self._draft([(w, ids, k) for _, w, ids, k in rounds])
            self.rounds += 1
            self.seconds += time.perf_counter() - t0
            for (r, w, ids, _), draft in zip(rounds, drafts, strict=True):
                if isinstance(draft, int):  # caught up to there, not drafting yet
                    w.ids, w.checked, out[r] = ids[:draft], draft, None
                    continue
                w.ids = ids + draft[:-1]  # the drafts the pool holds: all but the last
                w.checked = len(ids)
                out[r] = draft
        return [out.get(r, []) for r, _ in wants]

    def _reserve(self, r: Request, ids: list[int], k: int) -> bool:
        """Roll ``r``'s pool back to the ids it still shares with ``ids`` (at least one id left
        to run, which samples the first draft) and reserve positions up to its k - 1 drafts'.
        False: no pages (nothing reserved)."""
        assert r.slot is not None
        w = self._written.get(r)
        if w is not None and w.row != r.slot:  # not expected: ``forget`` runs when a row is left
            self.forget(r)
            w = None
        pool = self._pool(r.slot)
        need = len(ids) + k - 1
        try:
            if w is None:
                pool.allocate(r, range(need), use_prefix_cache=False)  # type: ignore[arg-type]
                w = self._written[r] = _Written(row=r.slot, ids=[])
            else:
                valid = w.checked + common_prefix(w.ids[w.checked :], ids[w.checked :])
                valid = min(valid, len(ids) - 1)
                pool.shrink(r, valid)
                del w.ids[valid:]
                w.checked = min(w.checked, valid)
                pool.grow(r, need - valid)
        except OutOfPages:
            return False
        table = pool.page_table(r)
        self.page_tables[r.slot, : len(table)] = table
        return True

    def _draft(self, rounds: list[tuple[_Written, list[int], int]]) -> list[list[int] | int]:
        """Run the draft steps of ``rounds`` (pool state, the sequence's ids, k), each reserved:
        a catch-up chunk step, then up to k greedy steps. Returns each round's draft ids (up to
        k), or, for a row still catching up, the ids its pool now holds."""
        g = self.runner.geometry
        start = {w.row: len(w.ids) for w, _, _ in rounds}  # the first id each row's pool lacks
        # Long catch-ups (a first round: the whole prompt) go ahead by a step of chunks that
        # samples nothing; a row left with at most 2 ids drafts now (its first drafting step runs
        # them), one with more goes on next round.
        budget = [g.prefill_buckets[-1]] * g.replicas
        chunks = []
        for w, ids, _ in rounds:
            left, replica = len(ids) - start[w.row], g.replica_of(w.row)
            length = min(left - 1, self.runner.ecfg.chunk_size, budget[replica])
            if left > 2 and length > 0:
                chunks.append(
                    _Segment(w.row, start[w.row], tuple(ids[start[w.row] : start[w.row] + length]), samples=False)
                )
                start[w.row] += length
                budget[replica] -= g.padded(length)
        if chunks:
            self._step(chunks, None)
        behind = {w.row for w, ids, _ in rounds if len(ids) - start[w.row] > 2}
        drafting = [(w, ids, k) for w, ids, k in rounds if w.row not in behind]
        drafted = (
            dict(zip((w.row for w, _, _ in drafting), self._greedy(drafting, start), strict=True)) if drafting else {}
        )
        return [start[w.row] if w.row in behind else drafted[w.row] for w, _, _ in rounds]

    def _greedy(self, rounds: list[tuple[_Written, list[int], int]], start: dict[int, int]) -> list[list[int]]:
        """The drafting steps of ``rounds`` (pool state, ids, k), each row's pool holding its ids
        up to ``start[row]`` (at most 2 short): up to k draft ids each."""
        first = [_Segment(w.row, start[w.row], tuple(ids[start[w.row] :])) for w, ids, _ in rounds]
        outs = [self._step(first, None)]
        drafts: dict[int, list[int]] = {w.row: [] for w, _, _ in rounds}
        going = {w.row: k for w, _, k in rounds}  # rows still drafting -> their k
        for j in range(1, max(k for _, _, k in rounds) + 1):
            if self.p_min > 0:  # each step's drafts on the host: who goes on
                packed = np.asarray(outs[-1].packed)
                for row in list(going):
                    drafts[row].append(int(packed[row, 0]))
                    if going[row] == j or np.exp(packed[row, 1]) < self.p_min:
                        del going[row]
            else:
                going = {row: k for row, k in going.items() if k > j}
            if not going or j == max(k for _, _, k in rounds):
                break
            chained = [
                _Segment(row, len(ids) + j - 1, from_prev=True) for w, ids, _ in rounds if (row := w.row) in going
            ]
            outs.append(self._step(chained, outs[-1]))
        if self.p_min == 0:  # every step's drafts in one copy
            ids_by_step = [np.asarray(a)[:, 0].astype(np.int64) for a in jax.device_get([o.packed for o in outs])]
            return [[int(ids_by_step[j][w.row]) for j in range(k)] for w, _, k in rounds]
        return [drafts[w.row] for w, _, _ in rounds]

    def _step(self, segments: list[_Segment], prev: StepOutput | None) -> StepOutput:
        self.steps += 1
        batch = draft_batch(self.runner.geometry, self.page_tables, segments)
        if self.p_min > 0 and not self._rows_installed:
            # Every row greedy, with the log-probability of its draft (``pack_step``'s column 1).
            installs = tuple(
                RowInstall(row=i, sampling=SamplingOptions(temperature=0.0), logprobs=True, eos_ids=())
                for i in range(self.runner.geometry.num_slots)
            )
            batch = dataclasses.replace(batch, installs=installs)
            self._rows_installed = True
        return self.runner.step(batch, prev)


def draft_batch(geometry: Geometry, page_tables: np.ndarray, segments: list[_Segment]) -> RaggedBatch:
    """The draft runner's flat batch of ``segments`` (``service.engine.batch``'s layout): a
    segment of at most 2 tokens rides in its replica's decode region while it has room, a longer
    one (or one that finds no room) is a chunk of the prefill region. Nothing is ``generated``
    (the draft rows have no penalties) and no row bans EOS.

    Raises:
        ValueError: a region does not fit the largest bucket.
    """
    g = geometry
    d = g.replicas
    decode_of, padded_of = [0] * d, [0] * d
    in_decode = []
    for s in segments:
        replica = g.replica_of(s.row)
        fits = s.from_prev or (s.length <= 2 and decode_of[replica] + s.length <= g.decode_capacity)
        in_decode.append(fits)
        if fits:
            decode_of[replica] += s.length
        else:
            padded_of[replica] += g.padded(s.length)
    D = g.decode_bucket(max(max(decode_of), 1), mixed=any(padded_of))
    batch = g.empty_batch(D, g.prefill_bucket(max(padded_of)))
    n = len(batch.tokens) // d
    decode_at = [replica * n for replica in range(d)]
    prefill_at = [replica * n + D for replica in range(d)]
    for s, fits in zip(segments, in_decode, strict=True):
        replica = g.replica_of(s.row)
        if fits:
            i = decode_at[replica]
            decode_at[replica] += s.length
        else:
            i = prefill_at[replica]
            prefill_at[replica] += g.padded(s.length)
        if s.from_prev:
            batch.source[i] = 1
        else:
            batch.tokens[i : i + s.length] = s.ids
        batch.positions[i : i + s.length] = np.arange(s.start, s.start + s.length, dtype=np.int32)
        batch.rows[i : i + s.length] = s.row
        if s.samples:
            batch.last_index[s.row] = i + s.length - 1
    return dataclasses.replace(
        batch,
        page_tables=page_tables.copy(),
        num_real=sum(s.length for s in segments),
        max_position=int(batch.positions.max()),
    )
