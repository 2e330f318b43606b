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

spec = importlib.util.spec_from_file_location(
    "cpu_ceilings", Path(__file__).parent.parent / "benchmarks" / "cpu_ceilings.py"
)
assert spec is not None and spec.loader is not None
ceilings = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ceilings)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ceilings.build(tmp_path_factory.mktemp("probe"))


def test_fma_work_is_threads_iterations_chains_lanes_and_two(probe: Path) -> None:
    # 2 threads x 1000 trips x 24 vectors x 16 lanes x 2 FLOPs per fused multiply-add
    work, seconds = ceilings.run_probe(probe, "fma", 2, 1000, 2)
    assert work == 2 * 1000 * 24 * 16 * 2
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
