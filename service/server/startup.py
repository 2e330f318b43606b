"""Start-up: read the model, build each pool's runner and engine loop, warm them, and fill the
gateway (``load``); in a job over several processes, join it first (``join_job``) and, on a
follower, replay process 0's runner calls instead of serving.

``model.weights.loader.load_model`` reads ``cfg.model`` by what the path is
(``model_format``): a GGUF file is read on the host (its blocks kept as stored or dequantized),
then placed; a Hugging Face directory is read with ``safetensors``, then placed; a converted
checkpoint is restored by orbax directly into each pool's shardings (no host copy of the full
weights). The start-up log splits the time into load (or restore), place (weights to devices,
KV pool allocated), compile (JAX tracing, lowering and XLA compilation or persistent-cache
fetch) and warm-up (running the compiled steps once).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from model import kernels
from model.config import LlamaConfig
from model.text.tokenizer import Tokenizer
from model.weights.block_params import block_formats
from model.weights.fetch import cache_dir, resolve_model
from model.weights.loader import ShardingsFn, load_model, model_format, restores_as_saved
from service.engine.config import EngineConfig
from service.engine.distributed import (
    CONFIG,
    DraftChannel,
    Heartbeat,
    StepChannel,
    coordinator_host,
    follow,
    job_layout_problem,
)
from service.engine.draft_model import DraftModelProposer, draft_engine_config
from service.engine.loop import make_loop
from service.engine.runner import Runner
from service.server.config import ConfigError, ServerConfig
from service.server.gateway import Gateway, ModelFacts
from service.server.grammars import Grammars
from service.server.logs import log
from service.server.pools import Pool, PoolSpec, assign_devices, parse_pool
from sharding.layouts import Layout, load_layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import param_shardings


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


def enable_compilation_cache(root: Path) -> None:
    """Persist compiled XLA programs under ``root/jax`` so restarts skip compilation."""
    jax.config.update("jax_compilation_cache_dir", str(root / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.2)


def keeps_blocks(weights: str, kind: str, layouts: list[Layout], platform: str) -> bool:
    """Whether to keep a model's blocks (a GGUF's, or a converted checkpoint's) as stored
    (``EngineConfig.weights``): "stored" and "int8" always; "auto" where
    ``model.kernels.keeps_blocks`` says the platform multiplies them faster than floats; never
    for a Hugging Face directory, which holds none."""
    if kind == "hf" or weights not in ("auto", "stored", "int8"):
        return False
    if weights in ("stored", "int8"):
        return True
    return kernels.keeps_blocks(platform, [lay.num_devices for lay in layouts])


def check_draft_pool(ecfg: EngineConfig, platform: str) -> None:
    """A draft model's weights and pool are placed after the target's pool is sized: on an
    accelerator the default pool (``service.engine.kv_pool``: 0.9 of each device's memory) would
    leave them no room, so the pool's size must be given.

    Raises:
        ConfigError: a draft model on an accelerator without ``kv_cache_tokens`` or ``kv_cache_memory``.
    """
    if platform != "cpu" and not (ecfg.kv_cache_tokens or ecfg.kv_cache_memory):
        raise ConfigError(
            "--speculative draft:MODEL on an accelerator needs --kv-cache-tokens or --kv-cache-memory: the default "
            "pool takes 0.9 of each device's memory and leaves the draft model's weights and pool none"
        )


def draft_runners(name: str, root: Path, tokenizer: Tokenizer, runners: list[Runner]) -> list[Runner]:
    """The draft model's runner beside each pool's runner (``--speculative draft:MODEL``): the
    draft model read once (``name``: what ``--model`` takes; its blocks kept as the target's
    would be) and placed on each pool's layout and devices, with its own pool
    (``draft_engine_config``). A follower of a job builds the same, to replay process 0's draft
    steps (``service.engine.distributed.follow``).

    Raises:
        ValueError: the draft model's tokenizer maps ids to other tokens than the target's
            ``tokenizer`` (its drafts would be other tokens' ids), or its logits are wider than
            the target's (it could draft an id the target has no embedding for).
        LayoutError: a pool's layout does not divide the draft model's axes.
        FileNotFoundError, WeightError, GGUFMetadataError, HFConfigError: the draft model is unreadable.
    """
    ecfg = runners[0].ecfg
    path = resolve_model(name, root)
    kind = model_format(path)
    stored = keeps_blocks(ecfg.weights, kind, [r.layout for r in runners], runners[0].mesh.devices.flat[0].platform)
    draft = load_model(path, tokenizer=True, stored=stored, quantize="int8" if ecfg.weights == "int8" else None)
    assert draft.tokenizer is not None  # asked for
    differs = tokenizer.vocabulary_difference(draft.tokenizer)
    if differs is not None:
        raise ValueError(
            f"draft model {path.name}'s tokenizer is not the target's ({differs}): a draft model must share the "
            "target's tokenizer"
        )
    if draft.cfg.vocab_size > runners[0].cfg.vocab_size:
        raise ValueError(
            f"draft model {path.name} has {draft.cfg.vocab_size} logits, the target {runners[0].cfg.vocab_size}: a "
            "draft model may not propose ids the target has no embedding for"
        )
    log.info("draft model %s (%s weights) proposes up to %d ids per step", path.name, "stored" if stored else ecfg.dtype,
             ecfg.speculative_tokens)  # fmt: skip
    return [
        Runner(draft.cfg, draft.graphdef, draft.state, r.layout, draft_engine_config(r.ecfg), list(r.mesh.devices.flat))
        for r in runners
    ]


def stored_formats(state: nnx.State) -> dict[str, str]:
    """The parameters of a loaded model's state held as blocks, by name ("wqkv", "embed", ...)
    -> format ("q4_1", ...); empty when every weight is a float array."""
    return {path.rsplit("/", 1)[-1]: fmt for path, fmt in block_formats(nnx.to_pure_dict(state)).items()}


def pool_weight_bytes(runner: Runner) -> int:
    """Bytes of parameters a runner's devices hold, per data replica (``ModelInfo.weight_bytes``)."""
    return sum(runner.weight_bytes_per_device().values()) // max(1, runner.layout.data)


def describe_weights(weights: str, formats: dict[str, str], dtype: str) -> str:
    """One phrase for the start-up log: "float32", "blocks as stored (q4_1: w_down, ...; q8_0:
    embed; the rest float32)" or "int8 blocks (q8_0: ...; the rest float32)"."""
    if weights not in ("stored", "int8"):
        return weights
    by_format: dict[str, list[str]] = {}
    for name, fmt in sorted(formats.items()):
        by_format.setdefault(fmt, []).append(name)
    held = "; ".join(f"{fmt}: {', '.join(names)}" for fmt, names in sorted(by_format.items()))
    what = "int8 blocks" if weights == "int8" else "blocks as stored"
    return f"{what} ({held}; the rest {dtype})"


def pool_shardings(layout: Layout, devices: list, num_slots: int) -> ShardingsFn:
    """The param shardings ``layout`` gives a model on ``devices`` (the ones a ``Runner`` places
    with, so a checkpoint restored into them is placed nothing again), as ``load_model`` takes
    them."""

    def shardings(model_cfg: LlamaConfig, state: nnx.State) -> Any:
        plan = make_plan(layout, model_cfg, num_slots)
        return param_shardings(state, make_mesh(layout, devices), plan.rules)

    return shardings


@dataclasses.dataclass(frozen=True)
class Restorer:
    """When serving a converted checkpoint: its params restored straight into a layout's
    shardings on some devices (a live switch then reads the checkpoint instead of moving the
    live arrays)."""

    path: Path
    dtype: str
    stored: bool
    num_slots: int

    def __call__(self, layout: Layout, devices: list) -> nnx.State:
        shardings = pool_shardings(layout, devices, self.num_slots)
        return load_model(self.path, self.dtype, shardings=shardings, stored=self.stored).state


@dataclasses.dataclass
class Job:
    """This process's part in a job over several processes: the step channel, and a follower's
    heartbeat (None on process 0)."""

    channel: StepChannel
    heartbeat: Heartbeat | None = None

    @property
    def leader(self) -> bool:
        return self.channel.process_id == 0

    def release_followers(self) -> None:
        """Process 0, after its engine loop stopped: send the followers ``STOP``, wait for them
        to leave, close the step channel (a broken job's is closed already)."""
        if self.channel.fault is not None:
            return
        if not self.channel.finish():
            log.warning("not every follower left the job within 30 s of STOP")


def check_job(cfg: ServerConfig) -> None:
    """Process 0, before a job over several processes opens its step channel: can it serve ``cfg``?

    Raises:
        ConfigError: several pools, or a layout without every process's
            devices (``job_layout_problem``).
    """
    if len(cfg.pools) > 1:
        raise ConfigError(f"serving over several processes takes one pool, not {len(cfg.pools)}")
    layout = parse_pool(cfg.pools[0]).layout if cfg.pools else load_layout(cfg.layout)
    problem = job_layout_problem(layout)
    if problem is not None:
        raise ConfigError(problem)


def join_job(cfg: ServerConfig) -> tuple[Job, ServerConfig]:
    """Open the step channel of a job over several processes (after
    ``service.engine.distributed.initialize``): process 0 sends its config (less the admin
    token), a follower takes it as its own and starts its heartbeat. Returns the job and the
    config to build from.

    Raises:
        ConfigError: process 0's config asks for what the job cannot run (several pools, a
            layout without every process's devices); the followers then see the channel close
            and exit.
        ConnectionError, TimeoutError: the step channel did not open, or closed early.
    """
    if jax.process_index() == 0:
        check_job(cfg)
        # Every interface: the followers reach it at the coordinator's host.
        channel = StepChannel.open(host=coordinator_host(), bind="")
        channel.send((CONFIG, (dataclasses.replace(cfg, admin_token=None),), {}))
        channel.watch(cfg.process_timeout_s)
        log.info("process 0 of %d: %d devices, %d here", jax.process_count(), jax.device_count(),
                 jax.local_device_count())  # fmt: skip
        return Job(channel), cfg
    channel = StepChannel.open()
    job = Job(channel, Heartbeat(channel))
    name, (config,), _ = channel.recv()
    if name != CONFIG:
        raise ConnectionError(f"process 0 sent {name!r} first, not its config")
    log.info("process %d of %d: following process 0 (model %s, layout %s)", jax.process_index(),
             jax.process_count(), config.model or "default", config.layout)  # fmt: skip
    return job, config


def load(gateway: Gateway, job: Job | None = None) -> int:
    """Blocking: fetch/read the model, build the pools, start their loops, wait for warm-up, and
    fill ``gateway`` (its config is ``job``'s when given: process 0's). On a follower of a job,
    replay process 0's runner calls (``follow``) until it sends ``STOP`` instead, and return the
    steps run (0 otherwise).

    Raises:
        LayoutError: a layout or pool does not fit the devices or the model (at start-up,
            never on the first request).
        RuntimeError: warm-up failed.
        CheckpointError, HFConfigError, WeightError, GGUFMetadataError: the model is unreadable.
        ConfigError: a draft model on an accelerator without a pool size (``check_draft_pool``).
        ValueError: a draft model whose tokenizer or logits differ from the target's
            (``draft_runners``).
    """
    cfg = gateway.cfg
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
    if ecfg.draft_model:
        check_draft_pool(ecfg, devices[0].platform)

    clock = CompileClock()
    with clock:
        t0 = time.perf_counter()
        stored = keeps_blocks(ecfg.weights, kind, [s.layout for s in specs], devices[0].platform)
        quantize = "int8" if ecfg.weights == "int8" else None
        if restores_as_saved(path, stored, quantize):
            # Restored as saved straight into each pool's shardings; layout switches restore from it.
            if job is None:  # a job's processes move the live weights
                gateway.restore = Restorer(path, ecfg.dtype, stored, ecfg.num_slots)
            models = [
                load_model(
                    path, ecfg.dtype, shardings=pool_shardings(s.layout, ds, ecfg.num_slots), tokenizer=i == 0,
                    stored=stored,
                )
                for i, (s, ds) in enumerate(zip(specs, device_sets, strict=True))
            ]  # fmt: skip
        else:
            # One host copy (float32 from a GGUF, or its blocks as stored; as stored from a
            # Hugging Face directory; a checkpoint's blocks dequantized, or its floats
            # quantized); each pool's runner casts and places it.
            models = [load_model(path, tokenizer=True, stored=stored, quantize=quantize)] * len(specs)
        model_cfg, graphdef, tokenizer = models[0].cfg, models[0].graphdef, models[0].tokenizer
        formats = stored_formats(models[0].state)
        # "int8" when load quantized float weights; blocks that were already held are "stored"
        weights = ("int8" if models[0].quantized else "stored") if formats else ecfg.dtype
        assert tokenizer is not None  # asked for
        params_per_pool = [m.state for m in models]
        del models
        t_load = time.perf_counter() - t0
        c_load = clock.seconds()

        t1 = time.perf_counter()
        runners = [
            Runner(model_cfg, graphdef, params, s.layout, ecfg, ds)
            for s, ds, params in zip(specs, device_sets, params_per_pool, strict=True)
        ]
        del params_per_pool
        drafts = draft_runners(ecfg.draft_model, root, tokenizer, runners) if ecfg.draft_model else []
        if job is not None and not job.leader:
            return follow(runners[0], job.channel, drafts[0] if drafts else None)
        if job is not None:
            runners[0].channel = job.channel
            gateway.channel = job.channel
            for draft in drafts:
                draft.channel = DraftChannel(job.channel)
        # The pools' sizes as resolved (service.engine.kv_pool); requests are held to the least.
        tokens = min(r.ecfg.kv_cache_tokens for r in runners)
        ecfg = dataclasses.replace(ecfg, kv_cache_tokens=tokens, kv_cache_memory=0)
        gateway.cfg = cfg = dataclasses.replace(cfg, engine=ecfg)
        # A request's pages all come from one data replica's pool.
        gateway.max_request_tokens = min(r.max_request_tokens for r in runners)
        t_place = time.perf_counter() - t1
        c_place = clock.seconds() - c_load

        proposers = [DraftModelProposer(d, ecfg.speculative_tokens, ecfg.draft_p_min) for d in drafts]

        t2 = time.perf_counter()
        pools = []
        for i, (spec, ds, runner) in enumerate(zip(specs, device_sets, runners, strict=True)):
            loop = make_loop(runner, cfg.max_queue, proposer=proposers[i] if proposers else None)
            pool = Pool(name=spec.name, devices=ds, loop=loop, is_default=i == 0)
            gateway.add_pool(pool)
            pool.loop.start(warmup_full=cfg.warmup_full)
            pools.append(pool)
        for pool in pools:
            while not pool.loop.ready.wait(0.2):
                if pool.loop.error is not None:
                    raise RuntimeError(f"pool {pool.name}: engine warm-up failed: {pool.loop.error!r}")
        t_warm = time.perf_counter() - t2
        c_warm = clock.seconds() - c_load - c_place
    loaded = "restore" if kind == "checkpoint" else "load"
    log.info(
        "model %s (%s) ready in %.1f s: %s %.1f s, place+KV %.1f s, compile %.1f s, warm-up %.1f s; "
        "pools: %s; %d rows, requests up to %d tokens; %s weights, %s KV cache",
        path.name, kind, time.perf_counter() - t0, loaded, t_load - c_load, max(t_place - c_place, 0.0),
        clock.seconds(), max(t_warm - c_warm, 0.0),
        ", ".join(f"{p.name}={p.layout.name} on devices {p.device_ids}" for p in pools),
        ecfg.num_slots, gateway.max_request_tokens, describe_weights(weights, formats, ecfg.dtype),
        runners[0].ecfg.kv_dtype,
    )  # fmt: skip
    gateway.metrics.set_weights(weights, formats)
    gateway.tokenizer = tokenizer
    gateway.grammars = Grammars(tokenizer, model_cfg.vocab_size)
    gateway.facts = ModelFacts(
        name=path.stem if kind == "gguf" else path.name,
        path=path,
        kind=kind,
        cfg=model_cfg,
        weights=weights,
        formats=formats,
        startup_seconds={
            loaded: t_load - c_load,
            "place": max(t_place - c_place, 0.0),
            "compile": clock.seconds(),
            "warmup": max(t_warm - c_warm, 0.0),
        },
    )
    return 0
