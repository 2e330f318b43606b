"""benchmarks/peers.py's MBU/MFU columns and roofline column on hand-made results (no engine runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from model.config import LlamaConfig

spec = importlib.util.spec_from_file_location("peers", Path(__file__).parent.parent / "benchmarks" / "peers.py")
assert spec is not None and spec.loader is not None
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)

TINY = LlamaConfig.tiny()  # matmul weights 24576 + 49152 + 16384 = 90112, norms 320; KV 512 B/token in fp32
MACHINE = {"read_bytes_per_s": 1e9, "float32_flops": 1e9}
WL = {"prompt_len": 8, "new_tokens": 4, "batches": [1, 2], "ttft_prompt": list(range(16))}


def result(tpot_ms: float) -> dict:
    batches = {str(b): {"tpot_ms": tpot_ms, "decode_tok_s": b / tpot_ms * 1e3, "ttft_s": 0.01} for b in (1, 2)}
    return {"status": "ok", "batches": batches, "ttft_long_s": 0.5, "ttft_long_prefill_tok_s": 32.0, "load_s": 1.0}


def test_mbu_mfu_and_the_roofline_column() -> None:
    results = {"meshserve fp32": result(1.0), "llama.cpp Q4_1": result(0.5), "vLLM-CPU fp32": {"status": "failed: x"}}
    roof = peers.add_utilization(results, WL, MACHINE, TINY)
    # B=1 at context 8 + 4/2 = 10: (90112 + 320) x 4 + 10 x 512 bytes, 2 x 90112 + 4 x 10 x L2 x N4 x H16 FLOPs,
    # over a 1 ms step at 1 GB/s and 1 GFLOP/s.
    b1 = results["meshserve fp32"]["batches"]["1"]
    assert b1["mbu"] == pytest.approx(((90112 + 320) * 4 + 10 * 512) / 1e-3 / 1e9)
    assert b1["mfu"] == pytest.approx((2 * 90112 + 4 * 10 * 2 * 4 * 16) / 1e-3 / 1e9)
    assert b1["predicted_tpot_ms"] == pytest.approx(((90112 + 320) * 4 + 10 * 512) / 1e9 * 1e3)  # memory-bound
    q4 = results["llama.cpp Q4_1"]["batches"]["1"]
    assert q4["mbu"] is None and q4["mfu"] == pytest.approx(2 * b1["mfu"])  # same FLOPs in half the time
    assert results["meshserve fp32"]["ttft_long_mfu"] > 0 and "batches" not in results["vLLM-CPU fp32"]
    # The roofline's own step: memory-bound, so MBU 100 %; its TPOT is the prediction.
    assert roof["batches"]["1"]["mbu"] == pytest.approx(1.0)
    assert roof["batches"]["1"]["tpot_ms"] == pytest.approx(b1["predicted_tpot_ms"])
    assert roof["ttft_long_mfu"] <= 1.0 + 1e-9
    text = peers.table({**results, peers.ROOFLINE: roof}, WL)
    lines = {line[:28].strip(): line for line in text.splitlines()}
    assert peers.ROOFLINE in lines["figure"]
    assert "36.7%" in lines["MBU decode, B=1"] and "100.0%" in lines["MBU decode, B=1"]
    assert lines["MBU decode, B=1"].split()[4] == "-"  # Q4_1's cell
    assert "MFU TTFT, 1 x 16" in lines


def test_ttft_against_the_floor_at_the_sgemm_rate_measured_next_to_it() -> None:
    """A worker's own sgemm probe (taken around its 512-token TTFT) sets that engine's floor: at
    twice the machine's rate, a compute-bound prefill's floor is half the roofline column's."""
    probed = {**result(1.0), "ttft_long_probe_flops": 2e9}
    results = {"meshserve fp32": probed, "HF transformers fp32": result(1.0)}  # HF: no probe
    roof = peers.add_utilization(results, WL, MACHINE, TINY)
    assert roof["ttft_long_mfu"] == pytest.approx(1.0)  # compute-bound at 16 tokens
    assert probed["ttft_long_floor_ratio"] == pytest.approx(0.5 / (roof["ttft_long_s"] / 2))
    assert "ttft_long_floor_ratio" not in results["HF transformers fp32"]
    lines = {line[:28].strip(): line for line in peers.table({**results, peers.ROOFLINE: roof}, WL).splitlines()}
    assert lines["sgemm GFLOP/s at that TTFT"].split()[5] == "2"
    assert lines["TTFT / its compute floor"].split()[5] == f"{probed['ttft_long_floor_ratio']:.2f}"


def test_sgemm_rate_is_positive() -> None:
    assert peers.sgemm_rate(n=64, repeats=1) > 0
