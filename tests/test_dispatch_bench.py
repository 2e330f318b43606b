"""``python -m benchmarks.dispatch`` end to end on the tiny random model, both layer forms, two
maximum lengths: every row measured, its JSON fields present and positive (real values from a
real run; no timing thresholds: they depend on the machine), the argument leaves counted as the
cache's structure says, and one ratio per layer form."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from benchmarks.dispatch import CONFIGS, config, main, parse_max_lens
from model.kv_cache import BLOCK_LEN
from model.sampling import SamplingParams

MAX_LENS = [64, 256]  # one and two 128-position blocks per layer in the unrolled form


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("dispatch") / "dispatch.json"
    argv = ["--configs", "tiny", "--layers", "unrolled", "scan", "--max-lens", ",".join(map(str, MAX_LENS))]
    assert main([*argv, "--position", "16", "--calls", "3", "--warmup", "0", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_point_is_a_measured_row(results: dict) -> None:  # type: ignore[type-arg]
    rows = results["rows"]
    assert [(r["layers"], r["max_seq_len"]) for r in rows] == [(f, t) for f in ("unrolled", "scan") for t in MAX_LENS]
    for r in rows:
        assert r["status"] == "ok" and r["config"] == "tiny" and r["slots"] == 4 and r["calls"] == 3
        for key in ("call_ms", "call_min_ms", "step_ms", "step_min_ms", "setup_s", "first_call_s"):
            assert math.isfinite(r[key]) and r[key] > 0, key
        # the call is part of each timed step, so every step is at least its call
        assert r["call_min_ms"] <= r["call_ms"] and r["call_share"] > 0
        assert r["call_min_ms"] <= r["step_min_ms"]
        assert r["compile_s"] >= 0


def test_argument_leaves_follow_the_cache_structure(results: dict) -> None:  # type: ignore[type-arg]
    """Unrolled: 2 x L x ceil(T / 128) cache buffers; scan: one K and one V array. The weights'
    and the metadata's leaves do not depend on T."""
    cfg = config("tiny")
    for r in results["rows"]:
        lv = r["leaves"]
        blocks = -(-r["max_seq_len"] // BLOCK_LEN)
        assert lv["cache"] == (2 * cfg.num_layers * blocks if r["layers"] == "unrolled" else 2)
        assert lv["total"] == lv["params"] + lv["panels"] + lv["cache"] + lv["other"]
        # tokens, source, two previous outputs, positions; the sampling arrays; counts and prompt mask
        assert lv["other"] == 5 + len(dataclasses.fields(SamplingParams)) + 2
        assert r["cache_bytes"] == cfg.kv_bytes_per_token(4) * r["max_seq_len"] * r["slots"]
    for form in ("unrolled", "scan"):
        same = {(r["leaves"]["params"], r["leaves"]["panels"]) for r in results["rows"] if r["layers"] == form}
        assert len(same) == 1


def test_one_ratio_per_layer_form(results: dict) -> None:  # type: ignore[type-arg]
    by_form = {s["layers"]: s for s in results["ratios"]}
    assert set(by_form) == {"unrolled", "scan"}
    rows = {(r["layers"], r["max_seq_len"]): r for r in results["rows"]}
    for form, s in by_form.items():
        assert (s["smallest"], s["largest"]) == (MAX_LENS[0], MAX_LENS[-1])
        assert s["ratio"] == pytest.approx(rows[form, MAX_LENS[-1]]["call_ms"] / rows[form, MAX_LENS[0]]["call_ms"])
        assert s["target_met"] == (max(rows[form, t]["call_ms"] for t in MAX_LENS) <= 1.0 and s["ratio"] <= 1.2)
    assert results["meta"]["args"]["max_lens"] == MAX_LENS and results["meta"]["configs"]["tiny"]["num_layers"] == 2


def test_arguments() -> None:
    assert parse_max_lens("256,2048, 8192") == [256, 2048, 8192]
    for bad in ("", "1", "x,2"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"max lengths|integers"):
            parse_max_lens(bad)
    with pytest.raises(SystemExit, match="below every max length"):
        main(["--configs", "tiny", "--max-lens", "64", "--position", "64"])
    assert config("smollm2-135m").num_layers == 30 and config("32-layer").num_layers == 32
    assert config("32-layer").hidden_size == config("smollm2-135m").hidden_size == 576
    with pytest.raises(ValueError, match="known: " + ", ".join(CONFIGS)):
        config("nope")
