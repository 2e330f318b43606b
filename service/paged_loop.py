"""The engine loop over a paged engine: each iteration dispatches one ragged step (decode tokens
and prefill chunks of several prompts) and postprocesses the previous one while it runs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service.block_manager import BlockManager
from service.engine import Engine, StepOutput
from service.loop import EngineLoop, bans_eos, token_logprob
from service.paged_engine import PagedEngine
from service.paged_scheduler import PagedScheduler, RaggedPlan
from service.request import Request, RequestState
from service.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class DispatchedRaggedStep:
    """A ragged step launched but not yet on the host: ``samplers`` are the (request, row)
    pairs whose sampled id it returns (row = the request's row when the step was built)."""

    plan: RaggedPlan
    out: StepOutput
    samplers: tuple[tuple[Request, int], ...]
    started: float


class PagedEngineLoop(EngineLoop):
    """``EngineLoop`` driving a ``PagedEngine`` with a ``PagedScheduler`` (same lifecycle,
    admission, layout switch and pipelining; one program per step instead of two)."""

    # Narrowed from the base's Engine and Scheduler, whose methods this class overrides.
    engine: PagedEngine  # type: ignore[assignment]
    scheduler: PagedScheduler  # type: ignore[assignment]

    def dispatch(self, plan: RaggedPlan) -> DispatchedRaggedStep:  # type: ignore[override]
        """Build the flat batch (``RaggedBatch``: the decode tokens, then each chunk from a block
        boundary of the prefill region), launch it, and advance the host
        bookkeeping that does not wait for results (cached lengths, states, sampled counts),
        then register completed pages in the prefix cache.

        A decode token whose id the still-running previous step sampled reads it on the device
        (``RaggedBatch.source``); a request's EOS ids are banned while it has sampled fewer than
        ``min_tokens`` (``bans_eos``). An admitted request's row gets its sampling parameters,
        and, when it uses penalties, its token history.
        """
        if self.step_hook is not None:
            self.step_hook(plan)  # type: ignore[arg-type]
        engine, sched = self.engine, self.scheduler
        prev = self._inflight
        number = self._dispatched
        self._dispatched += 1
        block, d = engine.seq_block, engine.replicas
        # Each replica's region holds its own rows' tokens: size the regions by the busiest.
        decode_of, padded_of = [0] * d, [0] * d
        for r in plan.decode:
            decode_of[sched.replica_of(r)] += 1
        for c in plan.prefills:
            padded_of[sched.replica_of(c.request)] += -(-c.length // block) * block
        D = engine.decode_bucket(max(decode_of))
        batch = engine.empty_batch(D, engine.prefill_bucket(max(padded_of)))
        n = len(batch.tokens) // d
        tokens, positions, rows, source = batch.tokens, batch.positions, batch.rows, batch.source
        generated, last_index, ban = batch.generated, batch.last_index, batch.ban_eos
        at = [replica * n for replica in range(d)]  # the next free decode position of each region
        samplers: list[tuple[Request, int]] = []
        for r in plan.decode:
            slot = r.slot
            assert slot is not None
            j = sched.replica_of(r)
            i, at[j] = at[j], at[j] + 1
            positions[i], rows[i], generated[i] = r.num_cached, slot, True
            if prev is not None and r.last_token_from == ("step", number - 1):
                source[i] = 1
            else:
                tokens[i] = r.output_ids[-1]
            last_index[slot], ban[slot] = i, bans_eos(r)
            samplers.append((r, slot))
            r.num_cached += 1
            r.sampled += 1
            r.last_token_from = ("step", number)
        at = [replica * n + D for replica in range(d)]  # each region's next chunk start
        prefill_max = -1
        for chunk in plan.prefills:
            r, slot, k = chunk.request, chunk.slot, chunk.length
            if r in plan.admitted:
                engine.set_sampling(slot, r.sampling, logprobs=r.logprobs is not None, eos_ids=r.eos_ids)
                o = r.sampling
                if o.presence_penalty or o.frequency_penalty or o.repetition_penalty != 1:
                    engine.set_history(slot, r.prompt_ids, r.output_ids)
            j = sched.replica_of(r)
            i, at[j] = at[j], at[j] + -(-k // block) * block
            tokens[i : i + k] = r.prefill_ids(chunk.start, k)
            positions[i : i + k] = np.arange(chunk.start, chunk.start + k, dtype=np.int32)
            rows[i : i + k] = slot
            prefill_max = max(prefill_max, chunk.start + k - 1)
            r.num_cached += k
            if chunk.is_last:
                last_index[slot], ban[slot] = i + k - 1, bans_eos(r)
                samplers.append((r, slot))
                r.state = RequestState.DECODING
                r.sampled += 1
                r.last_token_from = ("step", number)
        batch = dataclasses.replace(
            batch,
            page_tables=sched.page_tables.copy(),
            num_real=plan.num_tokens,
            max_position=int(positions.max()),
            prefill_max_position=prefill_max,
        )
        out = engine.step(batch, prev.out if prev is not None else None)  # type: ignore[attr-defined]
        sched.commit(plan)
        return DispatchedRaggedStep(plan, out, tuple(samplers), time.perf_counter())

    def postprocess(self, step: DispatchedRaggedStep) -> None:  # type: ignore[override]
        """Bring the step's ids to the host (one copy) and hand each to its request. A request
        preempted after this step was dispatched still takes its id (it is part of its output,
        and its recomputation starts from it); requests that ended meanwhile are skipped."""
        host = step.out.host()
        for r, row in step.samplers:
            if r.state is not RequestState.FINISHED:
                r.accept_token(int(host.ids[row]), token_logprob(host, row, r.logprobs))
        self.scheduler.release_finished()

    def adopt_engine(self, new_engine: PagedEngine) -> None:  # type: ignore[override]
        """Take over from the old engine (``EngineLoop.adopt_engine``); with another number of
        data replicas, the scheduler first recomputes every sequence over the new pools
        (``PagedScheduler.repartition``): the old pages are another replica's range."""
        if new_engine.replicas != self.engine.replicas:
            self.scheduler.repartition(block_managers(new_engine))
        super().adopt_engine(new_engine)  # type: ignore[arg-type]


def block_managers(engine: PagedEngine) -> list[BlockManager]:
    """One ``BlockManager`` for each of the engine's data replicas, over its own pages."""
    return [BlockManager(engine.pages_per_replica, engine.ecfg.page_size) for _ in range(engine.replicas)]


def engine_loop(
    engine: Engine | PagedEngine, max_queue: int, on_step: Callable[[Any, float], None] | None = None
) -> EngineLoop:
    """The loop that drives ``engine``: an ``EngineLoop`` over a slots ``Scheduler``, or a
    ``PagedEngineLoop`` over a ``PagedScheduler`` with a ``BlockManager`` for each of the
    engine's data replicas."""
    ecfg = engine.ecfg
    if isinstance(engine, PagedEngine):
        sched = PagedScheduler(
            ecfg.num_slots, max_queue, ecfg.chunk_size, ecfg.max_num_batched_tokens, block_managers(engine),
            ecfg.max_seq_len, chunk_align=engine.seq_block,
        )  # fmt: skip
        return PagedEngineLoop(engine, sched, on_step=on_step)  # type: ignore[arg-type]
    return EngineLoop(engine, Scheduler(ecfg.num_slots, max_queue, ecfg.chunk_size), on_step=on_step)
