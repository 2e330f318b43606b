"""The native kernels built for the AVX2 target (``MESHSERVE_NATIVE_MARCH=x86-64-v3``) as well as
for this CPU: the kernels' correctness checks run again, in a subprocess, against the x86-64-v3
build. On an AVX-512 machine that exercises the AVX2 code path (8-float vectors, 16 registers'
tiles); on an AVX2 machine, a second AVX2 build. The probe of benchmarks/cpu_ceilings.py is
built for both targets by tests/test_cpu_ceilings.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import cpu_flags

from model import native

ROOT = Path(__file__).resolve().parent.parent


RUNS_AVX2 = platform.machine() in native.SUPPORTED_MACHINES and {"avx2", "fma"} <= cpu_flags()

# The kernel-level checks (no engine, no real model): every kernel, each tile-size branch.
CHECKS = [
    "tests/test_cpu_matmul.py::test_matmul_matches_numpy",
    "tests/test_cpu_matmul.py::test_stacked_panels_multiply_by_the_layer_they_are_given_inside_a_scan",
    "tests/test_cpu_matmul.py::test_mismatched_k_is_an_error_not_a_crash",
    "tests/test_cpu_matmul.py::test_the_packed_model_computes_the_unpacked_ones_logits",
    "tests/test_quant_matmul.py::test_matmul_matches_float64",
    "tests/test_quant_matmul.py::test_auto_path_agrees_with_xla_on_wide_scales",
    "tests/test_quant_matmul.py::test_stacked_layers_by_traced_index_in_jit_and_scan",
    "tests/test_quant_matmul.py::test_layer_out_of_range_is_an_error_not_a_crash",
    "tests/test_quant_matmul.py::test_mismatched_k_is_an_error_not_a_crash",
    "tests/test_paged_attention.py::test_the_native_kernel_matches_dense_attention",
    "tests/test_paged_attention.py::test_the_native_kernel_reads_a_bfloat16_cache",
    "tests/test_paged_attention.py::test_an_int8_cache",  # its native case: the AVX2 int8 widening
    "tests/test_paged_attention.py::test_the_native_kernel_equals_xla_for_every_group_size",
    "tests/test_paged_attention.py::test_the_native_kernel_gives_zeros_past_the_table_and_clips_page_ids",
    "tests/test_paged_attention.py::test_the_native_kernels_bad_operands_are_errors_not_crashes",
    "tests/test_native_paged_prefill.py",  # the prefill kernel: every test of it
    "tests/test_sampling.py::test_first_argmax_matches_argmax_with_ties_and_infinities",
]
# Run first in the subprocess: the build it loads is the AVX2 one.
WHICH_BUILD = "from model import native as n; print(n.available(), n.isa(), n.library_path().name)"


def test_the_checks_name_tests_that_exist() -> None:
    """Every check the AVX2 run names is a test of its file (a renamed test would otherwise fail
    only on machines that run the rebuild)."""
    for check in CHECKS:
        path, _, name = check.partition("::")
        source = (ROOT / path).read_text()
        assert not name or f"def {name}(" in source, check


def test_march_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(native.MARCH_ENV, raising=False)
    assert native.march() == "native" and "-march=native" in native.flags()
    default = native.library_path()
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.march() == "x86-64-v3" and "-march=x86-64-v3" in native.flags()
    assert native.library_path() != default  # the target is part of the cache key
    monkeypatch.setenv(native.MARCH_ENV, "native; rm -rf /")
    with pytest.raises(ValueError, match="not a -march value"):
        native.march()


@pytest.mark.skipif(
    platform.machine() not in native.SUPPORTED_MACHINES, reason="x86-64 -march names need an x86-64 compiler"
)
def test_isa_is_the_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v3")
    assert native.isa() == "avx2"
    monkeypatch.setenv(native.MARCH_ENV, "x86-64-v4")
    assert native.isa() == "avx512"  # asked of the compiler: no AVX-512 CPU needed
    monkeypatch.setenv(native.MARCH_ENV, "x86-64")
    assert native.isa() == "other"  # SSE2 only
    monkeypatch.delenv(native.MARCH_ENV)
    flags = cpu_flags()
    assert native.isa() == ("avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other")


@pytest.mark.skipif(not RUNS_AVX2, reason="an x86-64 CPU with AVX2 and FMA runs x86-64-v3 code; this one does not")
def test_kernels_built_for_x86_64_v3_pass_their_checks() -> None:
    env = {**os.environ, native.MARCH_ENV: "x86-64-v3"}
    which = subprocess.run(
        [sys.executable, "-c", WHICH_BUILD], cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=900
    )
    available, isa, name = which.stdout.split()
    assert (available, isa) == ("True", "avx2"), which.stderr[-2000:]
    assert name != native.library_path().name  # not this process's -march=native build
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CHECKS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
