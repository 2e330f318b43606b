"""benchmarks/long_context.py: the ratios it prints, its argument check, and one real run against
two tiny-model servers it starts itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import long_context


def test_ratios_are_each_length_over_the_shortest_per_batch() -> None:
    points = [
        {"max_seq_len": 8192, "batch": 1, "tpot_p50_ms": 22.0},
        {"max_seq_len": 256, "batch": 1, "tpot_p50_ms": 20.0},
        {"max_seq_len": 256, "batch": 8, "tpot_p50_ms": 40.0},
        {"max_seq_len": 8192, "batch": 8, "tpot_p50_ms": 30.0},
        {"max_seq_len": 2048, "batch": 8, "tpot_p50_ms": 50.0},
    ]
    got = [(r["batch"], r["max_seq_len"], r["baseline_max_seq_len"], r["ratio"]) for r in long_context.ratios(points)]
    assert got == [(1, 8192, 256, pytest.approx(1.1)), (8, 2048, 256, 1.25), (8, 8192, 256, 0.75)]


def test_a_length_too_short_for_the_requests_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        long_context.main(["--lengths", "100", "8192", "--prompt-len", "64", "--output-len", "64"])
    assert exc.value.code == 2
    assert "every length must hold 64 + 64 ids" in capsys.readouterr().err


def test_a_real_run_serves_every_point(tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lc.json"
    args = ["--model", str(tiny_gguf), "--lengths", "64", "256", "--batches", "1", "2", "--prompt-len", "16"]
    rc = long_context.main([*args, "--output-len", "8", "--rounds", "1", "--timeout", "600", "--json", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    result = json.loads(out.read_text())
    points = {(p["max_seq_len"], p["batch"]): p for p in result["points"]}
    assert set(points) == {(64, 1), (64, 2), (256, 1), (256, 2)}
    assert all(p["completed"] == p["batch"] and p["failed"] == 0 and p["tpot_p50_ms"] > 0 for p in points.values())
    assert [(r["batch"], r["max_seq_len"]) for r in result["ratios"]] == [(1, 256), (2, 256)]
    assert "batch   2: TPOT at 256 / at 64 = " in printed


def test_kv_memory_runs_a_big_and_a_small_pool(
    tiny_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/kv_memory.py on the tiny model: 6 requests of 12 + 20 ids need 192 positions;
    a pool of 256 holds them without preemption, one of 64 preempts, and every request's ids are
    the first run's."""
    from benchmarks import kv_memory

    out = tmp_path / "m.json"
    rc = kv_memory.main([
        "--model", str(tiny_gguf), "--pools", "256", "64", "--slots", "6", "--max-seq-len", "128", "--requests", "6",
        "--prompt-len", "12", "--output-len", "20", "--serve-arg=--page-size", "--serve-arg=4", "--json", str(out),
    ])  # fmt: skip
    assert rc == 0, capsys.readouterr().out
    big, small = json.loads(out.read_text())["rows"]
    assert (big["pool_tokens"], small["pool_tokens"]) == (256, 64)
    assert big["preemptions"] == 0 and small["preemptions"] >= 1
    assert big["failed"] == small["failed"] == 0
    assert big["identical_to_first"] == small["identical_to_first"] == 6
    assert big["needed_tokens"] == 192 and big["slots_engine_bytes"] == 6 * 128 * big["pool_bytes"] // 256
