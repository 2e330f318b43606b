"""Build, load and register meshserve's native XLA:CPU custom calls (``model/native/*.cc``).

One shared library: attention over the paged KV cache (``model.native.cpu_paged_attention``: decode
tokens one at a time, and prefill chunks a block of tokens of one sequence at a time), the
weight matmuls over float32 panels (``model.native.cpu_matmul``) and over GGUF-quantized weights kept as
stored (``model.native.quant_matmul``: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K, one target each), and greedy decoding's argmax
(``model.native.cpu_argmax``). The library is compiled on first use with the machine's C++ compiler
(``g++``, or ``$CXX``) against the FFI headers of the installed jaxlib, for the target
``-march=$MESHSERVE_NATIVE_MARCH`` (``march()``; default ``native``, this CPU), into
``<cache dir>/native/`` under a name that hashes the sources, the flags, the jaxlib version
and the CPU's feature flags, so a changed input builds a new file and concurrent builders do
not clash (a temporary file renamed into place). The kernels size their vectors and register
tiles by the target's ISA (``native/vec.h``), so ``MESHSERVE_NATIVE_MARCH=x86-64-v3`` builds
the AVX2 code path on any x86-64 CPU that has AVX2 (tests/test_cpu_portability.py).

They are built only on x86-64 (``SUPPORTED_MACHINES``), the only CPUs they are tested and
measured on; elsewhere, or where they cannot be built (no compiler), ``available()`` is False
and the engine keeps XLA's paths. ``isa()`` names the vector ISA the build targets.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import jax
import jaxlib

from model.weights.fetch import cache_dir

log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).parent.glob("*.cc"))
HEADERS = sorted(Path(__file__).parent.glob("*.h"))
PANEL_MATMUL = "meshserve_panel_matmul"  # FFI target names
FIRST_ARGMAX = "meshserve_first_argmax"
PAGED_ATTENTION = "meshserve_paged_attention"
PAGED_PREFILL = "meshserve_paged_prefill"
QUANT_MATMUL = {  # QuantPanels.format -> FFI target of the quantized-weight matmul
    "q8_0": "meshserve_quant_matmul_q8_0",
    "q4_0": "meshserve_quant_matmul_q4_0",
    "q4_1": "meshserve_quant_matmul_q4_1",
    "q5_0": "meshserve_quant_matmul_q5_0",
    "q4_k": "meshserve_quant_matmul_q4_k",
    "q5_k": "meshserve_quant_matmul_q5_k",
    "q6_k": "meshserve_quant_matmul_q6_k",
}
TARGETS = {  # -> exported symbol
    PANEL_MATMUL: "MeshservePanelMatmul",
    FIRST_ARGMAX: "MeshserveFirstArgmax",
    PAGED_ATTENTION: "MeshservePagedAttention",
    PAGED_PREFILL: "MeshservePagedPrefill",
    QUANT_MATMUL["q8_0"]: "MeshserveQuantMatmulQ8_0",
    QUANT_MATMUL["q4_0"]: "MeshserveQuantMatmulQ4_0",
    QUANT_MATMUL["q4_1"]: "MeshserveQuantMatmulQ4_1",
    QUANT_MATMUL["q5_0"]: "MeshserveQuantMatmulQ5_0",
    QUANT_MATMUL["q4_k"]: "MeshserveQuantMatmulQ4_K",
    QUANT_MATMUL["q5_k"]: "MeshserveQuantMatmulQ5_K",
    QUANT_MATMUL["q6_k"]: "MeshserveQuantMatmulQ6_K",
}
MARCH_ENV = "MESHSERVE_NATIVE_MARCH"  # the build target's -march value; default "native"
SUPPORTED_MACHINES = ("x86_64", "AMD64")  # platform.machine() values the kernels are built for

_lock = threading.Lock()
_available: bool | None = None  # None until the first available() call
_isa: dict[str, str] = {}  # march() -> isa(), filled on first use


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def march() -> str:
    """The ``-march`` value the kernels are built for: ``$MESHSERVE_NATIVE_MARCH``, else "native".

    Raises:
        ValueError: the variable holds something other than a -march name (letters, digits,
            "-", "_", "." only), which would otherwise reach the compiler's command line.
    """
    value = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not all(c.isalnum() or c in "-_." for c in value):
        raise ValueError(f"{MARCH_ENV}={value!r} is not a -march value")
    return value


def flags() -> list[str]:
    """The compiler flags of the build (``march()`` among them)."""
    return ["-O3", f"-march={march()}", "-std=c++17", "-shared", "-fPIC", "-w"]


def library_path() -> Path:
    """Where this machine's build of the kernels for ``march()`` lives (it may not exist yet)."""
    key = hashlib.sha256()
    parts = [s.read_bytes() for s in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(flags()).encode(), jaxlib.__version__.encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "native" / f"meshserve-kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"


def compiler() -> str:
    """The C++ compiler to build with: ``$CXX``, else ``g++``, else ``c++`` on the PATH.

    Raises:
        RuntimeError: none of them is there.
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler: install g++ or set $CXX")
    return cxx


def build(path: Path) -> None:
    """Compile the kernels into ``path`` (atomically: a temporary file renamed into place).

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
        ValueError: ``$MESHSERVE_NATIVE_MARCH`` is not a -march value.
    """
    cxx = compiler()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cxx, *flags(), "-isystem", jax.ffi.include_dir(), *map(str, SOURCES), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def isa() -> str:
    """The vector ISA the library is compiled for, as ``native/vec.h`` picks it: "avx512",
    "avx2", or "other" (asked of the compiler once per process for each ``march()``).

    Raises:
        RuntimeError: no C++ compiler, or it failed (an unknown -march value, say).
        ValueError: ``$MESHSERVE_NATIVE_MARCH`` is not a -march value.
    """
    target = march()
    with _lock:
        if target not in _isa:
            cmd = [compiler(), f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
            macros = set(line.split()[1] for line in done.stdout.splitlines() if line.startswith("#define "))
            _isa[target] = "avx512" if "__AVX512F__" in macros else "avx2" if "__AVX2__" in macros else "other"
        return _isa[target]


def available() -> bool:
    """Whether the kernels are built (building them now if needed) and registered with XLA for
    the CPU; always False off x86-64 (``SUPPORTED_MACHINES``). The first call may take tens of
    seconds (the compile); a failure is logged once and remembered for the process."""
    global _available
    with _lock:
        if _available is None and platform.machine() not in SUPPORTED_MACHINES:
            log.info("native CPU kernels not built on %s (x86-64 only): using XLA's paths", platform.machine())
            _available = False
        if _available is None:
            try:
                path = library_path()
                if not path.exists():
                    log.info("building the native CPU kernels into %s", path)
                    build(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                for target, symbol in TARGETS.items():
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
                _available = True
            except (OSError, RuntimeError, AttributeError, ValueError) as e:
                log.warning("native CPU kernels unavailable, using XLA's dots: %s", e)
                _available = False
        return _available
