"""The served engine's step, ``model.llama.ragged_step`` over the paged KV cache, with the native
CPU attention backend (``model.attention.cpu.NativeCpuAttention``) against the XLA backend
(``model.attention.xla.XlaAttention``, XLA's gathers and dots: every platform's path, and the
reference the native kernels are tested against). The baseline of every ratio is the XLA
backend on the same batch; both variants take the same weights (random: values do not change
speed), stacked and run in ``lax.scan``, multiplied by XLA's dots, so only attention differs.

    python -m benchmarks.ragged_step                        # SmolLM2-135M shapes, float32
    python -m benchmarks.ragged_step --config tiny --runs 3 --json r.json

Two cases (``--cases``), each variant timed jitted and warm (the first call compiles and is not
counted; the cache is donated and fed back, as the engine does), the median of ``--runs`` calls,
each waited for; the variants take turns, one call each per round, so that a busy spell of a
shared machine slows all of them, not one:

* decode: ``--seqs`` sequences, one token each at position ``--position`` (its earlier
  positions cached), all in the decode region (each token attends on its own), a window of
  ``--window`` positions (``window_pages`` = window / page size: what XLA's attention gathers;
  the native kernels read up to each token's position);
* prefill: a first chunk of ``--prompt`` tokens (nothing cached, window = the prompt rounded up
  to whole pages), for each ``--seq-blocks`` value b: in the prefill region in blocks of b
  tokens (padded to whole blocks, as the engine pads a chunk), or, for b = 0, in the decode
  region, every token attended on its own ("per token").

Variants: ``xla`` (the baseline) and, where the native kernels are built and JAX runs on the
CPU, ``native``; a prefill variant's name carries its layout ("xla seq_block=64", "native per
token"). Each row gives the median and minimum in ms and the ratio to the XLA row of the same
case and layout (medians; below 1: faster than XLA). The pool has ``--pages`` pages (at least
what the sequences need), the sequences' pages shuffled over it.
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
    """Both cases; the result dict ("rows", the settings)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from model.attention import cpu as cpu_attention
    from model.attention.base import AttentionBackend, StepMeta
    from model.attention.pages import PagedKVCache
    from model.attention.xla import XlaAttention
    from model.llama import ragged_step
    from model.weights.build import random_llama

    cfg = config(args.config)
    native = (
        cpu_attention.supports(cfg.q_per_kv, cfg.head_dim, jnp.float32)
        and cpu_attention.available()
        and jax.default_backend() == "cpu"
    )
    backends: list[tuple[str, AttentionBackend]] = [("xla", XlaAttention())]
    if native:
        backends.append(("native", cpu_attention.NativeCpuAttention()))
    graphdef, params = random_llama(cfg, args.seed)
    rng = np.random.default_rng(args.seed)
    ps = args.page_size
    if args.window % ps or args.position >= args.window:
        raise SystemExit(f"--window ({args.window}) must be a multiple of --page-size ({ps}) above --position")
    window_pages = args.window // ps
    prompt_pages = -(-args.prompt // ps)
    num_pages = max(args.pages, args.seqs * window_pages, prompt_pages)
    variants: list[Variant] = []

    def ragged(
        attention: AttentionBackend, window: int, decode_tokens: int | None, seq_block: int
    ) -> Callable[..., Any]:
        def step(params, cache, tokens, rows, positions, tables, last):  # type: ignore[no-untyped-def]
            meta = StepMeta.build(
                tables, rows, positions, ps, window_pages=window, decode_tokens=decode_tokens, seq_block=seq_block
            )
            return ragged_step(nnx.merge(graphdef, params), cache, tokens, meta, last, attention)

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
    rows = np.arange(B, dtype=np.int32)
    meta = (tokens, rows, positions, tables, rows)
    if "decode" in args.cases:
        for name, attention in backends:
            fn = ragged(attention, window_pages, None, 1)
            variants.append(Variant("decode", name, bound(fn, meta), PagedKVCache.zeros(cfg, num_pages, ps)))

    # ---- prefill --------------------------------------------------------------------------
    T = args.prompt
    ids = rng.integers(0, cfg.vocab_size, T).astype(np.int32)
    table = scattered_tables(rng, 1, prompt_pages, num_pages)
    if "prefill" in args.cases:
        for block in args.seq_blocks:
            n = -(-T // block) * block if block else T  # a chunk padded to whole blocks
            pids, prows, ppos = np.zeros(n, np.int32), np.full(n, -1, np.int32), np.full(n, -1, np.int32)
            pids[:T], prows[:T], ppos[:T] = ids, 0, np.arange(T)
            pmeta = (pids, prows, ppos, table, np.array([T - 1], np.int32))
            layout = f"seq_block={block}" if block else "per token"
            for name, attention in backends:
                # seq_block 0: every token in the decode region; else all in the prefill region
                pfn = ragged(attention, prompt_pages, None if not block else 0, max(block, 1))
                cache = PagedKVCache.zeros(cfg, num_pages, ps)
                variants.append(Variant("prefill", f"{name} {layout}", bound(pfn, pmeta), cache))

    time_all(variants, args.runs)
    out = [row(v) for v in variants]
    for r in out:  # the XLA backend's row of the same case and layout: "native seq_block=64" -> "xla seq_block=64"
        r["baseline"] = " ".join(["xla", *r["variant"].split(" ", 1)[1:]])
    base = {(r["case"], r["variant"]): r["median_ms"] for r in out if r["variant"] == r["baseline"]}
    for r in out:
        r["ratio"] = r["median_ms"] / base[r["case"], r["baseline"]]
    return {
        "config": args.config,
        "dtype": "float32",
        "seqs": B,
        "position": args.position,
        "window": args.window,
        "prompt": T,
        "page_size": ps,
        "num_pages": num_pages,
        "native": native,
        "machine": platform.machine(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "rows": out,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.ragged_step",
        description="ragged_step on the paged cache: the native CPU attention backend against the XLA backend.",
    )
    parser.add_argument("--cases", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"])
    parser.add_argument("--config", default="smollm2-135m", choices=("smollm2-135m", "tiny"))
    parser.add_argument("--seqs", type=positive_int, default=4, help="decode sequences (%(default)s)")
    parser.add_argument("--position", type=nonnegative_int, default=300, help="each decode token's position")
    parser.add_argument("--window", type=positive_int, default=512, help="decode window in positions (%(default)s)")
    parser.add_argument("--prompt", type=positive_int, default=512, help="tokens of the first prefill chunk")
    parser.add_argument("--page-size", type=positive_int, default=16)
    parser.add_argument("--pages", type=nonnegative_int, default=0, help="pool size (raised to what the cases need)")
    parser.add_argument(
        "--seq-blocks",
        type=nonnegative_int,
        nargs="+",
        default=[64],
        help="seq_block values for the prefill case; 0 = every token on its own (the decode region)",
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
    print(f"{'case':8} {'variant':32} {'median ms':>10} {'min ms':>9} {'ratio':>7}  (to the XLA backend's)")
    for r in result["rows"]:
        print(f"{r['case']:8} {r['variant']:32} {r['median_ms']:10.2f} {r['min_ms']:9.2f} {r['ratio']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
