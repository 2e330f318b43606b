"""``benchmarks/step_profile.py``'s reading of a trace: thunks grouped by step (run id), the most
common program taken as the decode step, each thunk's median per step named from the HLO."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from benchmarks.step_profile import thunk_table

HLO = """HloModule jit_run
ENTRY %main {
  %ffi_call.1 = f32[8,960]{1,0} custom-call(%a, %b), custom_call_target="meshserve_panel_matmul"
  ROOT %fusion.2 = f32[8,576]{1,0} fusion(%c), kind=kLoop
}
"""


def event(name: str, run: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "args": {"run_id": run, "hlo_op": name}}


def test_thunks_of_the_decode_steps_by_median_named_from_the_hlo(tmp_path: Path) -> None:
    trace, hlo = tmp_path / "trace" / "plugins", tmp_path / "hlo"
    trace.mkdir(parents=True)
    hlo.mkdir()
    (hlo / "module_0001.jit_run.cpu_after_optimizations.txt").write_text(HLO)
    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "x"}}]
    for i, (matmul, fusion) in enumerate([(1000, 200), (3000, 400), (2000, 300)]):  # three decode steps
        t = 10_000 * i
        events += [event("ffi_call.1", f"d{i}", t, matmul), event("fusion.2", f"d{i}", t + matmul, fusion)]
        events.append({"ph": "X", "name": "ThunkExecutor::Execute", "ts": t, "dur": 9e9, "args": {"run_id": f"d{i}"}})
    events += [event("ffi_call.9", "p", 50_000, 7000)]  # another program (a prefill step): left out
    (trace / "x.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))

    steps, wall, rows = thunk_table(tmp_path / "trace", hlo)
    assert steps == 3
    assert wall == 2.3  # the median step spans 2000 + 300 us
    assert rows == [
        (2.0, "ffi_call.1", "meshserve_panel_matmul f32[8,960]{1,0}"),
        (0.3, "fusion.2", "fusion f32[8,576]{1,0}"),
    ]
