"""``meshserve-bench sweep`` end to end on the tiny random model: every point measured, every field
written to CSV and JSON (no timing thresholds: the numbers depend on the machine), and the plots
drawn when matplotlib is installed.

Runs on the 8 CPU devices conftest.py requests.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest

from benchmarks.cli import main
from benchmarks.sweep import FIELDS, SweepConfig, make_prompts, pareto_front

LAYOUTS = ["1x1", "1x2"]
BATCHES = [1, 2]
TIMED = ["prefill_ms", "prefill_tok_s", "tpot_ms", "tpot_min_ms", "step_ms", "decode_call_ms", "decode_tok_s", "compile_s",
         "setup_s"]  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    argv = ["sweep", "--tiny", "--layouts", *LAYOUTS, "--batches", *map(str, BATCHES), "--prompt-lens", "8"]
    # cpu-peers-md: the roofline overlay from fixed figures (no measuring of the machine).
    argv += ["--steps", "2", "--warmup-steps", "1", "--hardware", "cpu-peers-md", "--out", str(out)]
    assert main(argv) == 0
    return out


def test_csv_has_a_row_per_point_with_every_field(results: Path) -> None:
    with (results / "sweep.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == FIELDS
        rows = list(reader)
    assert [(r["layout"], int(r["batch"]), int(r["prompt_len"])) for r in rows] == [
        (layout, b, 8) for layout in LAYOUTS for b in BATCHES
    ]
    for r in rows:
        assert r["status"] == "ok", r["status"]
        for key in TIMED:
            assert float(r[key]) >= 0, key
        assert float(r["tpot_ms"]) > 0 and float(r["prefill_ms"]) > 0
        assert int(r["steps"]) == 2 and int(r["warmup_steps"]) == 1
        assert int(r["devices"]) == int(r["data"]) * int(r["model"]) == int(r["layout"][-1])


def test_json_rows_and_meta(results: Path) -> None:
    data = json.loads((results / "sweep.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["num_devices"] == 8 and meta["platform"] == "cpu"
    assert meta["config"]["hidden_size"] == 64  # LlamaConfig.tiny()
    assert meta["sweep"]["batches"] == BATCHES and meta["sweep"]["layouts"] == LAYOUTS
    assert len(rows) == len(LAYOUTS) * len(BATCHES)
    for r in rows:
        assert set(r) == set(FIELDS)
        # decode throughput is the batch over the step time
        assert r["decode_tok_s"] == pytest.approx(r["batch"] / (r["tpot_ms"] / 1e3))
        assert r["max_seq_len"] == 8 + 1 + 2 + 1
        assert r["attention"] == "heads"  # tiny: 4 query / 2 KV heads split over 1 or 2
        assert r["layers"] == "scan"  # --layers auto on CPU devices
        # the decode call is part of each serial step, so its median is at most the step's; the
        # TPOT (pipelined: the next step dispatched before the ids are read) is timed apart
        assert 0 < r["decode_call_ms"] <= r["step_ms"] and r["tpot_ms"] > 0
        assert r["tpot_min_ms"] <= r["tpot_ms"] <= r["tpot_max_ms"]
        assert r["layers"] in ("scan", "unrolled") and r["kv_dtype"] == "float32"  # resolved, not "auto"
    if meta["roofline"].startswith("roofline overlay"):
        for r in rows:
            assert r["predicted_tpot_ms"] > 0 and r["predicted_regime"] in ("memory", "compute")
            assert r["roofline_fraction"] == pytest.approx(r["predicted_tpot_ms"] / r["tpot_ms"])
            for key in ("mbu", "mfu", "prefill_mfu", "predicted_ttft_ms"):
                assert math.isfinite(r[key]) and r[key] > 0, key
    else:
        pytest.fail(f"the cpu-peers-md overlay is missing: {meta['roofline']}")


def test_mbu_and_mfu_against_the_roofline(results: Path) -> None:
    """mbu/mfu are the roofline's per-device bytes and FLOPs of the step over the measured time, over
    the cpu-peers-md figures (25 GB/s, 148 GFLOP/s, shared by the layout's devices)."""
    from benchmarks import roofline as rl
    from model.config import LlamaConfig

    hw = rl.load_hardware("cpu-peers-md")
    for r in json.loads((results / "sweep.json").read_text())["rows"]:
        par = rl.Parallelism(dp=r["data"], tp=r["model"], attention=r["attention"])
        wl = rl.Workload(batch=r["batch"] // par.dp, context_len=r["decode_window"], dtype="float32")
        per_device = hw.per_device(par.num_devices)
        step = rl.decode_step(LlamaConfig.tiny(), per_device, par, wl)
        tpot_s = r["tpot_ms"] / 1e3
        assert r["mbu"] == pytest.approx(step.memory_bytes / tpot_s / per_device.hbm_bytes_per_s)
        assert r["mfu"] == pytest.approx(step.flops / tpot_s / per_device.peak("float32"))


def test_plots_when_matplotlib_is_installed(results: Path) -> None:
    pngs = [results / "pareto.png", results / "step_time.png"]
    if importlib.util.find_spec("matplotlib") is None:
        assert not any(p.exists() for p in pngs)
        return
    for p in pngs:
        assert p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_skipped_points_are_rows_with_reasons(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A layout whose data axis does not divide the batch, or that needs more devices than exist:
    rows with the reason; with nothing measured at all, the exit status is 1 and says so."""
    argv = ["sweep", "--tiny", "--layouts", "2x1", "1x16", "--batches", "1", "--prompt-lens", "4"]
    assert main([*argv, "--steps", "1", "--warmup-steps", "0", "--hardware", "none", "--out", str(tmp_path)]) == 1
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["status"].split(":")[0] for r in rows] == ["skipped", "skipped"]
    assert "data axis" in rows[0]["status"] and "16" in rows[1]["status"]
    err = capsys.readouterr().err
    assert "no point was measured" in err and "matplotlib missing" not in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--tiny", "--model", "x.gguf"], "drop --model or --tiny"),
        (["--tiny", "--out", "FILE"], "is a file"),
    ],
)
def test_contradictory_flags_exit_before_measuring(tmp_path: Path, extra: list[str], message: str) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    extra = [str(afile) if a == "FILE" else a for a in extra]
    with pytest.raises(SystemExit, match=message):
        main(["sweep", *extra, "--batches", "1", "--prompt-lens", "4"])


@pytest.mark.parametrize("flag", [["--cpu-devices", "0"], ["--batches", "-1"], ["--steps", "0"]])
def test_nonpositive_counts_are_usage_errors(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["sweep", "--tiny", *flag])
    assert exc.value.code == 2 and "must be >= " in capsys.readouterr().err


def test_helpers() -> None:
    a = make_prompts(4, 8, 256, seed=0)
    assert a.shape == (4, 8) and (make_prompts(2, 8, 256, seed=0) == a[:2]).all()
    assert pareto_front([(1.0, 10.0), (2.0, 30.0), (3.0, 20.0), (4.0, 40.0)]) == [(1.0, 10.0), (2.0, 30.0), (4.0, 40.0)]
    with pytest.raises(ValueError, match="max_seq_len"):
        SweepConfig(prompt_lens=(128,), max_seq_len=64)


def test_the_model_to_time_loads_through_load_model(tmp_path: Path) -> None:
    """A GGUF path is read by model.weights.loader.load_model (host float32 weights); --random reads only
    its config; --tiny reads nothing."""
    import numpy as np
    from flax import nnx
    from tiny_gguf import write_tiny_llama_gguf

    from benchmarks.sweep import model_to_time
    from model.config import LlamaConfig
    from model.weights.gguf_weights import load_gguf_params

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    cfg, _, params, source = model_to_time(str(path), None, random=False, tiny=False)
    assert cfg == LlamaConfig.from_gguf(path) and source == f"{path} (gguf)"
    expected = load_gguf_params(path, cfg)
    np.testing.assert_array_equal(nnx.to_pure_dict(params)["embed"], expected["embed"])
    cfg_r, _, random_params, source_r = model_to_time(str(path), None, random=True, tiny=False, seed=1)
    assert cfg_r == cfg and source_r == f"random weights at the shapes of {path}"
    assert not np.array_equal(np.asarray(nnx.to_pure_dict(random_params)["embed"]), expected["embed"])
    assert model_to_time(None, None, random=False, tiny=True)[0] == LlamaConfig.tiny()


def test_int8_weights_are_priced_as_their_blocks(tmp_path: Path) -> None:
    """``--weights int8``: the MBU counts the Q8_0 blocks' bytes (``roofline.held_weights``), not
    float32's: the measured step's bytes over its time are the held ones'."""
    from benchmarks import roofline as rl
    from model.config import LlamaConfig
    from sharding.layouts import Layout
    from sharding.plan import make_plan

    argv = ["sweep", "--tiny", "--weights", "int8", "--layouts", "1x1", "--batches", "1", "--prompt-lens", "8"]
    assert (
        main([*argv, "--steps", "2", "--warmup-steps", "1", "--hardware", "cpu-peers-md", "--out", str(tmp_path)]) == 0
    )
    (r,) = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    cfg, hw = LlamaConfig.tiny(), rl.load_hardware("cpu-peers-md")
    plan = make_plan(Layout("1x1", data=1, model=1), cfg)
    par = rl.Parallelism(dp=1, tp=1, attention=r["attention"])
    wl = rl.Workload(batch=1, context_len=r["decode_window"], dtype="float32")
    # tiny's int8 (random_block_llama): every matmul weight and the tied embedding as Q8_0 blocks
    held = rl.held_weights(cfg, plan, 4, {name: "q8_0" for name in ("wqkv", "wo", "w_gate_up", "w_down", "embed")})
    step = rl.decode_step(cfg, hw, par, wl, held)
    floats = rl.decode_step(cfg, hw, par, wl)
    assert step.weight_bytes < 0.5 * floats.weight_bytes  # Q8_0: 34 bytes per 32 weights against 128
    assert r["mbu"] == pytest.approx(step.memory_bytes / (r["tpot_ms"] / 1e3) / hw.hbm_bytes_per_s)
