"""Decode attention over a ``BlockedKVCache`` as a native XLA:CPU custom call.

XLA:CPU lowers decode attention (one query token per slot) to 2 x S x K tiny batched matmuls
per cache block ([G, H] x [H, n]), which run at about 7 GB/s whatever their orientation or
dtype: bound by per-product overhead, not by memory. ``native/decode_attention.cc`` does the
same arithmetic as one pass per (slot, KV head) that reads each slot's keys and values once,
only up to the slot's own length, on XLA's intra-op threads. SmolLM2-135M's shapes, 30 layers,
a 256-position window, slots at 128-160 tokens: 38 ms per step at 64 slots against 122 ms for
the XLA dots, 4.5 against 13.6 ms at 8 slots (``/tmp`` scratch timing, min of 7; the engine-level
figures are in the README's peer table).

The library is compiled on first use with the machine's C++ compiler (``g++``, or ``$CXX``)
against the FFI headers of the installed jaxlib, for this CPU (``-march=native``), into
``<cache dir>/native/`` under a name that hashes the source, the flags, the jaxlib version and
the CPU's feature flags, so a changed input builds a new file and concurrent builders do not
clash. Where it cannot be built (no compiler), ``available()`` is False and the engine keeps
the XLA path (``model.llama.attention_over_blocks``).
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
import jax.numpy as jnp
import jaxlib

from model.fetch import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "native" / "decode_attention.cc"
TARGET = "meshserve_decode_attention"  # the FFI target name
SYMBOL = "MeshserveDecodeAttention"  # the handler's exported symbol
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w"]
MAX_GROUP = 8  # query heads per KV head the kernel is instantiated for
LANES = 16  # head_dim must be a multiple of this (the kernel's vector width in floats)

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool once tried; "error": why not


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def library_path() -> Path:
    """Where this machine's build of the kernel lives (it may not exist yet)."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), jaxlib.__version__.encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "native" / f"decode_attention-{platform.machine()}-{key.hexdigest()[:16]}.so"


def build(path: Path) -> None:
    """Compile the kernel into ``path`` (atomically: a temporary file renamed into place).

    Raises:
        RuntimeError: no C++ compiler, or the compiler failed (its output in the message).
    """
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++ or $CXX) to build the decode-attention kernel")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        cmd = [cxx, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def available() -> bool:
    """Whether the kernel is built (building it now if needed) and registered with XLA for the
    CPU. The first call may take a few seconds (the compile); a failure is logged once and
    remembered for the process."""
    with _lock:
        if "ok" not in _state:
            try:
                path = library_path()
                if not path.exists():
                    log.info("building the CPU decode-attention kernel into %s", path)
                    build(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
                _state["ok"] = True
            except (OSError, RuntimeError, AttributeError) as e:
                log.warning("CPU decode-attention kernel unavailable, using XLA's dots: %s", e)
                _state.update(ok=False, error=str(e))
        return bool(_state["ok"])


def supports(num_kv_heads: int, q_per_kv: int, head_dim: int, dtype: jnp.dtype) -> bool:
    """Whether the kernel handles these shapes and this cache dtype (float32 or bfloat16,
    1 <= G <= 8, head_dim a multiple of 16); it says nothing of whether it is built."""
    del num_kv_heads
    return 1 <= q_per_kv <= MAX_GROUP and head_dim % LANES == 0 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def decode_attention(
    q: jax.Array, positions: jax.Array, k_blocks: tuple[jax.Array, ...], v_blocks: tuple[jax.Array, ...]
) -> jax.Array:
    """Softmax attention of one query token per slot over its cached positions (Vaswani et al.
    2017, §3.2.1, with grouped KV heads), by the native kernel; call ``available()`` first.

    Slot s attends to positions [0, positions[s]] of the window that the blocks make up
    (its own new key already written there); a position at or past the window's end marks an
    idle slot, whose output is zeros.

    Shapes: q [S, K, G, H] float32, already scaled by 1/sqrt(H); positions [S] int32; key block
    j [S, K, H, n_j] and value block j [S, K, n_j, H], all float32 or all bfloat16.
    Returns [S, K, G, H] float32.

    Raises:
        XlaRuntimeError (at run time): shapes or dtypes the kernel does not take (see ``supports``).
    """
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q.astype(jnp.float32), positions.astype(jnp.int32), *k_blocks, *v_blocks)
