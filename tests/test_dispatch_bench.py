"""``python -m benchmarks.dispatch`` end to end on the tiny random model, both layer loops of the
served engine (``Runner``), two maximum lengths: every row measured, its JSON fields present and
positive (real values from a real run; no timing thresholds: they depend on the machine), the
argument leaves counted as the step's arguments are, and one ratio per layer loop."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from benchmarks.dispatch import CONFIGS, config, main, memory_needed, parse_max_lens
from model.sampling import SamplingParams

MAX_LENS = [64, 256]  # 4 and 16 pages of 16 per row


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
        # a pool of slots x T tokens; a window covering position 16 (page 1), within a row's pages
        assert r["pool_pages"] * r["page_size"] == 4 * r["max_seq_len"]
        assert 2 <= r["window_pages"] <= r["max_seq_len"] // r["page_size"]
        assert isinstance(r["native_attention"], bool) and isinstance(r["native_matmul"], bool)
    # float32 panels are a form of the scanned loop's weights only (model.kernels.choose)
    assert not any(r["native_matmul"] for r in rows if r["layers"] == "unrolled")


def test_argument_leaves_do_not_grow_with_the_pool(results: dict) -> None:  # type: ignore[type-arg]
    """The pool is two arrays (K and V) at every T; the weights' and the rest's leaves do not
    depend on T. Unrolled weights are per-layer arrays: more leaves than the scan's stacks."""
    cfg = config("tiny")
    for r in results["rows"]:
        lv = r["leaves"]
        assert lv["cache"] == 2
        assert lv["total"] == lv["params"] + lv["cache"] + lv["other"]
        # 8 batch arrays and the previous output; the sampling arrays; counts and prompt mask
        assert lv["other"] == 9 + len(dataclasses.fields(SamplingParams)) + 2
        assert r["cache_bytes"] == cfg.kv_bytes_per_token(4) * r["max_seq_len"] * r["slots"]
    params = {}
    for form in ("unrolled", "scan"):
        same = {r["leaves"]["params"] for r in results["rows"] if r["layers"] == form}
        assert len(same) == 1
        params[form] = same.pop()
    assert params["unrolled"] > params["scan"]


def test_one_ratio_per_layer_loop(results: dict) -> None:  # type: ignore[type-arg]
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
    with pytest.raises(SystemExit):
        main(["--configs", "tiny", "--layers", "paged"])  # the per-slot forms and their "paged" rival are gone
    assert config("smollm2-135m").num_layers == 30 and config("32-layer").num_layers == 32
    assert config("32-layer").hidden_size == config("smollm2-135m").hidden_size == 576
    with pytest.raises(ValueError, match="known: " + ", ".join(CONFIGS)):
        config("nope")
    cfg = config("tiny")
    assert memory_needed(cfg, 256, 4) == cfg.kv_bytes_per_token(4) * 256 * 4 + 2 * 4 * cfg.param_count()
