"""Long contexts cost only their attention: TPOT served at a long ``--max-seq-len`` against a
short one, same requests (issue 19's target: within 1.1x).

    python -m benchmarks.long_context                              # SmolLM2-135M, 256 vs 8,192, batch 1 and 8
    python -m benchmarks.long_context --lengths 256 32768 --batches 1 --json lc.json

For each ``--lengths`` value this starts ``meshserve serve --max-seq-len L --slots B_max`` (the
largest of ``--batches``; every other flag at its default, so the paged pool is slots x L
tokens) as a child process (``benchmarks.server_process``), all of them at once, and waits for
SERVING. Then, batch by batch, it warms each server with B requests and runs ``--rounds`` rounds;
a round runs ``meshserve-bench bench``'s closed loop (``benchmarks.bench.run_bench``: concurrency B, B
greedy requests of ``--prompt-len`` ids and ``--output-len`` generated ids) on every server in
turn, in the opposite order the next round. A point's TPOT is the median over rounds of each
round's p50; a ratio (each longer length's TPOT over the shortest's) is the median over rounds
of the same round's ratios, so the machine's drift between rounds (this one is shared) cancels
rather than landing on one server.

The requests are the same at every length (same seed), so the only difference between the
servers is what ``--max-seq-len`` sizes: the pool, the page-table width, the window buckets. A
ratio near 1 says a step's cost follows the sequences it runs, not the maximum they may reach.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import check_writable_file
from benchmarks.server_process import launch_server, stop_server, wait_serving
from service.server.arg_types import positive_int

TARGET_RATIO = 1.1


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each batch, every length's TPOT over the shortest length's: the median over rounds of
    the rounds' ratios (``points``: rows with ``max_seq_len``, ``batch``, ``tpot_p50_ms`` and
    ``rounds_ms``, the p50 of each round, or without ``rounds_ms`` one round of ``tpot_p50_ms``)."""
    out = []
    for batch in sorted({p["batch"] for p in points}):
        rows = sorted((p for p in points if p["batch"] == batch), key=lambda p: p["max_seq_len"])
        base = rows[0]
        for p in rows[1:]:
            per_round = [
                a / b
                for a, b in zip(
                    p.get("rounds_ms", [p["tpot_p50_ms"]]), base.get("rounds_ms", [base["tpot_p50_ms"]]), strict=True
                )
            ]
            out.append(
                {
                    "batch": batch,
                    "max_seq_len": p["max_seq_len"],
                    "baseline_max_seq_len": base["max_seq_len"],
                    "ratio": statistics.median(per_round),
                    "round_ratios": per_round,
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
    ap.add_argument("--rounds", type=positive_int, default=5, help="alternating rounds of B requests (%(default)s)")
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
    lengths = sorted(args.lengths)
    points: list[dict[str, Any]] = []
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        t0 = time.perf_counter()
        try:
            for length in lengths:
                serve = ["--max-seq-len", str(length), "--slots", str(slots), *args.serve_arg]
                if args.model:
                    serve += ["--model", args.model]
                log_path = Path(tmp) / f"serve-{length}.log"
                procs.append((launch_server(serve, log_path), log_path))
            ports = []
            for length, (proc, log_path) in zip(lengths, procs, strict=True):
                ports.append(wait_serving(proc, log_path, args.timeout)[1])
                print(f"max_seq_len {length}: SERVING after {time.perf_counter() - t0:.0f} s", file=sys.stderr)

            def bench(port: int, batch: int, warmup: int, measured: int) -> dict[str, Any]:
                cfg = BenchConfig(
                    address=f"127.0.0.1:{port}",
                    num_requests=measured,
                    warmup=warmup,
                    concurrency=batch,
                    prompt_len=(args.prompt_len, args.prompt_len),
                    output_len=(args.output_len, args.output_len),
                    hardware="none",
                    progress=False,
                )
                return run_bench(cfg)

            for batch in args.batches:
                reports: dict[int, list[dict[str, Any]]] = {length: [] for length in lengths}
                for port in ports:
                    failed += bench(port, batch, 0, batch)["failed"]  # warm-up
                for k in range(args.rounds):
                    order = list(zip(lengths, ports, strict=True))
                    for length, port in order if k % 2 == 0 else order[::-1]:
                        report = bench(port, batch, 0, batch)
                        failed += report["failed"]
                        reports[length].append(report)
                for length in lengths:
                    rs = reports[length]
                    row = {
                        "max_seq_len": length,
                        "batch": batch,
                        "tpot_p50_ms": statistics.median(r["tpot_ms"]["p50"] for r in rs),
                        "rounds_ms": [r["tpot_ms"]["p50"] for r in rs],
                        "ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in rs),
                        "output_tokens_per_s": statistics.median(r["output_tokens_per_s"] for r in rs),
                        "completed": sum(r["completed"] for r in rs),
                        "failed": sum(r["failed"] for r in rs),
                    }
                    points.append(row)
                    print(
                        f"max_seq_len {length:>6}  batch {batch:>3}  TPOT p50 {row['tpot_p50_ms']:8.2f} ms  "
                        f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  {row['output_tokens_per_s']:7.1f} tok/s  "
                        f"{row['completed']} ok, {row['failed']} failed",
                        flush=True,
                    )
        finally:
            for proc, _ in procs:
                stop_server(proc)
    measured = ratios(points)
    result = {"target_ratio": TARGET_RATIO, "points": points, "ratios": measured, "cpus": os.cpu_count()}
    for r in measured:
        verdict = "met" if r["ratio"] <= TARGET_RATIO else "missed"
        print(
            f"batch {r['batch']:>3}: TPOT at {r['max_seq_len']} / at {r['baseline_max_seq_len']} = "
            f"{r['ratio']:.3f} (target <= {TARGET_RATIO}: {verdict}; rounds "
            f"{' '.join(f'{x:.3f}' for x in r['round_ratios'])})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
