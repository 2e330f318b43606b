"""Long contexts cost only their attention: TPOT served at a long ``--max-seq-len`` against a
short one, same requests (issue 19's target: within 1.1x).

    python -m benchmarks.long_context                              # SmolLM2-135M, 256 vs 8,192, batch 1 and 8
    python -m benchmarks.long_context --lengths 256 32768 --batches 1 --json lc.json

For each ``--lengths`` value this starts ``meshserve serve --max-seq-len L --slots B_max`` (the
largest of ``--batches``; every other flag at its default, so the paged pool is slots x L
tokens) as a child process (``benchmarks.server_process``), waits for SERVING, and runs
``meshserve bench``'s closed loop (``benchmarks.bench.run_bench``) at each batch B: concurrency B, ``B x --rounds`` greedy requests
of ``--prompt-len`` ids and ``--output-len`` generated ids after B warm-up requests. Prints each
point's TPOT p50 and the ratio of every longer length's TPOT to the shortest's, batch by batch.

The requests are the same at every length (same seed), so the only difference between the
servers is what ``--max-seq-len`` sizes: the pool, the page-table width, the window buckets. A
ratio near 1 says a step's cost follows the sequences it runs, not the maximum they may reach.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import check_writable_file
from benchmarks.server_process import start_server, stop_server
from service.arg_types import positive_int

TARGET_RATIO = 1.1


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each batch, every length's TPOT p50 over the shortest length's (``points``: rows with
    ``max_seq_len``, ``batch``, ``tpot_p50_ms``)."""
    out = []
    for batch in sorted({p["batch"] for p in points}):
        rows = sorted((p for p in points if p["batch"] == batch), key=lambda p: p["max_seq_len"])
        base = rows[0]
        for p in rows[1:]:
            out.append(
                {
                    "batch": batch,
                    "max_seq_len": p["max_seq_len"],
                    "baseline_max_seq_len": base["max_seq_len"],
                    "ratio": p["tpot_p50_ms"] / base["tpot_p50_ms"],
                }
            )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its rows and ratios; 0 when every request finished."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.long_context", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or model directory (default: the server's default model)")
    ap.add_argument(
        "--lengths", type=positive_int, nargs="+", default=[256, 8192], help="max-seq-len values (%(default)s)"
    )
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 8], help="concurrent requests (%(default)s)")
    ap.add_argument("--prompt-len", type=positive_int, default=128, help="prompt ids (%(default)s)")
    ap.add_argument("--output-len", type=positive_int, default=64, help="generated ids (%(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="measured requests = batch x rounds (%(default)s)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more flag for serve (repeatable)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a server may take to be SERVING")
    ap.add_argument("--json", help="write the rows and ratios to this file")
    args = ap.parse_args(argv)
    if args.json:
        check_writable_file(args.json, ap.prog)
    if min(args.lengths) < args.prompt_len + args.output_len:
        ap.error(f"every length must hold {args.prompt_len} + {args.output_len} ids")

    from benchmarks.bench import BenchConfig, run_bench

    slots = max(args.batches)
    points: list[dict[str, Any]] = []
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for length in sorted(args.lengths):
            serve = ["--max-seq-len", str(length), "--slots", str(slots), *args.serve_arg]
            if args.model:
                serve += ["--model", args.model]
            log_path = Path(tmp) / f"serve-{length}.log"
            t0 = time.perf_counter()
            proc, port = start_server(serve, log_path, args.timeout)
            print(f"max_seq_len {length}: SERVING after {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            try:
                for batch in args.batches:
                    cfg = BenchConfig(
                        address=f"127.0.0.1:{port}",
                        num_requests=batch * args.rounds,
                        warmup=batch,
                        concurrency=batch,
                        prompt_len=(args.prompt_len, args.prompt_len),
                        output_len=(args.output_len, args.output_len),
                        hardware="none",
                        progress=False,
                    )
                    report = run_bench(cfg)
                    failed += report["failed"]
                    row = {
                        "max_seq_len": length,
                        "batch": batch,
                        "tpot_p50_ms": report["tpot_ms"]["p50"],
                        "ttft_p50_ms": report["ttft_ms"]["p50"],
                        "output_tokens_per_s": report["output_tokens_per_s"],
                        "completed": report["completed"],
                        "failed": report["failed"],
                    }
                    points.append(row)
                    print(
                        f"max_seq_len {length:>6}  batch {batch:>3}  TPOT p50 {row['tpot_p50_ms']:8.2f} ms  "
                        f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  {row['output_tokens_per_s']:7.1f} tok/s  "
                        f"{row['completed']} ok, {row['failed']} failed",
                        flush=True,
                    )
            finally:
                stop_server(proc)
    measured = ratios(points)
    result = {"target_ratio": TARGET_RATIO, "points": points, "ratios": measured, "cpus": os.cpu_count()}
    for r in measured:
        verdict = "met" if r["ratio"] <= TARGET_RATIO else "missed"
        print(
            f"batch {r['batch']:>3}: TPOT at {r['max_seq_len']} / at {r['baseline_max_seq_len']} = "
            f"{r['ratio']:.3f} (target <= {TARGET_RATIO}: {verdict})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
