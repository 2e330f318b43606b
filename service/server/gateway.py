"""The admission core both APIs share, transport-free: the served model's pools, admission of a
request into a pool (``Gateway.open``), health, and the metrics of requests and steps.

gRPC (``service.server.grpc_api``) and the OpenAI-compatible HTTP API
(``service.server.http_api``) only translate: their request into a ``route`` (which pool) and a
``prepare`` (validate and tokenize), a ``Refused`` into their status code, the ``Generation``'s
chunks into their response shape. ``service.server.startup`` loads the model into the gateway.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model.config import LlamaConfig
from model.sampling import sequence_seed
from model.text.detokenizer import IncrementalDetokenizer
from model.text.tokenizer import Tokenizer
from service.engine.constraint import Constraint
from service.engine.loop import EngineUnavailable
from service.engine.request import Chunk, FinishReason, Request, RequestState
from service.engine.scheduler import QueueFull, Scheduler, StepPlan
from service.engine.text_stream import TextStream
from service.server.config import ServerConfig
from service.server.generation import Generation, Refusal, Refused
from service.server.grammars import Grammars
from service.server.logs import log
from service.server.metrics import Metrics
from service.server.pools import Pool
from service.server.validation import InvalidRequest, ValidatedRequest
from sharding.layouts import Layout


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What start-up learned of the served model.

    Attributes:
        name: the model's name in responses (a GGUF's file stem, a directory's name).
        path: where it was read from; kind: "gguf", "hf" or "checkpoint".
        cfg: its hyperparameters.
        weights: how its matmul weights are held: a float dtype, "stored" or "int8".
        formats: the parameters held as blocks, by name -> format ("wqkv" -> "q4_1", ...).
        startup_seconds: start-up phases, seconds: "load" (GGUF/HF read) or "restore"
            (checkpoint, onto devices), "place" (weights to devices, KV pool allocated),
            "compile", "warmup" (running the compiled steps once).
    """

    name: str
    path: Path
    kind: str
    cfg: LlamaConfig
    weights: str
    formats: dict[str, str]
    startup_seconds: dict[str, float]


class Gateway:
    """The served model's pools and everything between a transport and an engine loop.

    Attributes:
        cfg: the server's settings (process 0's in a job over several processes).
        facts: the model's (None while loading); tokenizer likewise.
        pools: the engine pools, the default first (empty while loading).
        accepting: False once a drain began (new requests are UNAVAILABLE).
        serving: what health reports (``RunningServer.set_health``), for HTTP's /health.
        inflight: requests from submit until their response's last byte is handed to its
            connection (``Generation.close``, called by the transport then), per pool name;
            touched only on the event loop's thread; the watchdog fails them when their pool's
            loop dies or stalls, and a drain waits for them.
        on_admit: called on the event loop before a request is first submitted (``serve_forever``:
            from then on a stop signal drains instead of ending the process).
        max_request_tokens: the most tokens (prompt + generated) a request may hold: set at
            start-up from the runners (``max_seq_len``, and no more than one data replica's
            pool); a layout switch never lowers it.
        restore: weights restored for a layout on some devices, or None when the live ones move
            (``startup.Restorer``; a live switch calls it).
        channel: in a job over several processes, process 0's step channel (its faults are
            health's), else None.
        grammars: the model's grammar compiler for constrained requests (None while loading).
    """

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.facts: ModelFacts | None = None
        self.tokenizer: Tokenizer | None = None
        self.pools: list[Pool] = []
        self.accepting = True
        self.serving = False
        self.metrics = Metrics()
        self.inflight: dict[str, set[Request]] = {}
        self.on_admit: Callable[[], None] | None = None
        self.max_request_tokens = cfg.engine.max_request_tokens
        self.restore: Callable[[Layout, list[Any]], Any] = lambda layout, devices: None
        self.channel: Any = None
        self.grammars: Grammars | None = None

    # ---- pools -----------------------------------------------------------------------------------
    def add_pool(self, pool: Pool) -> None:
        """Serve ``pool`` (its loop not started yet: its steps report to the metrics)."""
        scheduler = pool.loop.scheduler
        pool.loop.on_step = self._step_observer(pool.name, scheduler)
        host_per_token = self.metrics.host_per_token.labels(pool=pool.name)
        pool.loop.on_host = lambda seconds, ids: host_per_token.observe(seconds / ids)
        self.metrics.track_pages(pool.name, scheduler.page_counts)
        self.metrics.track_compiles(pool.name, lambda: pool.loop.runner.compiles)
        self.metrics.track_pool(
            pool.name,
            num_slots=scheduler.num_slots,
            active_slots=lambda: scheduler.active_slots,
            queue_depth=lambda: scheduler.queue_depth,
            kv_usage=lambda: scheduler.page_counts()["used"] / scheduler.num_pages,
        )
        if scheduler.proposer is not None:
            self.metrics.track_speculation(pool.name, scheduler.proposer.name)
        self.pools.append(pool)
        self.publish_layout(pool)

    def publish_layout(self, pool: Pool) -> None:
        """Set the pool's layout metric (at start-up and after each live switch)."""
        lay = pool.layout
        self.metrics.set_layout(pool.name, lay.name, lay.data, lay.model, pool.loop.runner.plan.attention)

    def find_pool(self, name: str) -> Pool:
        """The pool called ``name`` (or whose current layout is called ``name``); "" = default.

        Raises:
            InvalidRequest: no such pool (the message lists the valid names).
        """
        if not name:
            return self.pools[0]
        for pool in self.pools:
            if name == pool.name:
                return pool
        for pool in self.pools:
            if name == pool.layout.name:
                return pool
        valid = sorted({p.name for p in self.pools} | {p.layout.name for p in self.pools})
        raise InvalidRequest(f"layout: unknown layout or pool {name!r}; valid: {', '.join(valid)}")

    def pool_problem(self, pool: Pool) -> str | None:
        """Why ``pool`` cannot serve (a job over several processes lost one, warming up, its loop
        died or stopped, or a loop with work made no progress for ``stall_timeout_s``), or None
        when it can."""
        loop = pool.loop
        if self.channel is not None and self.channel.fault is not None:
            return f"the job is broken: {self.channel.fault}"
        if not loop.ready.is_set():
            return "the engine is still warming up"
        if loop.error is not None:
            return f"the engine loop died: {loop.error!r}"
        if not loop.alive:
            return "the engine loop is stopped"
        busy = loop.scheduler.active_slots > 0 or loop.scheduler.queue_depth > 0 or self.inflight.get(pool.name)
        idle_s = time.monotonic() - loop.heartbeat
        if busy and idle_s >= self.cfg.stall_timeout_s:
            return f"the engine loop stalled: no progress for {idle_s:.1f} s"
        return None

    def healthy(self) -> bool:
        """Every pool's loop runs, and a loop with work made progress within ``stall_timeout_s``."""
        return bool(self.pools) and all(self.pool_problem(p) is None for p in self.pools)

    def fail_inflight(self, pool_name: str | None, message: str) -> int:
        """Fail (UNAVAILABLE) and cancel every in-flight request of a pool (None = all pools),
        wherever it is: inbox, queue or row. Call on the event loop's thread. Returns how many
        were still unfinished."""
        n = 0
        for name, requests in self.inflight.items():
            if pool_name is None or name == pool_name:
                for req in list(requests):
                    if req.state is not RequestState.FINISHED:
                        req.fail(message)
                        n += 1
                    req.cancel()  # should the loop resume, it reaps them instead of running them
        return n

    # ---- metrics ---------------------------------------------------------------------------------
    def _step_observer(self, pool_name: str, sched: Scheduler) -> Callable[[StepPlan, float], None]:
        """The engine loop's ``on_step`` hook for one pool (runs on the loop thread, never raises)."""
        m = self.metrics
        seen = {"queried": 0, "hits": 0, "preemptions": 0, "drafts": 0, "accepted": 0, "verify": 0}
        lengths = [0] * len(sched.accepted_lengths)  # the scheduler's totals, last step
        proposer = getattr(sched.proposer, "name", "")

        def on_step(plan: StepPlan, seconds: float) -> None:
            try:
                m.step_time.labels(pool=pool_name).observe(seconds)
                m.step_tokens.labels(pool=pool_name).observe(plan.num_tokens)
                for r in plan.admitted:
                    if r.preemptions == 0:  # a recomputation's wait is not queue time
                        started = time.monotonic() - seconds
                        m.queue_time.labels(pool=pool_name).observe(max(0.0, started - r.arrival_s))
                queried, hits = sched.prefix_tokens()
                now = {"queried": queried, "hits": hits, "preemptions": sched.preemptions}
                m.prefix_queried.labels(pool=pool_name).inc(now["queried"] - seen["queried"])
                m.prefix_hits.labels(pool=pool_name).inc(now["hits"] - seen["hits"])
                m.preemptions.labels(pool=pool_name).inc(now["preemptions"] - seen["preemptions"])
                if proposer:
                    now.update(drafts=sched.drafts_proposed, accepted=sched.drafts_accepted, verify=sched.draft_steps)
                    m.draft_tokens.labels(pool=pool_name, proposer=proposer).inc(now["drafts"] - seen["drafts"])
                    m.accepted_tokens.labels(pool=pool_name, proposer=proposer).inc(now["accepted"] - seen["accepted"])
                    m.verify_steps.labels(pool=pool_name).inc(now["verify"] - seen["verify"])
                    for kept, total in enumerate(sched.accepted_lengths):
                        for _ in range(total - lengths[kept]):
                            m.acceptance_length.labels(pool=pool_name).observe(kept)
                        lengths[kept] = total
                seen.update(now)
            except Exception:
                log.exception("metrics: on_step failed")

        return on_step

    def _record_finished(self, pool_name: str, req: Request, chunk: Chunk) -> None:
        """Per-request metrics, once, when ``req`` ends (any thread; never raises)."""
        try:
            m = self.metrics
            reason = chunk.finish_reason.name.lower() if chunk.finish_reason is not None else "error"
            m.requests.labels(pool=pool_name, finish_reason=reason).inc()
            m.prompt_tokens.labels(pool=pool_name).inc(min(req.num_cached, req.prompt_len))
            m.generation_tokens.labels(pool=pool_name).inc(len(req.output_ids))
            if req.first_token_s is not None:
                m.ttft.labels(pool=pool_name).observe(req.first_token_s - req.arrival_s)
            completed = chunk.finish_reason in (FinishReason.LENGTH, FinishReason.EOS, FinishReason.STOP_STRING)
            if completed and req.finished_s is not None:
                m.e2e.labels(pool=pool_name).observe(req.finished_s - req.arrival_s)
                sampled = len(req.output_ids) + (chunk.finish_reason is FinishReason.EOS)
                if sampled >= 2 and req.first_token_s is not None:
                    m.tpot.labels(pool=pool_name).observe((req.finished_s - req.first_token_s) / (sampled - 1))
        except Exception:
            log.exception("metrics: recording request %s failed", req.request_id)

    def count_malformed(self) -> None:
        """Count a generation request refused as malformed before a pool was chosen (bytes that
        do not parse, an HTTP body of the wrong shape or over its size limit)."""
        self.metrics.rejected.labels(pool="", code=Refusal.INVALID_ARGUMENT.value).inc()

    # ---- admission -------------------------------------------------------------------------------
    async def open(
        self,
        rid: str,
        route: Callable[[], Pool],
        prepare: Callable[[Tokenizer], ValidatedRequest],
    ) -> Generation:
        """Admit one request and start its n sequences; await on the event loop.

        The checks run cheapest first, so that a burst is refused before any tokenizing: the
        model is loaded, the server is accepting, ``route()`` picks the pool, the pool can serve,
        its queue has room; only then ``prepare(tokenizer)`` tokenizes and validates, on a worker
        thread (``Tokenizer.encode`` lets go of the GIL, and a long prompt takes long enough to
        tokenize that on the event loop it would stall every stream: docs/performance.md,
        "Tokenizing on the host"). Sequence i
        gets its own ``Request`` with the seed ``sequence_seed(seed, i)``; all are submitted at
        once (they share the prompt's pages) and tracked in ``inflight`` until the
        ``Generation`` is closed. Each sequence records its own metrics when it ends. A refusal
        is logged and counted in ``meshserve_requests_rejected_total`` under the pool it was
        meant for ("" before ``route()`` chose one).

        Args:
            rid: the request's id (logs; sequence i > 0 of n logs as ``rid.i``).
            route: the pool the request names; raises ``Refused`` (INVALID_ARGUMENT or
                NOT_FOUND) when it names none.
            prepare: the validated request; raises ``InvalidRequest`` (or ``Refused``).

        Raises:
            Refused: UNAVAILABLE (loading, shutting down, the pool's loop died or stalled),
                RESOURCE_EXHAUSTED (the queue is full, or has no room for all n sequences),
                INVALID_ARGUMENT or NOT_FOUND (from ``route`` and ``prepare``).
        """
        pool_name = ""
        try:
            tok = self.tokenizer
            if tok is None or not self.pools:
                raise Refused(Refusal.UNAVAILABLE, "the model is still loading")
            if not self.accepting:
                raise Refused(Refusal.UNAVAILABLE, "the server is shutting down")
            pool = route()
            pool_name = pool.name
            problem = self.pool_problem(pool)
            if problem is not None:
                raise Refused(Refusal.UNAVAILABLE, f"pool {pool.name}: {problem}")
            full = pool.loop.queue_full()  # before tokenizing: a burst is refused cheaply (submit re-checks)
            if full is not None:
                raise Refused(Refusal.RESOURCE_EXHAUSTED, full)
            try:
                v, constraint = await asyncio.to_thread(self._prepare, prepare, tok)
            except InvalidRequest as exc:
                raise Refused(Refusal.INVALID_ARGUMENT, str(exc)) from None
            if not self.accepting:  # the drain began while it was tokenized
                raise Refused(Refusal.UNAVAILABLE, "the server is shutting down")
            if self.on_admit is not None:
                self.on_admit()
            generation = self._start(pool, v, rid, tok, constraint)
        except Refused as exc:
            log.info("request %s: rejected, %s: %s", rid, exc.code.name, exc.message)
            self.metrics.rejected.labels(pool=pool_name, code=exc.code.value).inc()
            raise
        log.info(
            "request %s: %d prompt tokens, max_tokens %d, n %d, pool %s",
            rid, len(v.prompt_ids), v.max_tokens, v.n, pool.name,
        )  # fmt: skip
        return generation

    def _prepare(
        self, prepare: Callable[[Tokenizer], ValidatedRequest], tok: Tokenizer
    ) -> tuple[ValidatedRequest, Constraint | None]:
        """``prepare(tok)`` and its constraint compiled (``Grammars.compile``: cached, or compiled
        here, on the worker thread ``open`` runs this on).

        Raises:
            InvalidRequest: from ``prepare``, or the constraint does not compile.
        """
        v = prepare(tok)
        if v.constraint is None:
            return v, None
        if self.grammars is None:
            raise Refused(Refusal.UNAVAILABLE, "the model is still loading")
        return v, self.grammars.compile(v.constraint)

    def _start(
        self, pool: Pool, v: ValidatedRequest, rid: str, tok: Tokenizer, constraint: Constraint | None = None
    ) -> Generation:
        """Submit the n sequences of ``v`` to ``pool`` (see ``open``), each with its own copy of
        ``constraint`` (compiled from ``v.constraint``).

        Raises:
            Refused: RESOURCE_EXHAUSTED or UNAVAILABLE from the pool's loop; the sequences
                submitted before it are cancelled (and counted nowhere: the request never ran).
        """
        chunks: asyncio.Queue[tuple[int, Chunk]] = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        requests: list[Request] = []
        refused = threading.Event()  # set when a later sequence was refused: the earlier ones record nothing

        def emitter(index: int) -> Callable[[Chunk], None]:
            recorded = threading.Lock()  # acquired once: the first final or error chunk records metrics

            def emit(chunk: Chunk) -> None:  # engine thread (or the watchdog, on the event loop)
                final = chunk.finish_reason is not None or chunk.error is not None
                if final and not refused.is_set() and recorded.acquire(blocking=False):
                    self._record_finished(pool.name, requests[index], chunk)
                aloop.call_soon_threadsafe(chunks.put_nowait, (index, chunk))

            return emit

        for i in range(v.n):
            requests.append(
                Request(
                    request_id=rid if v.n == 1 else f"{rid}.{i}",
                    prompt_ids=v.prompt_ids,
                    max_tokens=v.max_tokens,
                    sampling=dataclasses.replace(v.sampling, seed=sequence_seed(v.sampling.seed, i)),
                    text=TextStream(IncrementalDetokenizer(tok), v.stop),
                    emit=emitter(i),
                    eos_ids=tok.eos_ids,
                    logprobs=v.logprobs,
                    min_tokens=v.min_tokens,
                    ignore_eos=v.ignore_eos,
                    prefix_cache=v.prefix_cache,
                    speculative=v.speculative,
                    group=rid if v.n > 1 else None,
                    constraint=constraint.fresh() if constraint is not None else None,
                )
            )
        inflight = self.inflight.setdefault(pool.name, set())
        for req in requests:
            try:
                pool.loop.submit(req)
            except (QueueFull, EngineUnavailable) as exc:
                refused.set()
                for earlier in requests:
                    earlier.cancel()
                    inflight.discard(earlier)
                if isinstance(exc, QueueFull):
                    more = f" (no room for all {v.n} sequences)" if v.n > 1 else ""
                    raise Refused(Refusal.RESOURCE_EXHAUSTED, f"{exc}{more}") from None
                raise Refused(Refusal.UNAVAILABLE, f"pool {pool.name}: {exc}") from None
            inflight.add(req)

        def forget(g: Generation) -> None:
            for req in g.requests:
                inflight.discard(req)

        return Generation(rid, pool.name, requests, chunks, forget)
