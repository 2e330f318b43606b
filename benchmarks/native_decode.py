"""The served engine's decode step with XLA's kernels against the native CPU kernels, in one process.

Three variants of the served engine (a ``service.engine.runner.Runner`` on one CPU device, the
scanned layers, random weights at the model's shapes: values do not change speed) differ only in
the kernels ``model.kernels.choose`` picks (``EngineConfig.attention`` and ``matmul``):

* ``xla``: attention "xla", matmul "xla": XLA's attention (gathers and dots over the window the
  step's positions need) and XLA's matmuls;
* ``attention``: attention "auto", matmul "xla": the native paged attention kernels
  (``model.attention.cpu``, reading each row's pages in place up to its position), XLA's
  matmuls;
* ``native``: attention and matmul "auto": the native attention and the float32 weights packed
  into panels for the native matmul (``model.native.cpu_matmul``): what ``serve`` runs on one
  CPU device.

For each batch size B, each variant's runner has B rows, each at its own position drawn around
``--context`` (+-16, the same for every variant), and steps one flat batch of B decode tokens
(the decode region, every row sampling greedily) again and again at those positions, so every
step does the same work. The variants take turns, ``--rounds`` rounds of one warm step then
three timed steps each (dispatched back to back; each step's pool is the one the previous step
donated, so they run one after another), so all see the same machine state. For each batch size
it prints the min and median step time (ms) of each and the ratio of ``xla``'s median to each
(above 1: faster than XLA). The kernels are built for ``$MESHSERVE_NATIVE_MARCH`` (default
``native``); the header names the build's vector ISA. Results: docs/cpu-kernels.md.

    python benchmarks/native_decode.py                        # SmolLM2-135M shapes, B = 1 8 64
    python benchmarks/native_decode.py --batches 64 --context 1000 --rounds 8
    python benchmarks/native_decode.py --batches 8 --context 2048 --kv-dtype int8   # an 8-bit cache
    MESHSERVE_NATIVE_MARCH=x86-64-v3 python benchmarks/native_decode.py   # the AVX2 build

The model config is read from the default GGUF (``meshserve fetch`` first) or ``--model``.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/native_decode.py` from a checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402

from model import native  # noqa: E402
from model.weights.build import random_llama  # noqa: E402
from model.weights.fetch import default_model_path  # noqa: E402
from model.weights.loader import read_model_config  # noqa: E402
from service.engine.batch import RowInstall  # noqa: E402
from service.engine.config import EngineConfig  # noqa: E402
from service.engine.request import SamplingOptions  # noqa: E402
from service.engine.runner import Runner  # noqa: E402
from sharding.layouts import load_layout  # noqa: E402

VARIANTS = {"xla": ("xla", "xla"), "attention": ("auto", "xla"), "native": ("auto", "auto")}  # (attention, matmul)


def decode_batch(runner: Runner, positions: np.ndarray, installs: tuple[RowInstall, ...] = ()) -> Any:
    """Every row's decode token (id 0) at its own position, each row over its own pages."""
    g = runner.geometry
    B = len(positions)
    b = g.empty_batch(g.decode_bucket(B), 0)
    rows = np.arange(B, dtype=np.int32)
    b.positions[:B], b.rows[:B], b.generated[:B], b.last_index[:B] = positions, rows, True, rows
    b.page_tables[:B] = rows[:, None] * g.max_pages + np.arange(g.max_pages, dtype=np.int32)
    return dataclasses.replace(b, num_real=B, max_position=int(positions.max()), installs=installs)


def time_in_turns(runs: dict[str, tuple[Runner, Any]], rounds: int) -> dict[str, list[float]]:
    """Each variant's step times (ms), the variants ``runs`` (name -> (runner, batch)) taking
    turns: ``rounds`` rounds of one warm step then three timed steps each (dispatched back to
    back; each step's pool is the one the previous step donated, so they run one after another)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (runner, batch) in runs.items():
            runner.step(batch).host()
            t0 = time.perf_counter()
            for _ in range(3):
                out = runner.step(batch)
            out.host()
            times[name].append((time.perf_counter() - t0) / 3 * 1e3)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF or HF directory whose config to use (default: SmolLM2-135M)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="rows per step")
    ap.add_argument("--context", type=int, default=144, help="mean cached tokens per row (spread +-16)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds of 3 steps per variant")
    ap.add_argument(
        "--kv-dtype", choices=["float32", "bfloat16", "int8"], default="float32", help="every variant's cache"
    )
    args = ap.parse_args(argv)

    if not native.available():
        print("the native kernels could not be built (see the warning above)")
        return 1
    cfg = read_model_config(Path(args.model) if args.model else default_model_path())
    graphdef, params = random_llama(cfg, 0)
    lo, hi = max(0, args.context - 16), args.context + 16
    device = jax.devices()[:1]
    print(f"{cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.q_per_kv} query heads x {cfg.head_dim}; "
          f"rows at {lo}-{hi} tokens; jax {jax.__version__} on {device[0].platform}; "
          f"kernels built for -march={native.march()} ({native.isa()})")  # fmt: skip

    for B in args.batches:
        positions = np.random.default_rng(B).integers(lo, hi + 1, B).astype(np.int32)
        greedy = tuple(RowInstall(r, SamplingOptions(temperature=0.0), False, ()) for r in range(B))
        runs: dict[str, tuple[Runner, Any]] = {}
        for name, (attention, matmul) in VARIANTS.items():
            ecfg = EngineConfig(
                num_slots=B, max_seq_len=hi + 1, attention=attention, matmul=matmul, layer_loop="scan",
                kv_cache_tokens=B * (hi + 1), kv_dtype=args.kv_dtype,
            )  # fmt: skip
            runner = Runner(cfg, graphdef, params, load_layout("1x1"), ecfg, device)
            runner.step(decode_batch(runner, positions, greedy)).host()  # compiles, installs greedy rows
            if args.batches[0] == B:
                print(f"  {name}: {runner.kernels.describe()}")
            runs[name] = (runner, decode_batch(runner, positions))
        times = time_in_turns(runs, args.rounds)
        medians = {k: statistics.median(t) for k, t in times.items()}
        cols = "; ".join(
            f"{k} min {min(times[k]):6.1f} median {medians[k]:6.1f} ms ({medians['xla'] / medians[k]:.2f}x)"
            for k in VARIANTS
        )
        print(f"B={B:3d}: {cols}")
        del runs
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
