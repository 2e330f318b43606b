"""The engine loop: one thread that runs schedule -> execute -> postprocess, step after step."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from service.engine import Engine, HostStep, StepOutput
from service.request import Request, RequestState, TokenLogprob
from service.scheduler import QueueFull, Scheduler, StepPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DispatchedStep:
    """A step whose programs are launched but whose results are not yet on the host."""

    plan: StepPlan
    prefill_out: StepOutput | None
    decode_out: StepOutput | None
    started: float  # perf_counter() at dispatch


def token_logprob(host: HostStep, row: int, top_n: int | None) -> TokenLogprob | None:
    """Row ``row``'s log-probability record with ``top_n`` alternatives (None when not asked)."""
    if top_n is None:
        return None
    top = tuple((int(host.top_ids[row, i]), float(host.top_logprobs[row, i])) for i in range(top_n))
    return TokenLogprob(token_id=int(host.ids[row]), logprob=float(host.logprob[row]), top=top)


def bans_eos(request: Request) -> bool:
    """Whether the id ``request``'s next dispatched step samples may not be an EOS id: it has
    sampled fewer than ``min_tokens`` ids and does not ignore EOS (an ignored EOS id is an
    ordinary output id, so nothing needs banning)."""
    return not request.ignore_eos and request.sampled < request.min_tokens


class EngineUnavailable(Exception):
    """The engine loop is not running (not started, stopped, or died)."""


class EngineLoop:
    """Drives one Engine with one Scheduler on a background thread.

    Requests arrive through ``submit`` (any thread); chunks leave through each request's
    ``emit`` callback (called on the loop thread). ``heartbeat`` is the monotonic time of the
    loop's last completed iteration, for stall detection by the health checker.

    Args:
        engine: the engine (its compiled steps are only ever called from the loop thread).
        scheduler: slots and queue.
        on_step: optional hook called after each step with (plan, seconds), for metrics.
    """

    def __init__(
        self,
        engine: Engine,
        scheduler: Scheduler,
        on_step: Callable[[StepPlan, float], None] | None = None,
    ):
        self.engine = engine
        self.scheduler = scheduler
        self.on_step = on_step
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
        # A pending switch: the new engine, or a function of the old one that builds it here.
        self._switch: tuple[Engine | Callable[[Engine], Engine], threading.Event] | None = None
        self._switch_error: BaseException | None = None  # what the last build function raised
        self._inflight: DispatchedStep | None = None  # dispatched, not yet postprocessed
        self._dispatched = 0  # steps dispatched so far
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
    def switch_engine(self, new_engine: Engine | Callable[[Engine], Engine], timeout_s: float = 600.0) -> None:
        """Swap in ``new_engine`` (built and warmed by the caller) between two steps: the live KV
        cache and slot state move to it and every stream continues. Blocks until done.

        ``new_engine`` may instead be a function of the old engine that builds and warms the new
        one: the loop thread then calls it between two steps (the streams pause meanwhile), as a
        job over several processes needs (every JAX call of the switch in the steps' order).

        Raises:
            EngineUnavailable: the loop is not running or did not reach a step boundary in time.
            Whatever the build function raises (the old engine then stays).
        """
        done = threading.Event()
        with self._lock:
            self._switch = (new_engine, done)
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
        new_engine, done = pending
        t0 = time.perf_counter()
        self._finish_inflight()  # the old engine's last step must land before its cache moves
        if callable(new_engine):  # an engine is not callable: a build function
            try:
                new_engine = new_engine(self.engine)
            except Exception as exc:  # the old engine serves on
                self._switch_error = exc
                done.set()
                return
        self.adopt_engine(new_engine)
        log.info("layout switched to %s in %.2f s", new_engine.layout.name, time.perf_counter() - t0)
        done.set()

    def adopt_engine(self, new_engine: Engine) -> None:
        """Make ``new_engine`` this loop's, with the old one's live state (between two steps,
        nothing in flight)."""
        new_engine.adopt_state(self.engine)
        self.engine = new_engine

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self, warmup_full: bool) -> None:
        """schedule -> dispatch step N -> postprocess step N-1 (while step N runs) -> repeat."""
        try:
            self.engine.warmup(full=warmup_full)
            self.heartbeat = time.monotonic()
            self.ready.set()
            while not self._stop.is_set():
                self._apply_switch()
                self._drain_inbox()
                plan = self.scheduler.schedule()
                if plan.empty:
                    if self._inflight is not None:
                        self._finish_inflight()  # its results may free slots or end requests
                        continue
                    self.heartbeat = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                dispatched = self.dispatch(plan)
                self._finish_inflight()
                self._inflight = dispatched
            self._finish_inflight()
        except BaseException as exc:
            log.exception("engine loop died")
            self.error = exc
        finally:
            message = f"engine stopped: {self.error!r}" if self.error else "server shutting down"
            self._drain_inbox()
            for r in self.scheduler.all_requests():
                r.fail(message)
            self.scheduler.release_finished()
            self.scheduler.waiting.clear()

    def _finish_inflight(self) -> None:
        """Postprocess the dispatched step, if any (blocks until its results are on the host)."""
        if self._inflight is None:
            return
        step, self._inflight = self._inflight, None
        self.postprocess(step)
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

    def step(self, plan: StepPlan) -> None:
        """Run one plan to completion (dispatch, then postprocess), without pipelining."""
        self._finish_inflight()
        self.postprocess(self.dispatch(plan))

    def dispatch(self, plan: StepPlan) -> DispatchedStep:
        """Launch one plan's programs (asynchronously) and advance the host bookkeeping that does
        not depend on their results: cached lengths, slot states, sampled-token counts.

        A decoding slot whose last id came from the still-running previous step reads it on the
        device (``Engine.decode``'s ``source``), so no host round trip separates two steps. A
        request's EOS ids are banned from the ids its steps sample while it has fewer than
        ``min_tokens`` of them (``sampled`` counts them at dispatch), unless it ignores EOS.
        """
        if self.step_hook is not None:
            self.step_hook(plan)
        engine = self.engine
        prev = self._inflight
        number = self._dispatched
        self._dispatched += 1
        prefill_out = None
        chunk = plan.prefill
        if chunk is not None:
            request = chunk.request
            if request.num_cached == 0:
                engine.set_sampling(
                    chunk.slot, request.sampling, logprobs=request.logprobs is not None, eos_ids=request.eos_ids
                )
            ids = request.prompt_ids[chunk.start : chunk.start + chunk.length]
            prefill_out = engine.prefill(chunk.slot, ids, chunk.start, ban_eos=bans_eos(request))
            request.num_cached += chunk.length
            if chunk.is_last:
                request.state = RequestState.DECODING
                request.sampled = 1
                request.last_token_from = ("prefill", number)

        decode_out = None
        if plan.decode:
            S, T = engine.ecfg.num_slots, engine.ecfg.max_seq_len
            tokens = np.zeros(S, np.int32)
            positions = np.full(S, T, np.int32)
            source = np.zeros(S, np.int32)
            ban = np.zeros(S, bool)
            for r in plan.decode:
                assert r.slot is not None
                positions[r.slot] = r.num_cached
                ban[r.slot] = bans_eos(r)
                if prev is not None and r.last_token_from == ("decode", number - 1):
                    source[r.slot] = 1
                elif prev is not None and r.last_token_from == ("prefill", number - 1):
                    source[r.slot] = 2
                else:
                    tokens[r.slot] = r.output_ids[-1]
                r.num_cached += 1
                r.sampled += 1
                r.last_token_from = ("decode", number)
            decode_out = engine.decode(
                tokens,
                positions,
                source,
                prev.decode_out if prev is not None else None,
                prev.prefill_out if prev is not None else None,
                ban,
            )
        return DispatchedStep(plan, prefill_out, decode_out, time.perf_counter())

    def postprocess(self, step: DispatchedStep) -> None:
        """Bring the step's ids to the host (one copy) and hand each to its request, which checks
        EOS, stop strings and max_tokens and streams the text. Requests that ended meanwhile
        (cancelled, or finished by the step before) are skipped; their slots are released."""
        outputs = [o for o in (step.prefill_out, step.decode_out) if o is not None]
        packed = outputs[0].packed if len(outputs) == 1 else jnp.concatenate([o.packed for o in outputs])
        host = StepOutput(packed, outputs[0].logits).host()
        row = 0
        chunk = step.plan.prefill
        if chunk is not None:
            request = chunk.request
            if chunk.is_last and request.state is RequestState.DECODING:
                request.accept_token(int(host.ids[0]), token_logprob(host, 0, request.logprobs))
            row = 1
        if step.decode_out is not None:
            for r in step.plan.decode:
                if r.state is not RequestState.DECODING:
                    continue
                assert r.slot is not None
                i = row + r.slot
                r.accept_token(int(host.ids[i]), token_logprob(host, i, r.logprobs))
        self.scheduler.release_finished()
