"""The paged engine's ragged step (``model.llama.ragged_step``) against today's steps on a
per-slot ``KVCache``, stacked weights (``lax.scan``), random weights (values do not change speed).

    python -m benchmarks.ragged_step                        # SmolLM2-135M shapes, float32
    python -m benchmarks.ragged_step --config tiny --runs 3 --json r.json

Two cases (``--cases``), each variant timed jitted and warm (the first call compiles and is not
counted; the cache is donated and fed back, as the engine does), the median of ``--runs`` calls,
each waited for; the variants take turns, one call each per round, so that a busy spell of a
shared machine slows all of them, not one:

* decode: ``--seqs`` sequences, one token each at position ``--position`` (its earlier
  positions cached), a window of ``--window`` positions: ``ragged_step`` (``window_pages`` =
  window / page size, every token attended on its own) against ``decode_step`` on a
  ``KVCache`` of ``--seqs`` slots with ``kv_len`` = window, and, where the native CPU kernels
  are built, ``ragged_step native`` (decode attention by ``model.native.cpu_paged_attention``);
* prefill: a first chunk of ``--prompt`` tokens (nothing cached, window = the prompt rounded up
  to whole pages): ``ragged_step`` with the chunk in the blocked region (``prefill_from`` = 0,
  ``seq_block`` from ``--seq-blocks``; 0 there means no blocked region, every token attended on
  its own) against ``prefill`` with ``kv_len`` = 0.

Each row gives the median and minimum in ms and the ratio ragged / today's (medians). The pool has
``--pages`` pages (at least what the sequences need), the sequences' pages shuffled over it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks import check_writable_file
from service.server.arg_types import nonnegative_int, positive_int


def config(name: str) -> Any:
    """``LlamaConfig.smollm2_135m()`` for "smollm2-135m", ``LlamaConfig.tiny()`` for "tiny".

    Raises:
        ValueError: another name.
    """
    from model.config import LlamaConfig

    if name == "smollm2-135m":
        return LlamaConfig.smollm2_135m()
    if name == "tiny":
        return LlamaConfig.tiny()
    raise ValueError(f"unknown config {name!r}; known: smollm2-135m, tiny")


class Variant:
    """One timed step: ``fn(cache) -> (out, cache)`` and the cache it carries from call to call
    (donated and fed back)."""

    def __init__(self, case: str, name: str, fn: Callable[[Any], tuple[Any, Any]], cache: Any):
        self.case, self.name, self.fn, self.cache = case, name, fn, cache
        self.times: list[float] = []

    def call(self) -> float:
        """One call, waited for; its wall time in seconds."""
        import jax

        t0 = time.perf_counter()
        out, self.cache = self.fn(self.cache)
        jax.block_until_ready((out, self.cache))
        return time.perf_counter() - t0


def time_all(variants: list[Variant], runs: int) -> None:
    """Call every variant once (compiling it), then ``runs`` rounds of one call each, in turn, so
    that a busy spell of the machine slows every variant alike, not one; fills ``times``."""
    for v in variants:
        v.call()
    for _ in range(runs):
        for v in variants:
            v.times.append(v.call())


def row(v: Variant) -> dict[str, Any]:
    return {
        "case": v.case,
        "variant": v.name,
        "median_ms": 1e3 * statistics.median(v.times),
        "min_ms": 1e3 * min(v.times),
        "runs": len(v.times),
    }


def scattered_tables(rng: np.random.Generator, seqs: int, pages_each: int, num_pages: int) -> np.ndarray:
    """[seqs, pages_each] int32: distinct pages of a pool of ``num_pages``, in random order."""
    return rng.permutation(num_pages)[: seqs * pages_each].reshape(seqs, pages_each).astype(np.int32)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both cases; the result dict ("rows", "ratios", the settings)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.native import cpu_paged_attention
    from model.weights.build import random_llama
    from model.kernels import NATIVE_CPU, XLA
    from model.kv_cache import KVCache
    from model.llama import decode_step, prefill, ragged_step
    from model.attention.pages import PagedKVCache

    cfg = config(args.config)
    native_kernels = cpu_paged_attention.supports(cfg.q_per_kv, cfg.head_dim, jnp.float32) and (
        cpu_paged_attention.available()
    )
    graphdef, params = random_llama(cfg, args.seed)
    rng = np.random.default_rng(args.seed)
    ps = args.page_size
    if args.window % ps or args.position >= args.window:
        raise SystemExit(f"--window ({args.window}) must be a multiple of --page-size ({ps}) above --position")
    window_pages = args.window // ps
    prompt_pages = -(-args.prompt // ps)
    num_pages = max(args.pages, args.seqs * window_pages, prompt_pages)
    variants: list[Variant] = []

    def ragged(window: int, prefill_from: int | None, seq_block: int, native: bool = False) -> Callable[..., Any]:
        def step(params, cache, *meta):  # type: ignore[no-untyped-def]
            model = nnx.merge(graphdef, params)
            return ragged_step(
                model, cache, *meta, window_pages=window, prefill_from=prefill_from, seq_block=seq_block,
                kernels=NATIVE_CPU if native else XLA,
            )  # fmt: skip

        return jax.jit(step, donate_argnums=1)

    def bound(fn: Callable[..., Any], meta: tuple[np.ndarray, ...]) -> Callable[[Any], Any]:
        """``cache -> fn(params, cache, *meta)``."""
        return lambda cache: fn(params, cache, *meta)

    # ---- decode ---------------------------------------------------------------------------
    # Every call writes the same position of each sequence and attends to 0..position: the same work.
    B = args.seqs
    tables = scattered_tables(rng, B, window_pages, num_pages)
    tokens = rng.integers(0, cfg.vocab_size, B).astype(np.int32)
    positions = np.full(B, args.position, np.int32)
    meta = (tokens, positions, np.arange(B, dtype=np.int32), tables, np.arange(B, dtype=np.int32))
    if "decode" in args.cases:
        fn = ragged(window_pages, None, 1)
        dec = jax.jit(
            lambda p, c, t, pos: decode_step(nnx.merge(graphdef, p), c, t, pos, kv_len=args.window), donate_argnums=1
        )
        variants += [
            Variant("decode", "ragged_step", bound(fn, meta), PagedKVCache.zeros(cfg, num_pages, ps)),
            Variant("decode", "decode_step", lambda c: dec(params, c, tokens, positions), KVCache.zeros(cfg, B, args.window)),
        ]  # fmt: skip
        if native_kernels and jax.default_backend() == "cpu":
            nfn = ragged(window_pages, None, 1, native=True)
            variants.append(
                Variant("decode", "ragged_step native", bound(nfn, meta), PagedKVCache.zeros(cfg, num_pages, ps))
            )

    # ---- prefill --------------------------------------------------------------------------
    T = args.prompt
    ids = rng.integers(0, cfg.vocab_size, T).astype(np.int32)
    table = scattered_tables(rng, 1, prompt_pages, num_pages)
    pmeta = (ids, np.arange(T, dtype=np.int32), np.zeros(T, np.int32), table, np.array([T - 1], np.int32))
    if "prefill" in args.cases:
        for block in args.seq_blocks:
            pfn = ragged(prompt_pages, 0 if block else None, max(block, 1))
            name = f"ragged_step seq_block={block}" if block else "ragged_step per token"
            cache = PagedKVCache.zeros(cfg, num_pages, ps)
            variants.append(Variant("prefill", name, bound(pfn, pmeta), cache))
        if native_kernels and jax.default_backend() == "cpu":  # every token through the decode kernel
            pfn = ragged(prompt_pages, None, 1, native=True)
            cache = PagedKVCache.zeros(cfg, num_pages, ps)
            variants.append(Variant("prefill", "ragged_step per token, native", bound(pfn, pmeta), cache))
        pf = jax.jit(
            lambda p, c, t: prefill(nnx.merge(graphdef, p), c, t, jnp.int32(0), jnp.int32(T), jnp.int32(0), kv_len=0),
            donate_argnums=1,
        )
        variants.append(Variant("prefill", "prefill", lambda c: pf(params, c, ids), KVCache.zeros(cfg, 1, T)))

    time_all(variants, args.runs)
    rows = [row(v) for v in variants]
    base = {r["case"]: r["median_ms"] for r in rows if r["variant"] in ("decode_step", "prefill")}
    for r in rows:
        r["ratio"] = r["median_ms"] / base[r["case"]]
    return {
        "config": args.config,
        "dtype": "float32",
        "seqs": B,
        "position": args.position,
        "window": args.window,
        "prompt": T,
        "page_size": ps,
        "num_pages": num_pages,
        "machine": platform.machine(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "rows": rows,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ragged_step",
        description="ragged_step on a paged cache against decode_step and prefill on a KVCache (stacked weights).",
    )
    parser.add_argument("--cases", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"])
    parser.add_argument("--config", default="smollm2-135m", choices=("smollm2-135m", "tiny"))
    parser.add_argument("--seqs", type=positive_int, default=4, help="decode sequences (and KVCache slots)")
    parser.add_argument("--position", type=nonnegative_int, default=300, help="each decode token's position")
    parser.add_argument("--window", type=positive_int, default=512, help="decode window in positions (kv_len)")
    parser.add_argument("--prompt", type=positive_int, default=512, help="tokens of the first prefill chunk")
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument("--pages", type=nonnegative_int, default=0, help="pool size (raised to what the cases need)")
    parser.add_argument(
        "--seq-blocks",
        type=nonnegative_int,
        nargs="+",
        default=[64],
        help="seq_block values for the prefill case; 0 = every token on its own (no blocked region)",
    )
    parser.add_argument("--runs", type=positive_int, default=7, help="timed calls per variant (after one to compile)")
    parser.add_argument("--seed", type=nonnegative_int, default=0)
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.json:
        check_writable_file(args.json, "benchmarks.ragged_step")
    result = run(args)
    print(
        f"{result['config']} float32, page size {result['page_size']}, {result['num_pages']} pages; "
        f"decode: {result['seqs']} x position {result['position']}, window {result['window']}; "
        f"prefill: {result['prompt']} tokens"
    )
    print(f"{'case':8} {'variant':32} {'median ms':>10} {'min ms':>9} {'ratio':>7}")
    for r in result["rows"]:
        print(f"{r['case']:8} {r['variant']:32} {r['median_ms']:10.2f} {r['min_ms']:9.2f} {r['ratio']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
