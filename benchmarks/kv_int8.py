"""The served engine's decode step with an 8-bit KV cache against float32 and bfloat16 ones, at a
long context, in one process (issue 43's target: int8 at 8,192 tokens and batch 8 within 0.8x
of float32's step time).

Three variants of the served engine (a ``service.engine.runner.Runner`` on one CPU device, the
kernels ``model.kernels.choose`` picks there: the native attention and matmuls; random weights
at the model's shapes, float32: values do not change speed) differ only in
``EngineConfig.kv_dtype`` (``--kv-dtypes``): ``float32`` and ``int8`` (each row's codes and
float16 scale, ``model.attention.pages.to_stored``), and ``bfloat16`` when asked: its pages'
scatter costs seconds a step at such pools on XLA:CPU (docs/performance.md says why). Each has B rows at positions drawn around
``--context`` (+-16, the same for every variant) over pages of their own, and steps one flat
batch of B decode tokens (``benchmarks.native_decode.decode_batch``) again and again, so every
step does the same work: a decode-only step's time is the TPOT of its B streams. The pool holds
zeros (what the pages hold does not change what the kernels read). The variants take turns
(``benchmarks.native_decode.time_in_turns``: ``--rounds`` rounds of one warm step then three
timed steps each); it prints each one's pool
bytes, min and median step time and the median's ratio to float32's, and whether int8 meets
the target.

    python benchmarks/kv_int8.py                          # SmolLM2-135M shapes, B = 8, context 8,192
    python benchmarks/kv_int8.py --batches 1 8 --context 2048 --rounds 4
    python benchmarks/kv_int8.py --kv-dtypes float32 bfloat16 int8 --rounds 2

The model config is read from the default GGUF (``meshserve fetch`` first) or ``--model``.
Results: docs/performance.md, "An 8-bit KV cache".
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/kv_int8.py` from a checkout

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.native_decode import decode_batch, time_in_turns  # noqa: E402
from model import native  # noqa: E402
from model.weights.build import random_llama  # noqa: E402
from model.weights.fetch import default_model_path  # noqa: E402
from model.weights.loader import read_model_config  # noqa: E402
from service.engine.batch import RowInstall  # noqa: E402
from service.engine.config import EngineConfig  # noqa: E402
from service.engine.request import SamplingOptions  # noqa: E402
from service.engine.runner import Runner  # noqa: E402
from sharding.layouts import load_layout  # noqa: E402

KV_DTYPES = ("float32", "bfloat16", "int8")
TARGET_RATIO = 0.8  # int8's step time over float32's, at most


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF or HF directory whose config to use (default: SmolLM2-135M)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8], help="rows per step")
    ap.add_argument("--context", type=int, default=8192, help="mean cached tokens per row (spread +-16)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds of 3 steps per variant")
    ap.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES, default=["float32", "int8"], help="the variants")
    args = ap.parse_args(argv)
    kv_dtypes = ["float32", *(k for k in args.kv_dtypes if k != "float32")]  # float32 is the reference

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

    met = True
    for B in args.batches:
        positions = np.random.default_rng(B).integers(lo, hi + 1, B).astype(np.int32)
        greedy = tuple(RowInstall(r, SamplingOptions(temperature=0.0), False, ()) for r in range(B))
        runs: dict[str, tuple[Runner, Any]] = {}
        for kv in kv_dtypes:
            ecfg = EngineConfig(num_slots=B, max_seq_len=hi + 1, kv_dtype=kv, kv_cache_tokens=B * (hi + 1))
            runner = Runner(cfg, graphdef, params, load_layout("1x1"), ecfg, device)
            runner.step(decode_batch(runner, positions, greedy)).host()  # compiles, installs greedy rows
            if args.batches[0] == B:
                print(f"  {kv}: {runner.kernels.describe()}; pool {runner.cache.nbytes() / 2**20:.0f} MiB")
            runs[kv] = (runner, decode_batch(runner, positions))
        times = time_in_turns(runs, args.rounds)
        medians = {k: statistics.median(t) for k, t in times.items()}
        cols = "; ".join(
            f"{k} min {min(times[k]):6.1f} median {medians[k]:6.1f} ms ({medians[k] / medians['float32']:.2f}x)"
            for k in kv_dtypes
        )
        if "int8" in medians:
            ratio = medians["int8"] / medians["float32"]
            met &= ratio <= TARGET_RATIO
            cols += f"; int8 / float32 {ratio:.2f} (target <= {TARGET_RATIO}: {'PASS' if ratio <= TARGET_RATIO else 'FAIL'})"
        print(f"B={B:3d}: {cols}")
        del runs
    return 0 if met else 2


if __name__ == "__main__":
    raise SystemExit(main())
