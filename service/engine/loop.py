"""The engine loop: one thread that runs the engine's step, step after step:

    plan = scheduler.schedule()                          # choose; reserve pages; advance requests
    batch = build(plan, runner.geometry, page tables)    # the flat batch and the rows to install
    out = runner.step(batch, previous output)            # dispatch (asynchronous)
    scheduler.postprocess(previous plan, previous ids)   # while it runs: ids, finishes, frees

Step N + 1 is dispatched before step N's ids reach the host, so the device never waits for the
host's bookkeeping; a decode token fed by step N reads its id on the device. A step that samples
for a constrained request (``Request.constraint``) is the exception: its token mask needs the
ids step N sampled, so step N's ids are landed, the grammars advanced over them and the masks
filled (``service.engine.constraint.TokenMasks``) before step N + 1 is dispatched; the rest of
step N's postprocessing still runs while step N + 1 does. Speculative decoding is the other:
a sequence proposes draft ids from its newest id, so while one will propose
(``Scheduler.wants_landed``) step N is postprocessed before step N + 1 is scheduled.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from service.engine.batch import build
from service.engine.block_manager import BlockManager
from service.engine.constraint import ConstrainedRow, TokenMasks
from service.engine.ngram import NgramProposer, Proposer
from service.engine.output import HostStep, StepOutput
from service.engine.request import Request, RequestState
from service.engine.runner import Runner
from service.engine.scheduler import QueueFull, Scheduler, StepPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Dispatched:
    """A step launched but not yet postprocessed: its plan, its device output, when it started,
    and its ids once on the host."""

    plan: StepPlan
    out: StepOutput
    started: float
    host: HostStep | None = None


class EngineUnavailable(Exception):
    """The engine loop is not running (not started, stopped, or died)."""


class EngineLoop:
    """Drives one ``Runner`` with one ``Scheduler`` on a background thread.

    Requests arrive through ``submit`` (any thread); chunks leave through each request's
    ``emit`` callback (called on the loop thread). ``heartbeat`` is the monotonic time of the
    loop's last completed iteration, for stall detection by the health checker.

    Args:
        runner: the runner (its compiled steps are only ever called from the loop thread).
        scheduler: rows, queue and pages.
        on_step: optional hook called after each step with (plan, seconds), for metrics.

    ``on_host`` (optional, for metrics) is called after each iteration that brought sampled ids
    to the host with (seconds, ids): the loop thread's own time in that iteration (schedule,
    build, dispatch, postprocess: handing ids to requests, detokenizing, emitting), not the
    time it waited for the device, and the number of ids. Per token, that is what the host adds
    to the device's step when it cannot hide it behind the step it dispatched.
    """

    def __init__(
        self,
        runner: Runner,
        scheduler: Scheduler,
        on_step: Callable[[StepPlan, float], None] | None = None,
    ):
        self.runner = runner
        self.scheduler = scheduler
        self.on_step = on_step
        self.on_host: Callable[[float, int], None] | None = None
        self._waited = 0.0  # this iteration's seconds blocked on the device (``_finish_inflight``)
        self._sampled = 0  # ids this iteration brought to the host
        # Requests submitted and not yet handed to the scheduler (append and popleft are atomic;
        # ``_waiting_for_a_slot`` reads a copy to leave out the cancelled ones).
        self._inbox: deque[Request] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set when warm-up compilation is done
        self.error: BaseException | None = None
        self.heartbeat = time.monotonic()
        self.steps = 0
        self._pending = 0  # requests in the inbox, counted against the queue bound
        self._lock = threading.Lock()
        # A pending switch: the new runner, or a function of the old one that builds it here.
        self._switch: tuple[Runner | Callable[[Runner], Runner], threading.Event] | None = None
        self._switch_error: BaseException | None = None  # what the last build function raised
        self._inflight: Dispatched | None = None  # dispatched, not yet postprocessed
        self.masks: TokenMasks | None = None  # built with the first constrained request (read by benchmarks)
        # Test hook (fault injection), None in production: called with the plan at the top of
        # every step on the loop thread; raising kills the loop, blocking simulates a stall.
        self.step_hook: Callable[[StepPlan], None] | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, warmup_full: bool = False) -> None:
        """Start the loop thread; it compiles (warm-up) first, then sets ``ready``."""
        self._thread = threading.Thread(target=self._run, args=(warmup_full,), name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop thread (in-flight requests are failed)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- admission -----------------------------------------------------------------------------
    def queue_full(self) -> str | None:
        """Why ``submit`` would raise QueueFull now (None when there is room): a cheap, advisory
        check before a request is tokenized; ``submit`` checks again under the lock. The bound
        counts new requests (``scheduler.waiting``), not preempted ones waiting to resume."""
        waiting = self._waiting_for_a_slot()
        if waiting >= self.scheduler.max_queue:
            return f"queue full: {waiting} requests waiting (max {self.scheduler.max_queue})"
        return None

    def _waiting_for_a_slot(self) -> int:
        """New requests (queued, or on their way from the inbox) less the slots free for them
        now: those about to take a free slot do not wait (a burst into an idle server was
        refused while slots were free). Requests already cancelled do not count: they leave the
        queue only at the next step, which can be seconds away (a burst of clients that gave up
        had a fresh request refused with nobody waiting). Preempted sequences resuming
        (``queue_depth`` beyond ``waiting``) take free slots first. Read without the loop's lock:
        advisory, off by at most the requests one step admits."""
        s = self.scheduler
        free = max(0, s.num_slots - s.active_slots - (s.queue_depth - len(s.waiting)))
        # list() of a deque runs in C under the GIL: a consistent copy while the engine thread mutates it.
        cancelled = sum(r.cancelled for r in list(s.waiting)) + sum(r.cancelled for r in list(self._inbox))
        return max(0, len(s.waiting) + self._pending - cancelled - free)

    def submit(self, request: Request) -> None:
        """Queue a request (thread-safe).

        Raises:
            EngineUnavailable: the loop is not running.
            QueueFull: the waiting queue is at capacity.
        """
        if not self.alive or self._stop.is_set():
            raise EngineUnavailable("the engine loop is not running")
        with self._lock:
            waiting = self._waiting_for_a_slot()
            if waiting >= self.scheduler.max_queue:
                raise QueueFull(f"queue full: {waiting} requests waiting (max {self.scheduler.max_queue})")
            self._pending += 1
        self._inbox.append(request)
        self._wake.set()

    # ---- live layout switch --------------------------------------------------------------------
    def switch_runner(self, new_runner: Runner | Callable[[Runner], Runner], timeout_s: float = 600.0) -> None:
        """Swap in ``new_runner`` (built and warmed by the caller) between two steps: the live KV
        pool and row state move to it and every stream continues. Blocks until done.

        ``new_runner`` may instead be a function of the old runner that builds and warms the new
        one: the loop thread then calls it between two steps (the streams pause meanwhile), as a
        job over several processes needs (every JAX call of the switch in the steps' order).

        Raises:
            EngineUnavailable: the loop is not running or did not reach a step boundary in time.
            Whatever the build function raises (the old runner then stays).
        """
        done = threading.Event()
        with self._lock:
            self._switch = (new_runner, done)
            self._switch_error = None
        self._wake.set()
        if not done.wait(timeout_s):
            with self._lock:
                self._switch = None
            raise EngineUnavailable("the engine loop did not apply the layout switch in time")
        if self._switch_error is not None:
            raise self._switch_error

    def _apply_switch(self) -> None:
        with self._lock:
            pending, self._switch = self._switch, None
        if pending is None:
            return
        new_runner, done = pending
        t0 = time.perf_counter()
        self._finish_inflight()  # the old runner's last step must land before its pool moves
        if callable(new_runner):  # a runner is not callable: a build function
            try:
                new_runner = new_runner(self.runner)
            except Exception as exc:  # the old runner serves on
                self._switch_error = exc
                done.set()
                return
        if new_runner.replicas != self.runner.replicas:
            # Each replica's pool is another range of pages: recompute every sequence over the new pools.
            self.scheduler.repartition(block_managers(new_runner))
        new_runner.adopt_state(self.runner)
        self.runner.abandon_compiles()
        self.runner = new_runner
        log.info("layout switched to %s in %.2f s", new_runner.layout.name, time.perf_counter() - t0)
        done.set()

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self, warmup_full: bool) -> None:
        """schedule -> dispatch step N -> postprocess step N-1 (while step N runs) -> repeat."""
        try:
            self.runner.warmup(full=warmup_full)
            if self.scheduler.proposer is not None:
                self.scheduler.proposer.warmup(full=warmup_full)
            self.heartbeat = time.monotonic()
            self.ready.set()
            while not self._stop.is_set():
                self._apply_switch()
                t0, self._waited, self._sampled = time.perf_counter(), 0.0, 0
                self._drain_inbox()
                if self._inflight is not None and self.scheduler.wants_landed():
                    self._finish_inflight()  # drafts start from the ids in flight
                plan = self.scheduler.schedule()
                if not plan.empty:
                    self.step(plan)
                elif self._inflight is not None:
                    self._finish_inflight()  # its results may free rows or end requests
                else:
                    self.heartbeat = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                if self._sampled and self.on_host is not None:
                    self.on_host(time.perf_counter() - t0 - self._waited, self._sampled)
            self._finish_inflight()
        except BaseException as exc:
            log.exception("engine loop died")
            self.error = exc
        finally:
            self.runner.abandon_compiles()
            if self.scheduler.proposer is not None:
                self.scheduler.proposer.close()
            message = f"engine stopped: {self.error!r}" if self.error else "server shutting down"
            self._drain_inbox()
            for r in self.scheduler.all_requests():
                r.fail(message)
            self.scheduler.release_finished()
            self.scheduler.waiting.clear()

    def step(self, plan: StepPlan) -> None:
        """Dispatch ``plan``'s step, then postprocess the step before it while this one runs."""
        if self.step_hook is not None:
            self.step_hook(plan)
        prev = self._inflight
        batch = build(plan, self.runner.geometry, self.scheduler.page_tables, prev.plan.step if prev else None)
        if any(r.constraint is not None for r, _ in plan.samplers):
            # Their grammars take the ids in flight before their masks are filled; the rest of
            # that step's bookkeeping waits until this step is dispatched.
            if prev is not None:
                self.scheduler.advance_grammars(prev.plan, self._land(prev))
            if self.masks is None:
                self.masks = TokenMasks(self.runner.cfg.vocab_size)
            slot_rows, _ = self.runner.geometry.samplers(batch)
            drafts = {t.request: t.draft for t in plan.decode}
            rows = [
                ConstrainedRow(
                    row, int(np.flatnonzero(slot_rows == row)[0]), r.constraint, r.eos_ids, drafts.get(r, ())
                )
                for r, row in plan.samplers
                if r.constraint is not None and r.state is not RequestState.FINISHED
            ]
            mask, ban = self.masks.fill(rows, len(slot_rows), batch.ban_eos)
            batch = dataclasses.replace(batch, token_mask=mask, ban_eos=ban)
        out = self.runner.step(batch, prev.out if prev else None)
        self._finish_inflight()
        self._inflight = Dispatched(plan, out, time.perf_counter())

    def _land(self, step: Dispatched) -> HostStep:
        """``step``'s ids on the host (blocks until it is done; copied once)."""
        if step.host is None:
            t0 = time.perf_counter()
            step.host = step.out.host()
            self._waited += time.perf_counter() - t0
        return step.host

    def _finish_inflight(self) -> None:
        """Postprocess the dispatched step, if any (blocks until its ids are on the host)."""
        if self._inflight is None:
            return
        step, self._inflight = self._inflight, None
        host = self._land(step)
        accepted = self.scheduler.drafts_accepted
        self.scheduler.postprocess(step.plan, host)
        self._sampled += len(step.plan.samplers) + self.scheduler.drafts_accepted - accepted
        self.steps += 1
        self.heartbeat = time.monotonic()
        if self.on_step is not None:
            self.on_step(step.plan, time.perf_counter() - step.started)

    def _drain_inbox(self) -> None:
        while True:
            try:
                request = self._inbox.popleft()
            except IndexError:
                return
            with self._lock:
                self._pending -= 1
                self.scheduler.add(request, reserved=True)  # the bound was checked in submit()


def block_managers(runner: Runner) -> list[BlockManager]:
    """One ``BlockManager`` for each of the runner's data replicas, over its own pages."""
    return [BlockManager(runner.pages_per_replica, runner.ecfg.page_size) for _ in range(runner.replicas)]


def make_loop(
    runner: Runner,
    max_queue: int,
    on_step: Callable[[StepPlan, float], None] | None = None,
    proposer: Proposer | None = None,
) -> EngineLoop:
    """The loop that drives ``runner``, over a ``Scheduler`` of its rows with a ``BlockManager``
    for each of its data replicas; speculating with ``proposer``, or by default as
    ``runner.ecfg.speculative`` says.

    Raises:
        ValueError: ``proposer`` given where the runner does not speculate or proposes more ids
            than its ``speculative_tokens``; or ``speculative`` names a draft model and no
            ``proposer`` is given (its runner
            is built by the caller: ``service.server.startup.draft_runners``).
    """
    ecfg = runner.ecfg
    if proposer is not None and (ecfg.speculative == "off" or proposer.k > ecfg.speculative_tokens):
        # The runner's decode buckets hold verify_tokens(ecfg.speculative_tokens) tokens, no more.
        raise ValueError(
            f"a proposer of {proposer.k} ids for a runner speculating {ecfg.speculative!r} with at most "
            f"{ecfg.speculative_tokens}"
        )
    if proposer is None and ecfg.speculative == "ngram":
        proposer = NgramProposer(ecfg.speculative_tokens, ecfg.ngram_max, ecfg.ngram_min)
    if proposer is None and ecfg.draft_model:
        raise ValueError(f"speculative {ecfg.speculative!r}: pass its DraftModelProposer")
    scheduler = Scheduler(
        ecfg.num_slots, max_queue, ecfg.chunk_size, ecfg.max_num_batched_tokens, block_managers(runner),
        ecfg.max_seq_len, chunk_align=runner.geometry.seq_block, proposer=proposer,
    )  # fmt: skip
    return EngineLoop(runner, scheduler, on_step=on_step)
