"""benchmarks/cpu_ceilings.py: the probe's work counts by hand, its argument checks, and a small
end-to-end run writing JSON (no timed assertions: rates only have to be positive and finite)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from helpers import cpu_flags

spec = importlib.util.spec_from_file_location(
    "cpu_ceilings", Path(__file__).parent.parent / "benchmarks" / "cpu_ceilings.py"
)
assert spec is not None and spec.loader is not None
ceilings = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceilings)


# -march targets the probe must build and run for: this CPU, and AVX2 (x86-64-v3) wherever the
# CPU runs AVX2 code (on an AVX-512 machine that exercises the probe's AVX2 path).
MARCHES = ["native"] + (["x86-64-v3"] if {"avx2", "fma"} <= cpu_flags() else [])


@pytest.fixture(scope="module", params=MARCHES)
def probe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ceilings.build(tmp_path_factory.mktemp(f"probe-{request.param}-"), march=request.param)


def test_probe_vectors_are_one_register_of_the_target(probe: Path) -> None:
    # AVX-512: 24 chains of 16 floats (zmm); AVX (x86-64-v3 and AVX2 CPUs): 12 of 8 (ymm)
    flags = cpu_flags()
    if "probe-x86-64-v3-" in probe.parent.name:
        expected = (8, 12)
    else:
        expected = (16, 24) if "avx512f" in flags else (8, 12) if "avx" in flags else (4, 12)
    assert ceilings.probe_shape(probe) == expected


def test_fma_work_is_threads_iterations_chains_lanes_and_two(probe: Path) -> None:
    # 2 threads x 1000 trips x CHAINS vectors x LANES lanes x 2 FLOPs per fused multiply-add
    lanes, chains = ceilings.probe_shape(probe)
    work, seconds = ceilings.run_probe(probe, "fma", 2, 1000, 2)
    assert work == 2 * 1000 * chains * lanes * 2
    assert 0 < seconds < 10


def test_read_work_is_the_buffer_in_whole_floats(probe: Path) -> None:
    work, seconds = ceilings.run_probe(probe, "read", 2, 1_000_003, 1)
    assert work == 1_000_000  # 250000 floats; the 3 odd bytes are not a float
    assert 0 < seconds < 10


@pytest.mark.parametrize("args", [["fma", "0", "10", "1"], ["read", "1", "0", "1"], ["copy", "1", "10", "1"]])
def test_probe_rejects_bad_arguments(probe: Path, args: list[str]) -> None:
    with pytest.raises(subprocess.CalledProcessError):
        ceilings.run_probe(probe, args[0], int(args[1]), int(args[2]), int(args[3]))


def test_main_writes_every_figure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ceilings.json"
    assert ceilings.main(["--fma-iters", "20000", "--read-mb", "8", "--repeats", "1", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    cores = os.cpu_count() or 1
    assert got["cores"] == cores
    assert set(got["fma_flops"]) == set(got["read_bytes_per_s"]) == {"1", str(cores)}
    rates = [*got["fma_flops"].values(), *got["read_bytes_per_s"].values()]
    rates += [got["numpy_sgemm_flops"], got["numpy_sgemv_bytes_per_s"]]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    printed = capsys.readouterr().out
    assert "FMA peak" in printed and "of the" in printed


def test_main_rejects_nonpositive_sizes() -> None:
    with pytest.raises(SystemExit):
        ceilings.main(["--read-mb", "0"])
