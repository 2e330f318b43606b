"""The gRPC server: Generate (server-streaming), GetModelInfo, grpc.health.v1 and reflection.

Status codes, in one place:
    INVALID_ARGUMENT   a malformed or out-of-range field (the message names it)
    RESOURCE_EXHAUSTED the waiting queue is full
    UNAVAILABLE        the model is still loading/compiling, the engine loop died or stalled,
                       or the server is shutting down
    CANCELLED / DEADLINE_EXCEEDED  set by gRPC when the client cancels or its deadline passes;
                       the request's slot is freed within one engine step
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import jax
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from model.fetch import resolve_model
from model.loader import load_gguf_model
from model.tokenizer import Tokenizer
from protos.meshserve.v1 import meshserve_pb2 as pb
from protos.meshserve.v1 import meshserve_pb2_grpc as pb_grpc
from service.admin import start_admin_server
from service.engine import Engine, EngineConfig
from service.loop import EngineLoop, EngineUnavailable
from service.pools import Pool, PoolSpec, assign_devices, parse_pool
from service.request import Request
from service.scheduler import QueueFull, Scheduler
from service.text_stream import TextStream
from service.validation import InvalidRequest, validate
from sharding.layouts import load_layout

log = logging.getLogger("meshserve")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "meshserve.v1.Generation"


@dataclasses.dataclass
class ServerConfig:
    """Everything ``meshserve serve`` can set (config file keys = these field names).

    Attributes:
        model: GGUF path, or None/"default" for SmolLM2-135M-Instruct from PyPI.
        cache_dir: model and compilation cache directory (default ``$MESHSERVE_CACHE`` or
            ``~/.cache/meshserve``).
        host, port: listen address (port 0 picks a free port).
        layout: layout preset name or YAML path.
        num_slots: decode slots. max_seq_len: tokens per slot (prompt + generated).
        chunk_size: prefill chunk (largest prefill bucket), tokens.
        max_queue: most requests waiting for a slot before RESOURCE_EXHAUSTED.
        default_max_tokens: max_tokens when a request leaves it unset.
        dtype: "float32" (CPU) or "bfloat16" (accelerators).
        warmup_full: compile every shape variant before reporting SERVING (else only the
            smallest; others compile on first use and land in the persistent cache).
        stall_timeout_s: health turns NOT_SERVING when a busy engine loop makes no progress
            for this long, in seconds.
        grace_period_s: on SIGTERM, how long in-flight streams may run before they are
            cancelled with UNAVAILABLE, in seconds.
        pools: ``NAME=LAYOUT[:N]`` engine pools on disjoint devices (``service/pools.py``);
            empty = one pool "default" on ``layout`` owning every device.
        admin_token: enables the Admin service (layouts, live switch) when set; clients must
            send ``authorization: Bearer <token>``.
        admin_host, admin_port: where the Admin service listens (loopback by default).
    """

    model: str | None = None
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    layout: str = "single"
    num_slots: int = 4
    max_seq_len: int = 2048
    chunk_size: int = 512
    max_queue: int = 64
    default_max_tokens: int = 512
    dtype: str = "float32"
    warmup_full: bool = False
    stall_timeout_s: float = 120.0
    grace_period_s: float = 10.0
    pools: list[str] = dataclasses.field(default_factory=list)
    admin_token: str | None = None
    admin_host: str = "127.0.0.1"
    admin_port: int = 50052


def enable_compilation_cache(cache_dir: Path) -> None:
    """Persist compiled XLA programs under ``cache_dir/jax`` so restarts skip compilation."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


class GenerationService(pb_grpc.GenerationServicer):
    """The Generation servicer; loads the model and owns the engine loop."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.pools: list[Pool] = []
        self.tokenizer: Tokenizer | None = None
        self.info: pb.ModelInfo | None = None
        self.accepting = True

    @property
    def loop(self) -> EngineLoop | None:
        """The default pool's engine loop (None while loading)."""
        return self.pools[0].loop if self.pools else None

    # ---- startup ------------------------------------------------------------------------------
    def load(self) -> None:
        """Blocking: fetch/read the model, build the pools, start their loops, wait for warm-up.

        Raises:
            LayoutError: a layout or pool does not fit the devices or the model (at startup,
                never on the first request).
            RuntimeError: warm-up failed.
        """
        from model.fetch import cache_dir

        cfg = self.cfg
        root = cache_dir(cfg.cache_dir)
        enable_compilation_cache(root)
        path = resolve_model(cfg.model, root)
        t0 = time.perf_counter()
        model_cfg, graphdef, params = load_gguf_model(path)
        self.tokenizer = Tokenizer.from_gguf(path)
        t_load = time.perf_counter() - t0

        devices = jax.devices()
        if cfg.pools:
            specs = [parse_pool(p) for p in cfg.pools]
            device_sets = assign_devices(specs, devices)
        else:
            specs = [PoolSpec("default", load_layout(cfg.layout), len(devices))]
            device_sets = [devices]
        ecfg = EngineConfig(cfg.num_slots, cfg.max_seq_len, cfg.chunk_size, cfg.dtype)
        engines = [
            Engine(model_cfg, graphdef, params, s.layout, ecfg, ds) for s, ds in zip(specs, device_sets, strict=True)
        ]
        t1 = time.perf_counter()
        for i, (spec, ds, engine) in enumerate(zip(specs, device_sets, engines, strict=True)):
            loop = EngineLoop(engine, Scheduler(cfg.num_slots, cfg.max_queue, cfg.chunk_size))
            loop.start(warmup_full=cfg.warmup_full)
            self.pools.append(Pool(name=spec.name, devices=ds, loop=loop, is_default=i == 0))
        for pool in self.pools:
            while not pool.loop.ready.wait(0.2):
                if pool.loop.error is not None:
                    raise RuntimeError(f"pool {pool.name}: engine warm-up failed: {pool.loop.error!r}")
        log.info(
            "model %s loaded in %.1f s, placed and compiled in %.1f s; pools: %s; %d slots x %d tokens each",
            path.name, t_load, time.perf_counter() - t1,
            ", ".join(f"{p.name}={p.layout.name} on devices {p.device_ids}" for p in self.pools),
            cfg.num_slots, cfg.max_seq_len,
        )  # fmt: skip
        self.model_cfg = model_cfg
        self.info = pb.ModelInfo(
            name=path.stem,
            architecture="llama",
            vocab_size=model_cfg.vocab_size,
            num_layers=model_cfg.num_layers,
            hidden_size=model_cfg.hidden_size,
            intermediate_size=model_cfg.intermediate_size,
            num_heads=model_cfg.num_heads,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            context_length=model_cfg.max_position_embeddings,
            max_seq_len=cfg.max_seq_len,
            num_slots=cfg.num_slots,
            eos_token_ids=sorted(self.tokenizer.eos_ids),
            dtype=cfg.dtype,
            num_parameters=model_cfg.param_count(),
            layout=self.pools[0].layout.name,
            model_path=str(path),
        )

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

    def healthy(self) -> bool:
        """Every pool's loop runs, and a loop with work made progress within ``stall_timeout_s``."""
        if not self.pools:
            return False
        for pool in self.pools:
            loop = pool.loop
            if not loop.ready.is_set() or not loop.alive:
                return False
            busy = loop.scheduler.active_slots > 0 or loop.scheduler.queue_depth > 0
            if busy and time.monotonic() - loop.heartbeat >= self.cfg.stall_timeout_s:
                return False
        return True

    # ---- RPCs ---------------------------------------------------------------------------------
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.info

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        tok = self.tokenizer
        if tok is None or not self.healthy():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is not serving (loading, stalled or stopped)")
        if not self.accepting:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        assert tok is not None
        try:
            loop = self.find_pool(request.layout).loop
            v = validate(request, tok, self.cfg.max_seq_len, self.cfg.default_max_tokens)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = request.request_id or uuid.uuid4().hex[:16]
        chunks: asyncio.Queue = asyncio.Queue()
        aloop = asyncio.get_running_loop()
        req = Request(
            request_id=rid,
            prompt_ids=v.prompt_ids,
            max_tokens=v.max_tokens,
            sampling=v.sampling,
            text=TextStream(tok.detokenizer(), v.stop),
            emit=lambda chunk: aloop.call_soon_threadsafe(chunks.put_nowait, chunk),
            eos_ids=tok.eos_ids,
        )
        try:
            loop.submit(req)
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("request %s: %d prompt tokens, max_tokens %d", rid, len(v.prompt_ids), v.max_tokens)
        try:
            while True:
                chunk = await chunks.get()
                if chunk.error is not None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, chunk.error)
                resp = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, request_id=rid)
                if chunk.finish_reason is not None:
                    resp.finish_reason = chunk.finish_reason.value
                    resp.usage.prompt_tokens = chunk.prompt_tokens
                    resp.usage.completion_tokens = chunk.completion_tokens
                yield resp
                if chunk.finish_reason is not None:
                    log.info(
                        "request %s: finished %s, %d tokens", rid, chunk.finish_reason.name, chunk.completion_tokens
                    )
                    return
        finally:
            req.cancel()  # no-op when finished; frees the slot when the client went away


class RunningServer:
    """A started server: its bound port, its servicer, and how to stop it."""

    def __init__(
        self, server: grpc.aio.Server, service: GenerationService, health: health_aio.HealthServicer, port: int
    ):
        self.server = server
        self.service = service
        self.health = health
        self.port = port
        self._watchdog: asyncio.Task | None = None
        self.admin_server: grpc.aio.Server | None = None
        self.admin_port: int | None = None

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def watch(self, interval_s: float = 0.5) -> None:
        """Keep the health status in step with the engine loop (dead or stalled -> NOT_SERVING)."""
        last: bool | None = None
        while True:
            now = self.service.healthy() and self.service.accepting
            if now != last:
                await self.set_health(now)
                if last is not None:
                    log.warning("health: %s", "SERVING" if now else "NOT_SERVING")
                last = now
            await asyncio.sleep(interval_s)

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let streams finish for ``grace_s`` seconds, then cancel the rest."""
        self.service.accepting = False
        await self.set_health(False)
        loops = [p.loop for p in self.service.pools]
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(
            loop.alive and (loop.scheduler.active_slots or loop.scheduler.queue_depth) for loop in loops
        ):
            await asyncio.sleep(0.1)
        for loop in loops:
            await asyncio.to_thread(loop.stop)  # fails what is left with UNAVAILABLE
        if self.admin_server is not None:
            await self.admin_server.stop(1.0)
        await self.server.stop(1.0)
        if self._watchdog is not None:
            self._watchdog.cancel()


async def start_server(cfg: ServerConfig) -> RunningServer:
    """Bind and start the gRPC server at once (health NOT_SERVING), then load the model and
    compile; health turns SERVING when warm-up is done.

    Raises:
        RuntimeError: the port could not be bound; any load/compile error of ``service.load``.
    """
    server = grpc.aio.server()
    service = GenerationService(cfg)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    if port == 0:
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}")
    running = RunningServer(server, service, health, port)
    await running.set_health(False)
    await server.start()
    log.info("listening on %s:%d (NOT_SERVING until warm-up is done)", cfg.host, port)
    await asyncio.to_thread(service.load)
    if cfg.admin_token:
        running.admin_server, running.admin_port = await start_admin_server(service, cfg)
    running._watchdog = asyncio.create_task(running.watch())
    log.info("SERVING on %s:%d", cfg.host, port)
    return running


async def serve_forever(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then shut down gracefully; returns the exit code (0)."""
    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)
    running = await start_server(cfg)
    await stop.wait()
    log.info("signal received: draining for up to %.0f s", cfg.grace_period_s)
    await running.shutdown(cfg.grace_period_s)
    return 0


class ServerThread:
    """Run a server on a background thread with its own event loop (tests, benchmarks).

    ``start()`` blocks until the server is SERVING (or raises what startup raised).
    """

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.running: RunningServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-server", daemon=True)

    def start(self) -> ServerThread:
        self._thread.start()
        self.running = asyncio.run_coroutine_threadsafe(start_server(self.cfg), self._loop).result()
        return self

    @property
    def address(self) -> str:
        assert self.running is not None
        return f"{self.cfg.host}:{self.running.port}"

    def stop(self, grace_s: float = 0.0) -> None:
        if self.running is not None:
            asyncio.run_coroutine_threadsafe(self.running.shutdown(grace_s), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
