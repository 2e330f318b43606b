"""What bounds a batch-1 decode step of the served engine on this CPU: its fixed cost and its bytes.

A decode step at batch 1 costs a fixed part (dispatch, the layer loop, the elementwise work, the
kernels' calls and thread hand-offs: the same whatever the weights' sizes) plus the time to
stream its weights from memory. This script measures both, in one run, on the served default
(the ``Runner`` through its engine loop, weights as stored):

* ``floor``: the step of a model with the measured model's layer count and weight formats but
  tiny widths (hidden 64, one head of 64, MLP 128, vocabulary 256): the same programs' shape, a
  few kilobytes of weights, so its TPOT is the fixed part;
* ``model``: the real model's TPOT (SmolLM2-135M Q4_1 by default, its blocks as stored);
* ``read``: the streaming read bandwidth of all cores (``benchmarks/cpu_ceilings.py``'s probe).

From them it prints the best TPOT the machine allows, ``floor + weight bytes / read`` (weights
read once per step at the full streaming rate, nothing else slower), the share of the streaming
rate the measured step reaches on its weights, ``bytes / (model - floor)``, and, for a target
TPOT (``--target-ms``, e.g. 0.6 x llama.cpp's from ``benchmarks/peers.py``), the share of the
streaming rate the target needs. TPOTs are medians of ``--rounds`` rounds, the two engines
alternating. Figures measured with it are in docs/performance.md.

    python benchmarks/decode_floor.py
    python benchmarks/decode_floor.py --target-ms 6.1 --rounds 7
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/decode_floor.py` from a checkout

import jax  # noqa: E402

from benchmarks import cpu_ceilings  # noqa: E402
from benchmarks.peers import MeshserveRunner  # noqa: E402
from model.config import LlamaConfig  # noqa: E402
from model.weights.build import random_block_llama  # noqa: E402
from model.weights.fetch import resolve_model  # noqa: E402
from model.weights.loader import load_model  # noqa: E402
from model.weights.quant_panels import QuantPanels  # noqa: E402


def shrunk(cfg: LlamaConfig) -> LlamaConfig:
    """``cfg`` with its layer count and tying but tiny widths (every matmul width a multiple of 32,
    so block formats hold them as they hold the real model's)."""
    return dataclasses.replace(
        cfg, vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=1, num_kv_heads=1, head_dim=64
    )


def layer_format(state: Any) -> str:
    """The block format of the model's layer matmuls ("q4_1", ...), or "float32" when they are floats."""
    for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, QuantPanels)):
        if isinstance(leaf, QuantPanels) and leaf.codes.ndim == 5:  # stacked: a layer weight
            return leaf.format
    return "float32"


def weight_bytes(state: Any) -> int:
    """Bytes of every array of a model state (blocks as held)."""
    return sum(int(a.nbytes) for a in jax.tree.leaves(state))


def runner(cfg: LlamaConfig, graphdef: Any, state: Any, prompt_len: int, new_tokens: int) -> MeshserveRunner:
    """The peers tool's runner of the served engine over an already loaded model, set up for one row."""
    r = MeshserveRunner.over(cfg, graphdef, state)
    r.setup(1, prompt_len, new_tokens)
    return r


def tpot(r: MeshserveRunner, prompt: list[int], new_tokens: int) -> float:
    """Seconds per output token after the first, of one greedy row of ``new_tokens``."""
    r.generate([prompt], new_tokens)
    end = time.perf_counter()
    assert r.first_at is not None, "generate sets the first token's time"
    return (end - r.first_at) / (new_tokens - 1)


def summary(
    floor: float, model: float, weight_bytes: int, read_bytes_per_s: float, target_s: float | None
) -> dict[str, Any]:
    """The figures this script prints, from its measurements (seconds, bytes, bytes/s): the best
    TPOT the machine allows (``floor + weight_bytes / read``), the rate the model's step reads its
    weights at (``weight_bytes / (model - floor)``, None when the step is not above the floor),
    both as shares, and for ``target_s`` the share of the read rate the target needs (inf when
    the target is not above the floor)."""
    best = floor + weight_bytes / read_bytes_per_s
    rate = weight_bytes / (model - floor) if model > floor else None
    out: dict[str, Any] = {
        "floor_s": floor, "model_s": model, "weight_bytes": weight_bytes, "read_bytes_per_s": read_bytes_per_s,
        "best_s": best, "best_over_model": best / model, "weights_read_bytes_per_s": rate,
        "weights_read_share": None if rate is None else rate / read_bytes_per_s,
    }  # fmt: skip
    if target_s is not None:
        budget = target_s - floor
        out["target_s"] = target_s
        out["target_read_share"] = weight_bytes / budget / read_bytes_per_s if budget > 0 else math.inf
    return out


def report(r: dict[str, Any]) -> str:
    """``summary``'s figures (with the run's facts) as the lines this script prints."""
    lines = [
        f"model: {r['model_name']}, {r['layers']} layers, layer weights {r['layer_format']}; "
        f"{r['weight_bytes'] / 1e6:.1f} MB of weights",
        f"machine: {r['threads']} threads, streaming read {r['read_bytes_per_s'] / 1e9:.1f} GB/s (best of 3)",
        f"batch-1 TPOT, the served engine, weights as stored, {r['prompt_len']}-token prompt, medians of "
        f"{r['rounds']} alternating rounds:",
        f"  floor (tiny widths, {r['layers']} layers)  {1e3 * r['floor_s']:7.2f} ms",
        f"  model                                {1e3 * r['model_s']:7.2f} ms",
        f"  best the machine allows              {1e3 * r['best_s']:7.2f} ms = {r['best_over_model']:.2f} x the "
        "model's (floor + weight bytes / read rate)",
    ]
    if r["weights_read_bytes_per_s"] is not None:
        lines.append(
            f"  the model's step reads its weights at {r['weights_read_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{r['weights_read_share']:.0%} of the streaming rate"
        )
    if "target_s" in r:
        need = r["target_read_share"]
        lines.append(
            f"  target {1e3 * r['target_s']:.2f} ms: its weights within {1e3 * (r['target_s'] - r['floor_s']):.2f} ms "
            f"after the floor, {need:.0%} of the streaming rate" + (" (past it: out of reach here)" if need > 1 else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF or checkpoint (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (%(default)s)")
    ap.add_argument("--new-tokens", type=int, default=64, help="generated tokens per round (%(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per engine, alternating (%(default)s)")
    ap.add_argument("--read-mb", type=int, default=512, help="buffer of the read probe, MiB (%(default)s)")
    ap.add_argument("--target-ms", type=float, help="a TPOT to judge: the share of the read rate it needs")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)

    path = resolve_model(args.model)
    loaded = load_model(path, "float32", stored=True)
    cfg, fmt = loaded.cfg, layer_format(loaded.state)
    small = shrunk(cfg)
    small_graphdef, small_state = random_block_llama(small, fmt=fmt if fmt != "float32" else "q8_0")
    prompt = [1 + i % (small.vocab_size - 1) for i in range(args.prompt_len)]
    engines = {
        "floor": runner(small, small_graphdef, small_state, args.prompt_len, args.new_tokens),
        "model": runner(cfg, loaded.graphdef, loaded.state, args.prompt_len, args.new_tokens),
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for r in engines.values():
        tpot(r, prompt, args.new_tokens)  # compiles every program the rounds use
    for _ in range(args.rounds):
        for name, r in engines.items():
            times[name].append(tpot(r, prompt, args.new_tokens))
    for r in engines.values():
        r.close()

    with tempfile.TemporaryDirectory() as tmp:
        exe = cpu_ceilings.build(Path(tmp))
        threads = len(os.sched_getaffinity(0))
        work, seconds = cpu_ceilings.run_probe(exe, "read", threads, args.read_mb * 2**20, 3)
    result = summary(
        floor=statistics.median(times["floor"]),
        model=statistics.median(times["model"]),
        weight_bytes=weight_bytes(loaded.state),
        read_bytes_per_s=work / seconds,
        target_s=None if args.target_ms is None else args.target_ms / 1e3,
    )
    result.update(model_name=path.name, layers=cfg.num_layers, layer_format=fmt, threads=threads, rounds=args.rounds,
                  prompt_len=args.prompt_len, new_tokens=args.new_tokens, floor_rounds_s=times["floor"],
                  model_rounds_s=times["model"])  # fmt: skip
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
