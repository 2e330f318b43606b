"""Read ``meshserve-bench sweep`` results of several layer forms and say which form is faster at each
batch, and the int8 / bfloat16 TPOT ratio (``benchmarks/gpu_check.sh``'s last step).

    python3 benchmarks/gpu_pick.py SWEEP_JSON [SWEEP_JSON ...] [--int8 SWEEP_JSON]

Prints one table of every measured row (layer form, batch, TPOT, serial step, dispatch call,
MBU, tokens/s), then for each batch the form with the lower TPOT and by how much, then, with
``--int8``, for batches 1 and 8 the ratio of the int8 sweep's TPOT to the bfloat16 one's for the
same form and for the faster forms of each (target at batch 1: <= 0.6). Exit status 0 when
every file could be read and held a measured row, else 1. Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_of(paths: list[str]) -> list[dict]:
    """The measured rows ("ok") of every readable sweep JSON; a missing or broken file is reported."""
    rows = []
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"gpu_pick: {path}: {exc}", file=sys.stderr)
            continue
        rows += [r for r in data["rows"] if r["status"] == "ok"]
    return rows


def best(rows: list[dict], batch: int) -> dict | None:
    """The row of ``batch`` with the lowest TPOT, or None."""
    at = [r for r in rows if r["batch"] == batch]
    return min(at, key=lambda r: r["tpot_ms"]) if at else None


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweeps", nargs="+", help="sweep.json files of the bfloat16 (or float) weights")
    p.add_argument("--int8", help="sweep.json of the same points with --weights int8")
    args = p.parse_args(argv)
    rows = rows_of(args.sweeps)
    if not rows:
        print("gpu_pick: no measured row", file=sys.stderr)
        return 1
    print("| weights | layers | B | TPOT ms | serial step ms | dispatch call ms | MBU | tok/s | TTFT proxy ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    int8 = rows_of([args.int8]) if args.int8 else []
    for label, group in (("bfloat16", rows), ("int8", int8)):
        for r in sorted(group, key=lambda r: (r["batch"], r["layers"])):
            print(
                f"| {label} | {r['layers']} | {r['batch']} | {r['tpot_ms']:.3f} | {fmt(r.get('step_ms'), '.3f')} | "
                f"{r['decode_call_ms']:.3f} | {fmt(r.get('mbu'), '.1%')} | {r['decode_tok_s']:.1f} | "
                f"{fmt(r.get('prefill_ms'), '.2f')} |"
            )
    for batch in sorted({r["batch"] for r in rows}):
        at = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["tpot_ms"])
        if len(at) > 1:
            print(f"B={batch}: {at[0]['layers']} is faster, {at[1]['tpot_ms'] / at[0]['tpot_ms']:.2f}x "
                  f"({at[0]['tpot_ms']:.3f} against {at[1]['layers']} {at[1]['tpot_ms']:.3f} ms)")  # fmt: skip
    for batch in (1, 8):
        for form in sorted({r["layers"] for r in rows}):
            b = next((r for r in rows if r["batch"] == batch and r["layers"] == form), None)
            q = next((r for r in int8 if r["batch"] == batch and r["layers"] == form), None)
            if b and q:
                print(f"B={batch} {form}: TPOT int8 {q['tpot_ms']:.3f} / bfloat16 {b['tpot_ms']:.3f} ms = "
                      f"{q['tpot_ms'] / b['tpot_ms']:.3f}")  # fmt: skip
        b, q = best(rows, batch), best(int8, batch)
        if b and q:
            verdict = (" PASS" if q["tpot_ms"] / b["tpot_ms"] <= 0.6 else " FAIL") + " (target <= 0.6)"
            print(f"B={batch} fastest of each: int8 ({q['layers']}) {q['tpot_ms']:.3f} / bfloat16 ({b['layers']}) "
                  f"{b['tpot_ms']:.3f} ms = {q['tpot_ms'] / b['tpot_ms']:.3f}{verdict if batch == 1 else ''}")  # fmt: skip
    return 0 if len(rows_of(args.sweeps)) and (not args.int8 or int8) else 1


if __name__ == "__main__":
    sys.exit(main())
