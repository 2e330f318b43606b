"""``benchmarks/decode_floor.py`` end to end on a tiny Q4_1 GGUF (its blocks served as stored):
every figure measured and consistent with the others (no timing thresholds: they depend on the
machine), and the summary's arithmetic on given numbers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tiny_gguf import write_tiny_llama_gguf

from benchmarks.decode_floor import main, shrunk, summary
from model.config import LlamaConfig


def test_the_summary_of_given_figures() -> None:
    r = summary(floor=0.001, model=0.009, weight_bytes=96_000_000, read_bytes_per_s=24e9, target_s=0.006)
    assert r["best_s"] == pytest.approx(0.001 + 0.004)
    assert r["best_over_model"] == pytest.approx(0.005 / 0.009)
    assert r["weights_read_bytes_per_s"] == pytest.approx(12e9)  # 96 MB in the 8 ms above the floor
    assert r["weights_read_share"] == pytest.approx(0.5)
    assert r["target_read_share"] == pytest.approx(96e6 / 0.005 / 24e9)  # 80 %
    assert summary(0.002, 0.009, 1, 1.0, target_s=0.001)["target_read_share"] == math.inf


def test_the_floor_model_keeps_the_layers_and_shrinks_the_widths(tmp_path: Path) -> None:
    cfg = LlamaConfig.from_gguf(write_tiny_llama_gguf(tmp_path / "tiny.gguf", num_layers=3))
    small = shrunk(cfg)
    assert small.num_layers == 3 and small.tie_word_embeddings == cfg.tie_word_embeddings
    assert (small.hidden_size, small.intermediate_size, small.vocab_size) == (64, 128, 256)


def test_a_run_on_a_tiny_q4_1_model(tmp_path: Path) -> None:
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", num_layers=3, quantize="Q4_1")
    out = tmp_path / "floor.json"
    argv = ["--model", str(model), "--prompt-len", "16", "--new-tokens", "8", "--rounds", "2", "--read-mb", "64"]
    assert main([*argv, "--target-ms", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["layer_format"] == "q4_1" and r["layers"] == 3 and r["rounds"] == 2
    assert len(r["floor_rounds_s"]) == len(r["model_rounds_s"]) == 2
    assert all(t > 0 for t in r["floor_rounds_s"] + r["model_rounds_s"])
    assert r["weight_bytes"] > 0 and r["read_bytes_per_s"] > 1e8
    assert r["best_s"] == pytest.approx(r["floor_s"] + r["weight_bytes"] / r["read_bytes_per_s"])
    assert r["target_s"] == pytest.approx(1e-3)
