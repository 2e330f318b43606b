"""``meshserve``: serve | generate | chat | fetch | layouts."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

import yaml

DEFAULT_ADDRESS = "127.0.0.1:50051"


def _serve_config(args: argparse.Namespace) -> Any:
    from service.server import ServerConfig

    values: dict[str, Any] = {}
    if args.config:
        loaded = yaml.safe_load(Path(args.config).read_text()) or {}
        known = {f.name for f in dataclasses.fields(ServerConfig)}
        unknown = set(loaded) - known
        if unknown:
            raise SystemExit(f"meshserve: unknown keys in {args.config}: {sorted(unknown)}; known: {sorted(known)}")
        values.update(loaded)
    for key in ("model", "cache_dir", "host", "port", "layout", "num_slots", "max_seq_len", "chunk_size",
                "max_queue", "default_max_tokens", "dtype"):  # fmt: skip
        value = getattr(args, key)
        if value is not None:
            values[key] = value
    if args.warmup_full:
        values["warmup_full"] = True
    return ServerConfig(**values)


def cmd_serve(args: argparse.Namespace) -> int:
    from service.server import serve_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = _serve_config(args)
    return asyncio.run(serve_forever(cfg))


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or None,
    }


def _stream_to_terminal(client: Any, request: Any) -> tuple[str, Any]:
    import grpc

    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    n = 0
    finish = usage = None
    try:
        for resp in client.stream(request):
            if ttft is None and resp.token_ids:
                ttft = time.perf_counter() - t0
            n += len(resp.token_ids)
            parts.append(resp.text)
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.finish_reason:
                finish, usage = resp.finish_reason, resp.usage
    except grpc.RpcError as exc:
        raise SystemExit(f"\nmeshserve: {exc.code().name}: {exc.details()}") from None
    total = time.perf_counter() - t0
    from protos.meshserve.v1 import meshserve_pb2 as pb

    rate = (n - 1) / (total - ttft) if ttft is not None and n > 1 and total > ttft else 0.0
    print(
        f"\n[{pb.FinishReason.Name(finish or 0)}; {usage.prompt_tokens if usage else 0} prompt + {n} generated tokens; "
        f"TTFT {1000 * (ttft or total):.0f} ms; decode {rate:.1f} tokens/s]",
        file=sys.stderr,
    )
    return "".join(parts), finish


def cmd_generate(args: argparse.Namespace) -> int:
    from service.client import Client, make_request

    client = Client(args.address)
    if args.wait:
        client.wait_serving(args.wait)
    if args.raw:
        request = make_request(prompt=args.prompt, **_sampling(args))
    else:
        chat = ([("system", args.system)] if args.system else []) + [("user", args.prompt)]
        request = make_request(chat=chat, **_sampling(args))
    _stream_to_terminal(client, request)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from service.client import Client, make_request

    client = Client(args.address)
    if args.wait:
        client.wait_serving(args.wait)
    history: list[tuple[str, str]] = [("system", args.system)] if args.system else []
    print("meshserve chat: an empty line or Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append(("user", line))
        sys.stdout.write("assistant> ")
        answer, _ = _stream_to_terminal(client, make_request(chat=history, **_sampling(args)))
        history.append(("assistant", answer))
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from model.fetch import resolve_model

    print(resolve_model(args.model, args.cache_dir))
    return 0


def cmd_layouts(args: argparse.Namespace) -> int:
    from sharding.layouts import load_layout, preset_names

    for name in preset_names():
        layout = load_layout(name)
        print(
            f"{name:12s} data {layout.data} x model {layout.model}  attention={layout.attention}  {layout.description}"
        )
    return 0


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=DEFAULT_ADDRESS, help="server host:port (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the server's, 1.0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message (default: the chat template's)")
    p.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for the server to be SERVING")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve", description="Sharded LLM inference over gRPC, in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the gRPC server")
    s.add_argument("--config", help="YAML file of ServerConfig keys (flags override it)")
    s.add_argument("--model", help="GGUF path (default: SmolLM2-135M-Instruct from PyPI)")
    s.add_argument("--cache-dir", help="model and compile cache (default $MESHSERVE_CACHE or ~/.cache/meshserve)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--layout", help="layout preset name or YAML path (see 'meshserve layouts')")
    s.add_argument("--num-slots", "--slots", dest="num_slots", type=int, help="decode slots")
    s.add_argument("--max-seq-len", type=int, help="tokens per slot: prompt + generated")
    s.add_argument("--chunk-size", type=int, help="prefill chunk, tokens")
    s.add_argument("--max-queue", type=int)
    s.add_argument("--default-max-tokens", type=int)
    s.add_argument("--dtype", choices=["float32", "bfloat16"])
    s.add_argument("--warmup-full", action="store_true", help="compile every shape variant before SERVING")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="stream one answer to the terminal, then print TTFT and tokens/s")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="send the prompt as raw text, without the chat template")
    _add_sampling_flags(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="multi-turn chat in the terminal")
    _add_sampling_flags(c)
    c.set_defaults(func=cmd_chat)

    f = sub.add_parser("fetch", help="download the default model (or check a local GGUF) and print its path")
    f.add_argument("--model")
    f.add_argument("--cache-dir")
    f.set_defaults(func=cmd_fetch)

    ly = sub.add_parser("layouts", help="list the layout presets")
    ly.set_defaults(func=cmd_layouts)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
