"""The ragged step's dispatch cost against the KV pool's size (issue 19's first target).

    python -m benchmarks.dispatch                                  # both configs, both layer loops
    python -m benchmarks.dispatch --configs smollm2-135m --layers scan --max-lens 256,2048 --json d.json

The served engine only: for each model config, layer loop (``EngineConfig.layer_loop``: "scan",
stacked weights in ``lax.scan``, or "unrolled", per-layer weights) and maximum length T, a
``service.engine.runner.Runner`` with ``--slots`` rows on one device and a pool of slots x T
tokens is built (random weights: values do not change speed; the kernels ``model.kernels.choose``
picks for the device, as ``serve`` runs them), each row over pages of its own. Every row is put
at the same position ``--position``, so each step does the same work (one decode token per row,
attending to positions 0 .. position: the native kernels read up to it, XLA's attention the
smallest window bucket covering it) and only the pool's size and the page tables' width (T /
page size) differ. After ``--warmup`` steps (the first compiles),
``--calls`` steps are run one after another, each as the sweep times its serial steps
(``benchmarks/sweep.py``):

* dispatch (``call_ms``): building the step's flat batch (``RaggedBatch``, its host arrays made
  anew each step, as the engine loop builds them) and the ``Runner.step`` call, until it
  returns, before the step's result is waited for: the jitted call's argument handling and
  dispatch;
* step (``step_ms``): the call plus the wait for its one host copy (``StepOutput.host``).

The medians are reported, with each step's argument leaves (``len(jax.tree.leaves(...))`` of
what the jitted step takes: the weights, the KV pool's arrays, and the rest: the batch's arrays,
the previous output, the sampling arrays and the token history), and, per (config, layer loop),
the ratio of the largest T's dispatch to the smallest's. Issue 19's target: <= 1 ms everywhere,
the largest within 1.2x of the smallest. The step's arguments are the same few arrays whatever
T (the pool is two arrays, K and V), so only their sizes grow with T. Results:
docs/performance.md (the paged engine's under issue 19's "Dispatch", the per-slot engine's
under "Dispatch cost"; not re-run since the tool times the ``Runner``).

Configs (``CONFIGS``): ``smollm2-135m`` (SmolLM2-135M's shapes: 30 layers, hidden 576, 9 query
and 3 KV heads of 64, MLP 1536, vocabulary 49152, tied), ``32-layer`` (the same widths with
Llama 3 8B's 32 layers, isolating the layer count) and ``tiny`` (``LlamaConfig.tiny()``, for
tests). The pool is float32 (4 bytes per value): T = 32768 is 1.5 GB per row for SmolLM2-135M;
a point expected to need more than the memory available when it starts (``memory_needed``) is
skipped, with the reason in its row. ``--json`` is rewritten after every point, so a run that is
killed keeps the points it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import check_writable_file
from service.server.arg_types import nonnegative_int, positive_int

DEFAULT_MAX_LENS = (256, 2048, 8192, 32768)
LAYER_LOOPS = ("scan", "unrolled")  # EngineConfig.layer_loop forms
TARGET_CALL_MS = 1.0  # issue 19: dispatch <= 1 ms at every maximum length ...
TARGET_RATIO = 1.2  # ... and the largest maximum length's within 1.2x of the smallest's
# The ragged step updates the donated pool in place (model/llama.py: each layer's write before
# its read), so a point holds one pool; the weights twice (the host copy and the placed one).
POOL_COPIES = 1
WEIGHT_COPIES = 2


def smollm2_135m(num_layers: int = 30) -> Any:
    """SmolLM2-135M's ``LlamaConfig``, optionally with another layer count."""
    from model.config import LlamaConfig

    return LlamaConfig.smollm2_135m(num_layers=num_layers)


def config(name: str) -> Any:
    """The ``LlamaConfig`` called ``name`` (a key of ``CONFIGS``).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    from model.config import LlamaConfig

    if name == "smollm2-135m":
        return smollm2_135m()
    if name == "32-layer":
        return smollm2_135m(num_layers=32)
    if name == "tiny":
        return LlamaConfig.tiny()
    raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")


CONFIGS = {
    "smollm2-135m": "SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads of 64, MLP 1536, vocab 49152)",
    "32-layer": "SmolLM2-135M's widths with Llama 3 8B's 32 layers",
    "tiny": "LlamaConfig.tiny() (2 layers, hidden 64), for tests",
}


def memory_needed(cfg: Any, max_len: int, slots: int) -> int:
    """Bytes a point is expected to hold at its peak: ``POOL_COPIES`` float32 pools of ``slots``
    x ``max_len`` positions, plus ``WEIGHT_COPIES`` float32 copies of the weights."""
    pool = cfg.kv_bytes_per_token(4) * max_len * slots
    return POOL_COPIES * pool + WEIGHT_COPIES * 4 * cfg.param_count()


def parse_max_lens(text: str) -> list[int]:
    """Comma-separated integers >= 2, kept in order: "256,2048" -> [256, 2048].

    Raises:
        argparse.ArgumentTypeError: a value that is not an integer >= 2, or an empty list.
    """
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"max lengths must be integers >= 2, got {text!r}")
    return values


def decode_batches(runner: Any, slots: int, position: int) -> Any:
    """A function of ``installs`` that builds one step's flat batch: ``slots`` decode tokens at
    ``position``, row s's token at index s of the decode region, over its own pages (s x
    max_pages onwards), built anew on every call, as the engine loop builds a batch each step."""
    import dataclasses as dc

    g = runner.geometry
    tables = np.arange(slots * g.max_pages, dtype=np.int32).reshape(slots, g.max_pages) % runner.num_pages

    def build(installs: tuple[Any, ...] = ()) -> Any:
        b = g.empty_batch(g.decode_bucket(slots), 0)
        rows = np.arange(slots, dtype=np.int32)
        b.positions[:slots], b.rows[:slots], b.generated[:slots], b.last_index[:slots] = position, rows, True, rows
        b.page_tables[:] = tables
        return dc.replace(b, num_real=slots, max_position=position, installs=installs)

    return build


def argument_leaves(runner: Any, sampling_leaves: int, batch: Any) -> dict[str, int]:
    """The leaves of the jitted step's arguments (``Runner._jit``'s ``run``), by group:
    "params" (the weights, in the form the kernels take), "cache" (the KV pool's arrays),
    "other" (the batch's host arrays: tokens, source, positions, rows, generated, page tables,
    last_index, ban_eos; the previous step's output; the ``sampling_leaves`` sampling arrays;
    the token history of the penalties), and "total"."""
    import jax

    host = (batch.tokens, batch.source, batch.positions, batch.rows, batch.generated, batch.page_tables,
            batch.last_index, batch.ban_eos)  # fmt: skip
    counts = {
        "params": len(jax.tree.leaves(runner.params)),
        "cache": len(jax.tree.leaves(runner.cache)),
        "other": len(host) + 1 + sampling_leaves + len(jax.tree.leaves(runner.history)),
    }
    counts["total"] = sum(counts.values())
    return counts


def measure(
    name: str, layers: str, max_len: int, slots: int, position: int, calls: int, warmup: int, seed: int = 0
) -> dict[str, Any]:
    """One point: build the runner, step it ``warmup`` + ``calls`` times with every row at
    ``position``, and return its row (times in ms and s; see the module docstring).

    Raises:
        ValueError: ``position`` is not below ``max_len``.
    """
    import jax

    from model.sampling import SamplingParams
    from model.weights.build import random_llama
    from service.engine.batch import RowInstall
    from service.engine.config import EngineConfig
    from service.engine.request import SamplingOptions
    from service.engine.runner import Runner
    from sharding.layouts import load_layout

    if position >= max_len:
        raise ValueError(f"position {position} must be below the max length {max_len}")
    cfg = config(name)
    graphdef, params = random_llama(cfg, seed)
    ecfg = EngineConfig(num_slots=slots, max_seq_len=max_len, layer_loop=layers, kv_cache_tokens=slots * max_len)
    t0 = time.perf_counter()
    runner = Runner(cfg, graphdef, params, load_layout("1x1"), ecfg, jax.devices()[:1])
    setup_s = time.perf_counter() - t0
    del params
    build = decode_batches(runner, slots, position)

    def decode(installs: tuple[Any, ...] = ()) -> Any:
        return runner.step(build(installs))

    # Every step writes the same position of each row and attends to positions 0..position:
    # the work is the same step after step, and the same at every max length. The first step
    # installs every row's sampling (greedy), as the loop's first step of a request does.
    greedy = tuple(RowInstall(s, SamplingOptions(temperature=0.0), False, ()) for s in range(slots))
    t0 = time.perf_counter()
    decode(greedy).host()
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        decode().host()
    call_s, step_s = [], []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = decode()
        t1 = time.perf_counter()
        out.host()
        t2 = time.perf_counter()
        call_s.append(t1 - t0)
        step_s.append(t2 - t0)
    step = statistics.median(step_s)
    sampling = len(jax.tree.leaves(SamplingParams(**SamplingParams.host(slots))))
    leaves = argument_leaves(runner, sampling, build())
    row: dict[str, Any] = {
        "config": name,
        "layers": runner.ecfg.layer_loop,
        "max_seq_len": max_len,
        "slots": slots,
        "position": position,
        "status": "ok",
        "pool_pages": runner.num_pages,
        "page_size": runner.ecfg.page_size,
        "window_pages": runner.geometry.window(position),
        "attention": runner.kernels.attention.name,
        "native_attention": runner.kernels.attention.native,
        "native_matmul": runner.kernels.panels,
        "leaves": leaves,
        "cache_bytes": int(sum(a.nbytes for a in jax.tree.leaves(runner.cache))),
        "setup_s": setup_s,
        "first_call_s": first_s,
        "compile_s": max(0.0, first_s - step),
        "calls": calls,
        "call_ms": 1e3 * statistics.median(call_s),
        "call_min_ms": 1e3 * min(call_s),
        "step_ms": 1e3 * step,
        "step_min_ms": 1e3 * min(step_s),
    }
    row["call_share"] = row["call_ms"] / row["step_ms"]
    return row


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (config, layer loop) with at least one measured row: the smallest and largest
    measured max lengths, their dispatch medians, largest / smallest, and whether the issue's
    target holds (every dispatch <= ``TARGET_CALL_MS``, the ratio <= ``TARGET_RATIO``)."""
    out = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["status"] == "ok":
            groups.setdefault((r["config"], r["layers"]), []).append(r)
    for (name, layers), rs in groups.items():
        small = min(rs, key=lambda r: r["max_seq_len"])
        large = max(rs, key=lambda r: r["max_seq_len"])
        ratio = large["call_ms"] / small["call_ms"]
        worst = max(r["call_ms"] for r in rs)
        out.append(
            {
                "config": name,
                "layers": layers,
                "smallest": small["max_seq_len"],
                "largest": large["max_seq_len"],
                "call_ms_smallest": small["call_ms"],
                "call_ms_largest": large["call_ms"],
                "ratio": ratio,
                "step_ratio": large["step_ms"] / small["step_ms"],
                "target_met": worst <= TARGET_CALL_MS and ratio <= TARGET_RATIO,
            }
        )
    return out


def format_row(r: dict[str, Any]) -> str:
    head = f"{r['config']:>12s} {r['layers']:>8s} T={r['max_seq_len']:<6d}"
    if r["status"] != "ok":
        return f"{head} {r['status']}"
    lv = r["leaves"]
    return (
        f"{head} dispatch {r['call_ms']:8.2f} ms (min {r['call_min_ms']:7.2f})  step {r['step_ms']:8.2f} ms  "
        f"dispatch/step {r['call_share']:5.1%}  leaves {lv['total']:6d} (cache {lv['cache']}, params {lv['params']}, "
        f"other {lv['other']})  cache {r['cache_bytes'] / 1e6:9.1f} MB  compile {r['compile_s']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the rows, the ratios and the target's verdict; write ``--json``.
    Returns 0 when every point was measured or skipped for memory and at least one was measured,
    1 otherwise."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["smollm2-135m", "32-layer"])
    ap.add_argument(
        "--layers", nargs="+", choices=LAYER_LOOPS, default=list(LAYER_LOOPS), help="EngineConfig.layer_loop forms"
    )
    ap.add_argument(
        "--max-lens",
        type=parse_max_lens,
        default=list(DEFAULT_MAX_LENS),
        help="comma-separated max_seq_len values; the pool holds slots x each (default %(default)s; see the memory "
        "line printed first)",
    )
    ap.add_argument("--slots", type=positive_int, default=4, help="decoding rows (%(default)s)")
    ap.add_argument("--position", type=nonnegative_int, default=64, help="every row's position (%(default)s)")
    ap.add_argument("--calls", type=positive_int, default=20, help="timed steps per point (%(default)s)")
    ap.add_argument("--warmup", type=nonnegative_int, default=3, help="untimed steps after the first (%(default)s)")
    ap.add_argument("--json", help="write the rows, ratios and machine facts to this file")
    args = ap.parse_args(argv)
    if args.json:
        check_writable_file(args.json, ap.prog)
    if args.position >= min(args.max_lens):
        raise SystemExit(f"{ap.prog}: --position {args.position} must be below every max length")

    import jax

    from model import native
    from service.engine.kv_pool import host_available_bytes

    devices = jax.devices()
    free = host_available_bytes()
    print(
        f"{ap.prog}: jax {jax.__version__} on {devices[0].platform} ({devices[0].device_kind}), "
        f"{os.cpu_count()} CPU cores; native kernels: "
        f"{'built for -march=' + native.march() + ' (' + native.isa() + ')' if native.available() else 'unavailable'}; "
        f"{args.slots} rows at position {args.position}, {args.calls} timed steps after {args.warmup} + 1"
    )
    for name in args.configs:
        cfg = config(name)
        per_token = cfg.kv_bytes_per_token(4)  # float32 pool
        sizes = ", ".join(f"T={t}: {per_token * t / 1e6:.1f} MB per row" for t in args.max_lens)
        print(f"  {name}: KV pool {per_token / 1e3:.1f} kB per token (float32); {sizes}; x {args.slots} rows")
    if free is not None:
        print(f"  memory available now: {free / 1e9:.1f} GB (points expected to need more are skipped)")
    meta = {
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "native_kernels": native.available(),
        "args": {k: v for k, v in vars(args).items() if k != "json"},
        "configs": {name: dataclasses.asdict(config(name)) for name in args.configs},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }

    def write_json(rows: list[dict[str, Any]]) -> None:
        if args.json:
            Path(args.json).write_text(
                json.dumps({"meta": meta, "rows": rows, "ratios": ratios(rows)}, indent=1) + "\n"
            )

    rows: list[dict[str, Any]] = []
    for name in args.configs:
        cfg = config(name)
        for layers in args.layers:
            for max_len in args.max_lens:
                need = memory_needed(cfg, max_len, args.slots)
                if free is not None and need > free:
                    row = {"config": name, "layers": layers, "max_seq_len": max_len, "slots": args.slots,
                           "status": f"skipped: needs about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB available"}  # fmt: skip
                else:
                    try:
                        row = measure(name, layers, max_len, args.slots, args.position, args.calls, args.warmup)
                    except Exception as exc:  # one failed point must not lose the others
                        row = {"config": name, "layers": layers, "max_seq_len": max_len, "slots": args.slots,
                               "status": f"error: {type(exc).__name__}: {exc}"}  # fmt: skip
                rows.append(row)
                print(format_row(row), flush=True)
                write_json(rows)
                gc.collect()  # the runner's pool and weights, before the next point reads the free memory
                free = host_available_bytes()

    summary = ratios(rows)
    for s in summary:
        verdict = "met" if s["target_met"] else "missed"
        print(
            f"{s['config']:>12s} {s['layers']:>8s}: dispatch T={s['largest']} / T={s['smallest']} = {s['ratio']:.2f}x "
            f"({s['call_ms_largest']:.2f} / {s['call_ms_smallest']:.2f} ms), step {s['step_ratio']:.2f}x; "
            f"target (<= {TARGET_CALL_MS:g} ms, <= {TARGET_RATIO:g}x): {verdict}"
        )
    if args.json:
        print(f"{ap.prog}: wrote {args.json}", file=sys.stderr)
    ok = [r for r in rows if r["status"] == "ok"]
    return 0 if ok and all(r["status"] == "ok" or r["status"].startswith("skipped") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
