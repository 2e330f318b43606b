"""The quantized-weight matmul kernel against XLA and the float32 panel kernel, in one process.

For SmolLM2-135M's matmul shapes (K x N: 576 x 960 fused QKV, 576 x 576 wo, 576 x 3072 fused
gate/up, 1536 x 576 down, 576 x 49152 LM head; or Qwen2.5-Coder-1.5B's, whose K the K-quants'
256-weight blocks divide), for each batch size M and each format (Q4_1 and Q8_0 by default; random
codes and scales: values do not change speed), these are jitted with the
weights as arguments and timed alternately, so all see the same machine state:

* ``kernel``: ``model.native.quant_matmul.matmul`` on the ``QuantPanels`` (its own choice of path);
* ``direct`` / ``dequant`` (with ``--paths``): the kernel forced onto one of its two paths;
* ``xla_q``: ``quant_panels.xla_matmul``, XLA's dequantization then its float32 dot (the path
  the engine would take without the kernel);
* ``xla_f32``: XLA's float32 dot on the weights dequantized beforehand (float32 weights held);
* ``panels``: ``model.native.cpu_matmul.matmul`` on the dequantized weights packed as float32 panels.

It prints the kernel's median time per call (ms), each other variant's median over the
kernel's (above 1: the kernel is faster), and the weight bytes the kernel streams per second
(codes, scales and minimums once per call). The kernels are built for
``$MESHSERVE_NATIVE_MARCH`` (default ``native``); the header names the build's vector ISA.
Results: docs/cpu-kernels.md.

    python benchmarks/quant_matmul.py                          # M = 1 8 32 64 256, Q4_1 and Q8_0
    python benchmarks/quant_matmul.py --rows 1 4 8 16 --formats q4_1 --paths --json out.json
    python benchmarks/quant_matmul.py --rows 1 8 --formats q4_k q6_k q5_0 --shapes qwen_gate_up qwen_down
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/quant_matmul.py` from a checkout

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from model import native  # noqa: E402
from model.native import cpu_matmul, quant_matmul  # noqa: E402
from model.weights import quant_panels, record_panels  # noqa: E402

SHAPES = {  # name -> (K, N): SmolLM2-135M's, then Qwen2.5-Coder-1.5B's (K whole K-quant blocks of 256)
    "qkv": (576, 960),
    "wo": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "lm_head": (576, 49152),
    "qwen_qkv": (1536, 2048),
    "qwen_gate_up": (1536, 17920),
    "qwen_down": (8960, 1536),
    "qwen_lm_head": (1536, 151936),
}
DEFAULT_SHAPES = ["qkv", "wo", "gate_up", "down", "lm_head"]


def random_panels(rng: np.random.Generator, fmt: str, k: int, n: int) -> quant_panels.QuantPanels:
    """Random GGUF rows of ``fmt`` (codes uniform, scales and minimums small normals) packed."""
    if fmt in record_panels.RECORD_FORMATS:
        ku, size = k // record_panels.RECORD_FORMATS[fmt].unit, record_panels.SOURCE_BYTES[fmt]
        raw = rng.integers(0, 256, (n, ku, size), dtype=np.uint8)
        for at in record_panels.SOURCE_HALVES[fmt]:  # the float16 fields: d (and dmin)
            raw[..., at : at + 2] = (rng.standard_normal((n, ku, 1)) * 1e-3).astype(np.float16).view(np.uint8)
        codes = record_panels.decode(raw.reshape(n, ku * size), fmt, k)
        return quant_panels.pack_records(record_panels.convert(codes, fmt), (n,))
    kb, size = k // 32, quant_panels.BLOCK_BYTES[fmt]
    raw = rng.integers(0, 256, (n, kb, size), dtype=np.uint8)
    raw[..., 0:2] = (rng.standard_normal((n, kb, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if fmt == "q4_1":
        raw[..., 2:4] = (rng.standard_normal((n, kb, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return quant_panels.pack_rows(raw.reshape(n, kb * size), fmt, k, (n,))


def time_variants(fns: dict[str, Callable[[], jax.Array]], rounds: int, target_s: float) -> dict[str, float]:
    """Median seconds per call of each fn, calls alternated round by round."""
    reps = {}
    for name, fn in fns.items():  # compile, warm, and size each round to about target_s
        fn().block_until_ready()
        t0 = time.perf_counter()
        fn().block_until_ready()
        reps[name] = max(1, min(50, int(target_s / max(time.perf_counter() - t0, 1e-6))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(reps[name]):
                out = fn()
            out.block_until_ready()
            times[name].append((time.perf_counter() - t0) / reps[name])
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256], help="batch sizes M")
    ap.add_argument("--formats", nargs="+", default=["q4_1", "q8_0"], choices=quant_panels.FORMATS)
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, choices=list(SHAPES),
                    help="matrices (SmolLM2's by default; the qwen_* ones take the record formats)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per variant (median taken)")
    ap.add_argument("--round-ms", type=float, default=30.0, help="about this long per round and variant")
    ap.add_argument("--paths", action="store_true", help="also time the kernel forced onto each path")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)

    if not native.available():
        print("the native kernels could not be built (see the warning above)")
        return 1
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; kernels built for "
          f"-march={native.march()} ({native.isa()}); median of {args.rounds} rounds; "
          f"ratios: variant's time / kernel's (above 1: the kernel is faster)")  # fmt: skip
    rng = np.random.default_rng(0)
    kernel = jax.jit(quant_matmul.matmul, static_argnames="path")
    xla_q = jax.jit(quant_panels.xla_matmul)
    xla_f32 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
    panels_mm = jax.jit(cpu_matmul.matmul)
    results: list[dict[str, Any]] = []
    for fmt in args.formats:
        for shape in args.shapes:
            k, n = SHAPES[shape]
            unit = record_panels.RECORD_FORMATS[fmt].unit if fmt in record_panels.RECORD_FORMATS else 32
            if k % unit:
                print(f"{fmt} {shape:8s} {k:5d}x{n:<6d}: skipped (K is not whole {unit}-weight blocks)")
                continue
            w = jax.tree.map(jnp.asarray, random_panels(rng, fmt, k, n))
            w32 = quant_panels.dequantize(w)
            p32 = cpu_matmul.pack(w32, 1)
            for m in args.rows:
                x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
                fns: dict[str, Callable[[], jax.Array]] = {"kernel": partial(kernel, x, w)}
                if args.paths:
                    fns["direct"] = partial(kernel, x, w, path="direct")
                    fns["dequant"] = partial(kernel, x, w, path="dequantized")
                fns["xla_q"] = partial(xla_q, x, w)
                fns["xla_f32"] = partial(xla_f32, x, w32)
                fns["panels"] = partial(panels_mm, x, p32)
                t = time_variants(fns, args.rounds, args.round_ms / 1e3)
                gbs = w.nbytes / t["kernel"] / 1e9
                ratios = "  ".join(f"{name} {t[name] / t['kernel']:5.2f}x" for name in fns if name != "kernel")
                print(f"{fmt} {shape:8s} {k:5d}x{n:<6d} M={m:4d}: kernel {t['kernel'] * 1e3:8.3f} ms "
                      f"{gbs:6.1f} GB/s  {ratios}", flush=True)  # fmt: skip
                results.append({"format": fmt, "shape": shape, "k": k, "n": n, "m": m, "gb_per_s": gbs,
                                **{f"{name}_ms": s * 1e3 for name, s in t.items()}})  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
