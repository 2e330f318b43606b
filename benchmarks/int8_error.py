"""What weight-only int8 costs in accuracy, on the default model: per 32-weight block (Q8_0, what
``serve --weights int8`` and ``convert --quantize int8`` hold) against one scale per output
channel, both against float32.

The float32 weights are the GGUF's dequantized values (the model the golden fixtures hold to
Hugging Face). Every variant runs in the served engine, a ``service.engine.runner.Runner`` of one
row on one CPU device (the kernels ``model.kernels.choose`` picks there), stepped directly with
the flat batches the engine loop builds: the prompt as one prefill chunk, then one decode token
a step; the logits are those of row 0, the step's own (``StepOutput.logits``). For each matmul weight it prints the relative RMS error ||W_q - W|| / ||W|| and
the largest |W_q - W| of both schemes; then, on the golden prompts (tests/fixtures), the float32
engine generates ``--tokens`` greedy tokens, and each int8 variant is fed the same tokens
(teacher forcing): top-1 agreement with float32's argmax at each position, the largest
|logit - float32's logit| over all positions and the vocabulary, and how many tokens its own
free-running greedy continuation shares with float32's before the first difference.

* ``int8-block``: the Q8_0 blocks (``model.weights.block_params.quantize_params``) through the engine's
  own path (the native kernel where built);
* ``int8-channel``: symmetric int8 with one float32 scale per output (max |w| / 127 over all K
  inputs), its dequantized values through the float32 path (a reference for the choice, not a
  served format).

    python benchmarks/int8_error.py                 # default model, 32 tokens
    python benchmarks/int8_error.py --tokens 64

Results: docs/performance.md, "int8 weights".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/int8_error.py` from a checkout

import dataclasses  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from model.config import LlamaConfig  # noqa: E402
from model.weights import block_params  # noqa: E402
from model.weights.build import llama_from_params  # noqa: E402
from model.weights.checkpoint import expected_shapes  # noqa: E402
from model.weights.fetch import default_model_path  # noqa: E402
from model.weights.gguf_weights import load_gguf_params  # noqa: E402
from service.engine.request import SamplingOptions  # noqa: E402

FIXTURE = ROOT / "tests" / "fixtures" / "golden_logits.npz"
MATMULS = ("wqkv", "wo", "w_gate_up", "w_down")
GREEDY = SamplingOptions(temperature=0.0)


def per_channel(w: np.ndarray, in_axes: int) -> np.ndarray:
    """Symmetric int8 with one float32 scale per output over all inputs, dequantized: w's shape."""
    k = int(np.prod(w.shape[:in_axes]))
    m = w.reshape(k, -1)
    d = np.abs(m).max(axis=0, keepdims=True) / 127
    q = np.round(m / np.where(d == 0, 1, d)).clip(-127, 127)
    return (q * d).astype(np.float32).reshape(w.shape)


def channel_params(params: dict) -> dict:
    out = {**params, "layers": dict(params["layers"])}
    for name in MATMULS:
        w = params["layers"][name]
        out["layers"][name] = np.stack([per_channel(w[i], block_params.INPUT_AXES[name]) for i in range(w.shape[0])])
    out["embed"] = per_channel(params["embed"].T, 1).T  # one scale per vocabulary row
    if "lm_head" in params:
        out["lm_head"] = per_channel(params["lm_head"], 1)
    return out


def prompt_batch(runner: Any, prompt: list[int]) -> Any:
    """Row 0's prompt as one prefill chunk (row 0 greedy, installed with it), sampling at its last
    token: the flat batch the engine loop builds for a prompt arriving at an idle engine."""
    from service.engine.batch import RowInstall

    g, n = runner.geometry, len(prompt)
    b = g.empty_batch(g.decode_buckets[0], g.prefill_bucket(g.padded(n)))
    start = g.decode_buckets[0]  # the prefill region starts after the decode region
    b.tokens[start : start + n], b.positions[start : start + n], b.rows[start : start + n] = prompt, np.arange(n), 0
    b.last_index[0] = start + n - 1
    b.page_tables[0] = np.arange(g.max_pages)
    install = RowInstall(0, GREEDY, False, ())
    return dataclasses.replace(b, num_real=n, max_position=n - 1, installs=(install,))


def decode_batch(runner: Any, token: int, position: int) -> Any:
    """Row 0's one decode token ``token`` at ``position``."""
    g = runner.geometry
    b = g.empty_batch(g.decode_buckets[0], 0)
    b.tokens[0], b.positions[0], b.rows[0], b.generated[0], b.last_index[0] = token, position, 0, True, 0
    b.page_tables[0] = np.arange(g.max_pages)
    return dataclasses.replace(b, num_real=1, max_position=position)


def run(runner: Any, prompt: list[int], feed: list[int] | None, n: int) -> tuple[np.ndarray, list[int]]:
    """Logits [n, V] at the n positions after ``prompt`` and the greedy ids; with ``feed``, the
    ids fed after the first are ``feed``'s (teacher forcing), else the engine's own. Each run
    writes row 0's pages from position 0 again, so runs do not see each other's keys."""
    out = runner.step(prompt_batch(runner, prompt))
    logits, ids = [out.row_logits(0)], [int(out.host().ids[0])]
    for i in range(n - 1):
        out = runner.step(decode_batch(runner, (feed or ids)[i], len(prompt) + i))
        logits.append(out.row_logits(0))
        ids.append(int(out.host().ids[0]))
    return np.stack(logits), ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=32, help="continuation length per prompt")
    args = ap.parse_args(argv)

    import jax

    from service.engine.config import EngineConfig
    from service.engine.runner import Runner
    from sharding.layouts import load_layout

    path = Path(args.model) if args.model else default_model_path()
    cfg = LlamaConfig.from_gguf(path)
    floats = load_gguf_params(path, cfg)
    int8 = block_params.quantize_params(floats)
    channel = channel_params(floats)
    shapes = expected_shapes(cfg)
    blocks = block_params.dequantize_params(int8, shapes, np.float32)

    print(f"model {path.name}; weight error of int8 per 32-block (Q8_0) and per output channel vs float32")
    print(f"{'weight':10s} {'block rel':>10s} {'channel rel':>12s} {'block max':>10s} {'channel max':>12s}")
    for name in (*MATMULS, "embed"):
        w = floats["layers"][name] if name in MATMULS else floats["embed"]
        b = blocks["layers"][name] if name in MATMULS else blocks["embed"]
        c = channel["layers"][name] if name in MATMULS else channel["embed"]
        rel = [float(np.linalg.norm(x - w) / np.linalg.norm(w)) for x in (b, c)]
        mx = [float(np.abs(x - w).max()) for x in (b, c)]
        print(f"{name:10s} {rel[0]:10.2e} {rel[1]:12.2e} {mx[0]:10.2e} {mx[1]:12.2e}")

    with np.load(FIXTURE) as z:
        prompts = [z[f"prompt_ids_{i}"].tolist() for i in range(3)]
    longest = max(map(len, prompts)) + args.tokens
    ecfg = EngineConfig(
        num_slots=1, max_seq_len=longest + 1, chunk_size=longest, max_num_batched_tokens=longest,
        kv_cache_tokens=longest + 1,
    )  # fmt: skip
    variants = {"float32": floats, "int8-block": int8, "int8-channel": channel}
    results: dict[str, list[tuple[np.ndarray, list[int], list[int]]]] = {}
    for name, params in variants.items():
        graphdef, state = llama_from_params(cfg, params)
        runner = Runner(cfg, graphdef, state, load_layout("single"), ecfg, jax.devices()[:1])
        if name == "float32":
            print(f"engine: {runner.kernels.describe()}")
        reference = results.get("float32")
        results[name] = []
        for i, prompt in enumerate(prompts):
            free_logits, free_ids = run(runner, prompt, None, args.tokens)
            if reference is None:
                results[name].append((free_logits, free_ids, free_ids))
            else:
                forced, _ = run(runner, prompt, reference[i][1], args.tokens)
                results[name].append((forced, free_ids, reference[i][1]))
        del runner

    print(f"\ngolden prompts x {args.tokens} tokens, teacher-forced on float32's greedy continuation")
    print(f"{'variant':14s} {'top-1 agree':>12s} {'max |dlogit|':>13s} {'same prefix (tokens, per prompt)':>34s}")
    ref = results["float32"]
    for name in ("int8-block", "int8-channel"):
        agree = total = 0
        err = 0.0
        prefixes = []
        for (forced, free_ids, _), (ref_logits, ref_ids, _) in zip(results[name], ref, strict=True):
            agree += int((forced.argmax(-1) == ref_logits.argmax(-1)).sum())
            total += len(ref_ids)
            err = max(err, float(np.abs(forced - ref_logits).max()))
            same = next((j for j, (a, b) in enumerate(zip(free_ids, ref_ids, strict=True)) if a != b), len(ref_ids))
            prefixes.append(same)
        print(f"{name:14s} {agree:>6d}/{total:<5d} {err:13.3e} {' '.join(map(str, prefixes)):>34s}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
