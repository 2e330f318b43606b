"""Where a decode step's time goes: the served engine's step at B rows, traced by JAX's profiler,
its time split by XLA:CPU thunk (each native kernel's custom call, the layer loop, fusions).

The engine runs as ``benchmarks/peers.py`` runs it (``MeshserveRunner``: a ``Runner`` on one CPU
device through its engine loop, greedy, EOS ignored): one untraced round of B rows of
``--prompt-len`` tokens and ``--new-tokens`` new ones for the TPOT without the tracer, then the
same round traced. The trace's thunks carry the run id of their step, so the steps are grouped by
program; the decode-only steps (the most common program) give, per thunk, its median time per
step, named by the custom call it runs (``meshserve_panel_matmul`` and the output's shape, ...)
from the optimised HLO that ``--xla_dump_to`` writes. Thunks inside the layer loop are summed
over its layers; the loop's own row (``while``) holds them all. Tracing slows a step (each
thunk is timed): compare the shares, not the traced total with the TPOT.

    python benchmarks/step_profile.py --batch 8
    python benchmarks/step_profile.py --batch 8 --stored
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/step_profile.py` from a checkout


def thunk_table(trace_dir: Path, hlo_dir: Path) -> tuple[int, float, list[tuple[float, str, str]]]:
    """(decode steps, their median traced wall ms, [(median ms per step, thunk, what it runs)])
    from a perfetto trace and the HLO dump of one run."""
    path = sorted(trace_dir.glob("**/*.trace.json.gz"))[-1]
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        run_id = (e.get("args") or {}).get("run_id")
        if e.get("ph") == "X" and run_id is not None and not e["name"].startswith("ThunkExecutor"):
            steps[run_id].append(e)
    programs = collections.Counter(frozenset(e["name"] for e in es) for es in steps.values())
    decode = programs.most_common(1)[0][0]  # most steps of a round decode
    texts = [p.read_text() for p in hlo_dir.glob("*jit_run*after_optimizations.txt")]
    names = [n for n in decode if n.startswith("ffi_call")]
    text = next((t for t in texts if all(re.search(rf"\b{re.escape(n)} = ", t) for n in names)), "")

    def what(name: str) -> str:
        m = re.search(rf"\n\s*(?:ROOT )?%?{re.escape(name)} = (\S+) ([^\n]*)", text)
        if not m:
            return ""
        target = re.search(r'custom_call_target="([^"]+)"', m.group(2))
        return f"{target.group(1) if target else m.group(2).split('(')[0]} {m.group(1)}"

    per: dict[str, list[float]] = collections.defaultdict(list)
    walls = []
    for es in steps.values():
        if frozenset(e["name"] for e in es) != decode:
            continue
        total: collections.Counter[str] = collections.Counter()
        for e in es:
            total[e["name"]] += e["dur"]
        for name, us in total.items():
            per[name].append(us / 1e3)
        walls.append((max(e["ts"] + e["dur"] for e in es) - min(e["ts"] for e in es)) / 1e3)
    rows = sorted(((statistics.median(v), k, what(k)) for k, v in per.items()), reverse=True)
    return len(walls), statistics.median(walls), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8, help="rows decoding together (%(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128, help="tokens per row's prompt (%(default)s)")
    ap.add_argument("--new-tokens", type=int, default=32, help="generated tokens per row (%(default)s)")
    ap.add_argument("--stored", action="store_true", help="the GGUF's blocks as stored (default: float32)")
    ap.add_argument("--model", help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--rows", type=int, default=20, help="thunks listed (%(default)s)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="step-profile-"))
    hlo_dir = work / "hlo"
    # Before jax is imported: the optimised HLO names each thunk's custom call.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={hlo_dir} --xla_dump_hlo_as_text"

    import jax

    from benchmarks.peers import MeshserveRunner
    from model.weights.fetch import resolve_model

    runner = MeshserveRunner(resolve_model(args.model), threads=os.cpu_count() or 1, stored=args.stored)
    try:
        runner.setup(args.batch, args.prompt_len, args.new_tokens)
        rows = [[100 + (17 * i + 7 * j) % 40000 for j in range(args.prompt_len)] for i in range(args.batch)]
        runner.generate(rows, args.new_tokens)  # compiles what the warm-up left
        runner.generate(rows, args.new_tokens)
        first = runner.first_at
        assert first is not None  # generate() set it
        tpot = (time.perf_counter() - first) / (args.new_tokens - 1) * 1e3
        with jax.profiler.trace(str(work / "trace"), create_perfetto_trace=True):
            runner.generate(rows, args.new_tokens)
    finally:
        runner.close()
    steps, wall, table = thunk_table(work / "trace", hlo_dir)
    print(f"{runner.notes}")
    print(f"B={args.batch}: untraced TPOT {tpot:.1f} ms; {steps} traced decode steps, median {wall:.1f} ms each")
    print(f"{'ms/step':>8}  {'share':>6}  thunk: what it runs")
    for ms, name, what in table[: args.rows]:
        print(f"{ms:8.2f}  {ms / wall:6.1%}  {name}: {what}")
    print(f"(trace and HLO in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
