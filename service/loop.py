"""The engine loop: one thread that runs schedule -> execute -> postprocess, step after step."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np

from service.engine import Engine
from service.request import Request, RequestState
from service.scheduler import QueueFull, Scheduler, StepPlan

log = logging.getLogger(__name__)


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
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = threading.Event()  # set when warm-up compilation is done
        self.error: BaseException | None = None
        self.heartbeat = time.monotonic()
        self.steps = 0
        self._pending = 0  # requests in the inbox, counted against the queue bound
        self._lock = threading.Lock()
        self._switch: tuple[Engine, threading.Event] | None = None

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
    def submit(self, request: Request) -> None:
        """Queue a request (thread-safe).

        Raises:
            EngineUnavailable: the loop is not running.
            QueueFull: the waiting queue is at capacity.
        """
        if not self.alive or self._stop.is_set():
            raise EngineUnavailable("the engine loop is not running")
        with self._lock:
            waiting = self.scheduler.queue_depth + self._pending
            if waiting >= self.scheduler.max_queue:
                raise QueueFull(f"queue full: {waiting} requests waiting (max {self.scheduler.max_queue})")
            self._pending += 1
        self._inbox.put(request)
        self._wake.set()

    # ---- live layout switch --------------------------------------------------------------------
    def switch_engine(self, new_engine: Engine, timeout_s: float = 600.0) -> None:
        """Swap in ``new_engine`` (built and warmed by the caller) between two steps: the live KV
        cache and slot state move to it and every stream continues. Blocks until done.

        Raises:
            EngineUnavailable: the loop is not running or did not reach a step boundary in time.
        """
        done = threading.Event()
        with self._lock:
            self._switch = (new_engine, done)
        self._wake.set()
        if not done.wait(timeout_s):
            with self._lock:
                self._switch = None
            raise EngineUnavailable("the engine loop did not apply the layout switch in time")

    def _apply_switch(self) -> None:
        with self._lock:
            pending, self._switch = self._switch, None
        if pending is None:
            return
        new_engine, done = pending
        t0 = time.perf_counter()
        new_engine.adopt_state(self.engine)
        self.engine = new_engine
        log.info("layout switched to %s in %.2f s", new_engine.layout.name, time.perf_counter() - t0)
        done.set()

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self, warmup_full: bool) -> None:
        try:
            self.engine.warmup(full=warmup_full)
            self.heartbeat = time.monotonic()
            self.ready.set()
            while not self._stop.is_set():
                self._apply_switch()
                self._drain_inbox()
                plan = self.scheduler.schedule()
                if plan.empty:
                    self.heartbeat = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                self.step(plan)
                self.steps += 1
                self.heartbeat = time.monotonic()
                if self.on_step is not None:
                    self.on_step(plan, time.perf_counter() - t0)
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

    def _drain_inbox(self) -> None:
        while True:
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._pending -= 1
                self.scheduler.waiting.append(request)

    def step(self, plan: StepPlan) -> None:
        """Execute one plan and postprocess its tokens (one device-to-host copy per program)."""
        engine = self.engine
        prefill_token = None
        chunk = plan.prefill
        if chunk is not None:
            request = chunk.request
            if request.num_cached == 0:
                engine.set_sampling(chunk.slot, request.sampling)
            ids = request.prompt_ids[chunk.start : chunk.start + chunk.length]
            prefill_token, _ = engine.prefill(chunk.slot, ids, chunk.start)

        decode_ids = None
        if plan.decode:
            S, T = engine.ecfg.num_slots, engine.ecfg.max_seq_len
            tokens = np.zeros(S, np.int32)
            positions = np.full(S, T, np.int32)
            for r in plan.decode:
                assert r.slot is not None
                tokens[r.slot] = r.output_ids[-1]
                positions[r.slot] = r.num_cached
            decode_ids, _ = engine.decode(tokens, positions)

        # Postprocess: the prefill's first token, then every decoding slot's next token.
        if chunk is not None:
            request = chunk.request
            request.num_cached += chunk.length
            if chunk.is_last:
                request.state = RequestState.DECODING
                request.accept_token(int(prefill_token))  # type: ignore[arg-type]
        if decode_ids is not None:
            host_ids = np.asarray(decode_ids)
            for r in plan.decode:
                if r.state is not RequestState.DECODING:
                    continue
                r.num_cached += 1
                r.accept_token(int(host_ids[r.slot]))
        self.scheduler.release_finished()
