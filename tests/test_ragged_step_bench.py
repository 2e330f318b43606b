"""``python -m benchmarks.ragged_step`` end to end on the tiny random model: every variant measured
(the XLA attention backend, and the native one where its kernels are built), its JSON fields
present and positive, each row's ratio against the XLA row of its own case and layout (real values
from a real run; no timing thresholds: they depend on the machine)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import pytest

from benchmarks.ragged_step import config, main
from model.attention import cpu as cpu_attention


def test_a_tiny_run_measures_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "ragged.json"
    argv = ["--config", "tiny", "--runs", "2", "--window", "32", "--position", "20", "--prompt", "24"]
    assert main([*argv, "--page-size", "8", "--seq-blocks", "0", "8", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    native = cpu_attention.available() and jax.default_backend() == "cpu"  # the native backend's variants
    assert result["native"] == native
    backends = ["xla", "native"] if native else ["xla"]
    assert [(r["case"], r["variant"]) for r in rows] == [
        *[("decode", b) for b in backends],
        *[("prefill", f"{b} per token") for b in backends],
        *[("prefill", f"{b} seq_block=8") for b in backends],
    ]
    for r in rows:
        assert r["runs"] == 2
        for key in ("median_ms", "min_ms", "ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        assert r["min_ms"] <= r["median_ms"]
        assert r["baseline"] == "xla" + r["variant"][len(r["variant"].split(" ")[0]) :]
    by = {(r["case"], r["variant"]): r for r in rows}
    for r in rows:
        assert r["ratio"] == pytest.approx(r["median_ms"] / by[r["case"], r["baseline"]]["median_ms"])
    assert [r["ratio"] for r in rows if r["variant"].startswith("xla")] == [1.0, 1.0, 1.0]
    assert result["num_pages"] == 4 * 32 // 8  # the decode case's pages: 4 sequences x the window


def test_one_case_only_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "tiny", "--runs", "1", "--window", "16", "--position", "3", "--prompt", "8"]
    assert main([*argv, "--page-size", "8", "--cases", "decode"]) == 0
    assert "prefill  " not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="multiple of --page-size"):
        main(["--config", "tiny", "--window", "20", "--page-size", "8"])
    with pytest.raises(ValueError, match="unknown config"):
        config("huge")
