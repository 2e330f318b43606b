"""The unrolled decode step with XLA's dots against the native CPU kernels, in one process.

Three variants (four on CPUs with AMX) of ``model.llama.decode_step`` are compiled for the same model config (random
weights: values do not change speed), a ``BlockedKVCache`` and the same slot positions, then
timed alternately, so all see the same machine state:

* ``xla``: XLA's attention dots and scatters, XLA's matmuls;
* ``attention``: the native attention + KV-write kernel (``model.cpu_attention``), XLA's matmuls;
* ``native``: both native kernels: attention and the panel-packed weight matmuls
  (``model.native.cpu_matmul``), at every batch size (``Engine`` takes the matmuls only where
  ``cpu_matmul.faster_than_xla`` says they win on this build);
* ``bf16x3`` (where the CPU has AMX-BF16): native attention and the AMX bf16x3 matmuls
  (``EngineConfig.matmul="bf16x3"``: float32 weights as two bfloat16 halves).

For each batch size it prints the min and median step time (ms) of each and the ratio of each
median to ``xla``'s (above 1: faster than XLA). The kernels are built for
``$MESHSERVE_NATIVE_MARCH`` (default ``native``); the header names the build's vector ISA.
Results: docs/cpu-kernels.md.

    python benchmarks/native_decode.py                        # SmolLM2-135M shapes, B = 1 8 64
    python benchmarks/native_decode.py --batches 64 --context 1000 --rounds 8
    MESHSERVE_NATIVE_MARCH=x86-64-v3 python benchmarks/native_decode.py   # the AVX2 build

The model config is read from the default GGUF (``meshserve fetch`` first) or ``--model``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/native_decode.py` from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from model import native_kernels  # noqa: E402
from model.weights.fetch import default_model_path  # noqa: E402
from model.kernels import NATIVE_CPU, XLA  # noqa: E402
from model.kv_cache import BLOCK_LEN, BlockedKVCache  # noqa: E402
from model.llama import decode_step, unstack_layers  # noqa: E402
from model.weights.loader import random_llama, read_model_config  # noqa: E402
from model.weights.packed_weights import panel_weights  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF or HF directory whose config to use (default: SmolLM2-135M)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="slots per step")
    ap.add_argument("--context", type=int, default=144, help="mean cached tokens per slot (spread +-16)")
    ap.add_argument("--rounds", type=int, default=6, help="timed rounds of 3 steps per variant")
    args = ap.parse_args(argv)

    if not native.available():
        print("the native kernels could not be built (see the warning above)")
        return 1
    cfg = read_model_config(Path(args.model) if args.model else default_model_path())
    graphdef, params = random_llama(cfg, 0)
    params = unstack_layers(params)
    panels = panel_weights(nnx.merge(graphdef, params))
    variants = {"xla": (False, None), "attention": (True, None), "native": (True, panels)}
    if native.amx_available():
        variants["bf16x3"] = (True, panel_weights(nnx.merge(graphdef, params), format="bf16x3"))
    lo = max(0, args.context - 16)
    window = -(-(args.context + 17) // BLOCK_LEN) * BLOCK_LEN
    print(f"{cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.q_per_kv} query heads x {cfg.head_dim}; "
          f"slots at {lo}-{args.context + 16} tokens, window {window}; jax {jax.__version__} on {jax.devices()[0].platform}; "
          f"kernels built for -march={native.march()} ({native.isa()})")  # fmt: skip

    def compiled(variant: str, cache: BlockedKVCache, tokens: jax.Array, positions: jax.Array):  # type: ignore[no-untyped-def]
        native, packed = variants[variant]

        def step(p, w, c, t, pos):  # type: ignore[no-untyped-def]
            model = nnx.merge(graphdef, p)
            return decode_step(model, c, t, pos, kv_len=window, kernels=NATIVE_CPU if native else XLA, panels=w)

        fn = jax.jit(step, donate_argnums=2).lower(params, packed, cache, tokens, positions).compile()
        return lambda c, t, pos: fn(params, packed, c, t, pos)

    for B in args.batches:
        tokens = jnp.zeros(B, jnp.int32)
        positions = jnp.asarray(np.random.default_rng(B).integers(lo, args.context + 17, B), jnp.int32)
        runs = {}
        for name in variants:
            cache = BlockedKVCache.zeros(cfg, B, window)
            runs[name] = [compiled(name, cache, tokens, positions), cache, []]
        for _ in range(args.rounds):
            for run in runs.values():
                fn, cache, times = run
                out, cache = fn(cache, tokens, positions)
                out.block_until_ready()
                t0 = time.perf_counter()
                for _ in range(3):
                    out, cache = fn(cache, tokens, positions)
                out.block_until_ready()
                times.append((time.perf_counter() - t0) / 3 * 1e3)
                run[1] = cache
        medians = {k: statistics.median(r[2]) for k, r in runs.items()}
        cols = "; ".join(
            f"{k} min {min(runs[k][2]):6.1f} median {medians[k]:6.1f} ms ({medians['xla'] / medians[k]:.2f}x)"
            for k in variants
        )
        print(f"B={B:3d}: {cols}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
