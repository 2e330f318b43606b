"""This CPU's two ceilings, measured directly: the float32 FMA peak and the streaming read bandwidth.

The roofline's "this machine" preset (``benchmarks.roofline.measure_cpu``) measures what numpy's
BLAS reaches (sgemm for FLOP/s, sgemv for bytes/s): achievable rates, not the hardware's. This
script measures the ceilings themselves, so a decode step's matmul and attention rates can be
read as fractions of them (Williams et al. 2009, "Roofline", section 2: the peak FLOP rate and
the peak memory bandwidth bound every kernel). A small C++ probe, compiled here with the
machine's ``g++ -O3 -march=native``, runs on 1 and on all cores:

* FMA peak: each thread updates CHAINS independent vectors of LANES floats, ``a = a * b + c``
  (one fused multiply-add each where the CPU has FMA: 2 FLOPs per lane), so no dependency chain
  limits it: with AVX-512, 24 chains of 16 floats (zmm; 24 of the 32 registers); with AVX2, 12
  of 8 (ymm; 12 of the 16, the rest hold b and c); both cover an FMA latency of 4-5 cycles at 2
  FMAs per cycle. The probe picks them from the target's ISA, and ``probe_shape`` reads them
  back; FLOP/s = threads x iterations x CHAINS x LANES x 2 / seconds.
* Streaming read: each thread sums its contiguous share of a ``--read-mb`` float32 buffer
  (written first, so every page is mapped) with four vector accumulators; bytes/s = buffer
  bytes / seconds.

Each figure is the best of ``--repeats`` runs; numpy's two probes are printed beside them with
their ratio to the ceiling. Figures measured with it are in docs/cpu-kernels.md.

    python benchmarks/cpu_ceilings.py
    python benchmarks/cpu_ceilings.py --json ceilings.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/cpu_ceilings.py` from a checkout

from benchmarks.roofline import measure_cpu  # noqa: E402
from model import native  # noqa: E402

PROBE = r"""
// meshserve benchmarks/cpu_ceilings.py probe: "fma THREADS ITERS" and "read THREADS BYTES"
// print "<work> <seconds>" (FLOPs or bytes), the best of REPEATS runs; "shape 1 1 1" prints
// "LANES CHAINS".
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
// One vector is one register of the target (a wider GCC vector is split through the stack),
// and the chains leave registers for b and c.
#if defined(__AVX512F__)
#define LANES 16
#define CHAINS 24
#define VREG "+v"  // any of zmm0-31
#elif defined(__AVX__)
#define LANES 8
#define CHAINS 12
#define VREG "+x"  // any of ymm0-15
#else
#define LANES 4
#define CHAINS 12
#define VREG "+x"  // an xmm register (x86-64's SSE2 baseline)
#endif
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));

static float fma_loop(long iters, float seed) {
  vf a[CHAINS];
  vf b = vf{} + 1.0000001f, c = vf{} + seed;
  for (int i = 0; i < CHAINS; ++i) a[i] = vf{} + static_cast<float>(i);
  for (long t = 0; t < iters; ++t) {
#pragma GCC unroll 24
    for (int i = 0; i < CHAINS; ++i) a[i] = a[i] * b + c;
    asm volatile("" : VREG(b));  // keeps the loop from being folded
  }
  float s = 0;
  for (int i = 0; i < CHAINS; ++i) s += a[i][0];
  return s;
}

static float read_share(const float* p, size_t n) {
  vf s0{}, s1{}, s2{}, s3{}, x;
  size_t i = 0;
  for (; i + 4 * LANES <= n; i += 4 * LANES) {
    std::memcpy(&x, p + i, sizeof x); s0 += x;
    std::memcpy(&x, p + i + LANES, sizeof x); s1 += x;
    std::memcpy(&x, p + i + 2 * LANES, sizeof x); s2 += x;
    std::memcpy(&x, p + i + 3 * LANES, sizeof x); s3 += x;
  }
  s0 += s1 + s2 + s3;
  float s = 0;
  for (int l = 0; l < LANES; ++l) s += s0[l];
  for (; i < n; ++i) s += p[i];
  return s;
}

template <typename F>
static double timed(int threads, F body) {
  std::vector<std::thread> ts;
  auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) ts.emplace_back(body, t);
  for (auto& t : ts) t.join();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main(int argc, char** argv) {
  if (argc != 5) { std::fprintf(stderr, "usage: probe fma|read THREADS N REPEATS\n"); return 2; }
  const std::string what = argv[1];
  const int threads = std::atoi(argv[2]), repeats = std::atoi(argv[4]);
  const long n = std::atol(argv[3]);
  if (threads < 1 || n < 1 || repeats < 1) { std::fprintf(stderr, "THREADS, N, REPEATS must be >= 1\n"); return 2; }
  std::vector<float> sink(threads);
  double best = 1e300, work = 0;
  if (what == "shape") {
    std::printf("%d %d\n", LANES, CHAINS);
    return 0;
  }
  if (what == "fma") {
    work = 2.0 * LANES * CHAINS * static_cast<double>(n) * threads;
    for (int r = 0; r < repeats; ++r)
      best = std::min(best, timed(threads, [&](int t) { sink[t] = fma_loop(n, 0.5f + t); }));
  } else if (what == "read") {
    const size_t count = static_cast<size_t>(n) / sizeof(float);
    std::vector<float> buf(count, 1.0f);  // written: every page mapped before the timing
    work = static_cast<double>(count * sizeof(float));
    for (int r = 0; r < repeats; ++r)
      best = std::min(best, timed(threads, [&](int t) {
        const size_t lo = count / threads * t, hi = t + 1 == threads ? count : count / threads * (t + 1);
        sink[t] = read_share(buf.data() + lo, hi - lo);
      }));
  } else {
    std::fprintf(stderr, "unknown probe %s\n", what.c_str());
    return 2;
  }
  std::printf("%.17g %.17g %g\n", work, best, static_cast<double>(sink[0]));
  return 0;
}
"""


def build(out_dir: Path, march: str = "native") -> Path:
    """Compile the probe into ``out_dir`` for ``-march=march``; returns the executable's path.

    Raises:
        RuntimeError: no C++ compiler, or it failed (its message attached).
    """
    cxx = native.compiler()
    src, exe = out_dir / "probe.cc", out_dir / "probe"
    src.write_text(PROBE)
    cmd = [cxx, "-O3", f"-march={march}", "-std=c++17", str(src), "-o", str(exe), "-pthread"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return exe


def run_probe(exe: Path, what: str, threads: int, n: int, repeats: int) -> tuple[float, float]:
    """One probe: (work, seconds), work in FLOPs ("fma", n iterations per thread) or bytes
    ("read", an n-byte buffer); seconds is the best of ``repeats`` runs.

    Raises:
        subprocess.CalledProcessError: the probe failed (bad arguments, out of memory).
    """
    out = subprocess.run([str(exe), what, str(threads), str(n), str(repeats)], capture_output=True, text=True,
                         check=True).stdout.split()  # fmt: skip
    return float(out[0]), float(out[1])


def probe_shape(exe: Path) -> tuple[int, int]:
    """(LANES, CHAINS) the probe was compiled with: floats per vector, vectors per FMA thread.

    Raises:
        subprocess.CalledProcessError: the probe failed.
    """
    out = subprocess.run([str(exe), "shape", "1", "1", "1"], capture_output=True, text=True, check=True).stdout.split()
    return int(out[0]), int(out[1])


def measure(threads: list[int], fma_iters: int, read_bytes: int, repeats: int) -> dict[str, Any]:
    """The ceilings at each thread count and numpy's probes: ``{"fma_flops": {threads: FLOP/s},
    "read_bytes_per_s": {threads: bytes/s}, "numpy_sgemm_flops", "numpy_sgemv_bytes_per_s"}``.

    Raises:
        RuntimeError: the probe could not be built; subprocess.CalledProcessError: it failed.
    """
    with tempfile.TemporaryDirectory(prefix="meshserve-ceilings-") as tmp:
        exe = build(Path(tmp))

        def rate(what: str, t: int, n: int) -> float:
            work, seconds = run_probe(exe, what, t, n, repeats)
            return work / seconds

        fma = {t: rate("fma", t, fma_iters) for t in threads}
        read = {t: rate("read", t, read_bytes) for t in threads}
    sgemv, sgemm = measure_cpu()
    return {"fma_flops": fma, "read_bytes_per_s": read, "numpy_sgemm_flops": sgemm, "numpy_sgemv_bytes_per_s": sgemv}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fma-iters", type=int, default=4_000_000, help="loop trips per thread (%(default)s)")
    p.add_argument("--read-mb", type=int, default=1024, help="buffer read per run, MiB (%(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is kept (%(default)s)")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args(argv)
    if args.fma_iters < 1 or args.read_mb < 1 or args.repeats < 1:
        p.error("--fma-iters, --read-mb and --repeats must be >= 1")
    cores = os.cpu_count() or 1
    threads = sorted({1, cores})
    try:
        got = measure(threads, args.fma_iters, args.read_mb * 2**20, args.repeats)
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        print(f"cpu_ceilings: {exc}", file=sys.stderr)
        return 1
    fma, read = got["fma_flops"], got["read_bytes_per_s"]
    for t in threads:
        print(
            f"{t} thread{'s' if t > 1 else ''}: FMA peak {fma[t] / 1e9:7.1f} GFLOP/s, streaming read {read[t] / 1e9:5.1f} GB/s"
        )
    sgemm, sgemv = got["numpy_sgemm_flops"], got["numpy_sgemv_bytes_per_s"]
    print(f"numpy sgemm {sgemm / 1e9:.1f} GFLOP/s = {sgemm / fma[cores]:.0%} of the {cores}-thread FMA peak; "
          f"numpy sgemv {sgemv / 1e9:.1f} GB/s = {sgemv / read[cores]:.0%} of the {cores}-thread read")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({"cores": cores, **got}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
