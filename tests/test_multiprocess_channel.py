"""``python -m benchmarks.multiprocess_channel`` end to end, a few steps: two real jax.distributed
processes of 4 CPU devices each (8 in all), every channel's plans arriving equal to the ones sent,
the collectives over both processes giving the right values (no timing thresholds: they depend on
the machine); the plan's packing on its own; and a worker that fails failing the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.multiprocess_channel import (
    CHANNELS,
    COLLECTIVES,
    EXIT_NO_DISTRIBUTED,
    pack,
    plan_arrays,
    plan_size,
    plans_equal,
    unpack,
)

ROOT = Path(__file__).resolve().parent.parent
STEPS = 5


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "benchmarks.multiprocess_channel", *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:  # type: ignore[type-arg]
    out = tmp_path_factory.mktemp("mp") / "mp.json"
    steps = ["--steps", str(STEPS), "--warmup", "1", "--collective-steps", "2", "--chain-steps", "1"]
    done = run(*steps, "--timeout", "90", "--json", str(out))
    # jax.distributed on localhost needs nothing but the package: failing to start is a failure.
    assert done.returncode != EXIT_NO_DISTRIBUTED, f"jax.distributed.initialize failed: {done.stderr[-4000:]}"
    assert done.returncode == 0, done.stderr[-4000:]
    assert "broadcast_one_to_all" in done.stdout
    return json.loads(out.read_text())


def test_two_processes_of_four_devices_form_one_mesh(summary: dict) -> None:  # type: ignore[type-arg]
    assert [w["process_index"] for w in summary["workers"]] == [0, 1]
    for w in summary["workers"]:
        assert (w["device_count"], w["local_device_count"], w["process_count"]) == (8, 4, 2)
        assert w["backend"] == "cpu" and w["cpu_collectives_implementation"] == "gloo"


def test_every_channel_delivers_the_plan_sent(summary: dict) -> None:  # type: ignore[type-arg]
    assert [r["channel"] for r in summary["channels"]] == list(CHANNELS)
    for r in summary["channels"]:
        assert r["plans_equal"] is True and r["checked"] == STEPS == r["steps"], r["channel"]
        assert r["send"]["median_ms"] > 0 and 0 < r["deliver"]["median_ms"] <= r["deliver"]["max_ms"]
    kv = next(r for r in summary["channels"] if r["channel"] == "kv_store")
    assert kv["cleanup"]["median_ms"] > 0  # the delete of each step's key, timed apart


def test_collectives_across_both_processes_give_the_right_values(summary: dict) -> None:  # type: ignore[type-arg]
    rows = {c["name"]: c for c in summary["collectives"]}
    assert list(rows) == list(COLLECTIVES)
    assert all(c["value_ok"] for c in rows.values())
    assert rows["psum"]["devices"] == 8 and rows["psum x60"]["all_reduces"] == 60
    assert rows["psum local"]["devices"] == 4
    assert summary["settings"]["plan_bytes"] == 4 * plan_size(64, 64) == 16928


def test_pack_and_unpack_round_trip() -> None:
    for step in range(3):
        plan = plan_arrays(step, 64, 64)
        buf = pack(plan)
        assert buf.dtype == np.int32 and buf.shape == (plan_size(64, 64),)
        got = unpack(np.frombuffer(buf.tobytes(), np.int32), 64, 64)
        assert plans_equal(got, plan) and plans_equal(plan_arrays(step, 64, 64), plan)
    changed = unpack(pack(plan_arrays(0, 64, 64)).copy(), 64, 64)
    changed["page_table"][3, 5] += 1
    assert not plans_equal(changed, plan_arrays(0, 64, 64))
    assert not plans_equal(plan_arrays(0, 64, 64), plan_arrays(1, 64, 64))


def test_a_failed_worker_fails_the_run_with_its_stderr() -> None:
    # SIGALRM at the workers' own 1-second limit, before they finish starting JAX
    done = run("--steps", "1", "--timeout", "1", timeout=60)
    assert done.returncode == 1
    assert "killed by SIGALRM" in done.stderr and "stderr" in done.stderr
