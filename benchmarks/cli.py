"""``meshserve-bench``: the measurement tools, beside the server rather than inside it.

    meshserve-bench bench ...      load-test a running server (benchmarks/bench.py)
    meshserve-bench sweep ...      time the served engine directly over a grid (benchmarks/sweep.py)
    meshserve-bench roofline ...   predict TTFT, TPOT and throughput of a chip and layout (benchmarks/roofline.py)

Each tool's module brings its own flags and imports no JAX before its command runs.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import bench, roofline, sweep


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="meshserve-bench", description="meshserve's measurement tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    rf = sub.add_parser("roofline", help="predict TTFT, TPOT and throughput from the roofline of a chip and layout")
    roofline.add_roofline_arguments(rf)
    rf.set_defaults(func=roofline.run_from_args)
    bn = sub.add_parser("bench", help="load-test a running server: TTFT/TPOT/ITL/E2E percentiles, tokens/s, goodput")
    bench.add_bench_arguments(bn)
    bn.set_defaults(func=bench.run_from_args)
    sw = sub.add_parser(
        "sweep", help="time the served engine directly over layouts x batch sizes x prompt lengths: CSV, JSON and plots"
    )
    sweep.add_sweep_arguments(sw)
    sw.set_defaults(func=sweep.run_from_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
