"""A decode step's KV-cache write and attention over a ``BlockedKVCache`` as one native XLA:CPU
custom call.

XLA:CPU lowers decode attention (one query token per slot) to 2 x S x K tiny batched matmuls
per cache block ([G, H] x [H, n]), which run at about 7 GB/s whatever their orientation or
dtype: bound by per-product overhead, not by memory; and each layer's new keys and values go
in by four scatters (about 80 us each at 64 slots). ``native/decode_attention.cc`` does both
as one pass per (slot, KV head), on XLA's intra-op threads: it writes the slot's new key and
value at its position, then reads its keys and values once, only up to its own length. The
blocks are aliased to the results, so the cache is updated in place. Measured by
``python benchmarks/decode_attention.py`` (SmolLM2-135M shapes, slots at 128-160 tokens, a
256-position window; step time with XLA's dots over the kernel's): 1.44x at 64 slots, 1.12x
at 8 (medians; the README gives the run).

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
_available: bool | None = None  # None until the first available() call


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
    global _available
    with _lock:
        if _available is None:
            try:
                path = library_path()
                if not path.exists():
                    log.info("building the CPU decode-attention kernel into %s", path)
                    build(path)
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
                _available = True
            except (OSError, RuntimeError, AttributeError) as e:
                log.warning("CPU decode-attention kernel unavailable, using XLA's dots: %s", e)
                _available = False
        return _available


def supports(q_per_kv: int, head_dim: int, dtype: jnp.dtype) -> bool:
    """Whether the kernel handles G = ``q_per_kv`` query heads per KV head, this head_dim and
    this cache dtype (float32 or bfloat16, 1 <= G <= 8, head_dim a multiple of 16); it says
    nothing of whether it is built."""
    return 1 <= q_per_kv <= MAX_GROUP and head_dim % LANES == 0 and jnp.dtype(dtype) in (jnp.float32, jnp.bfloat16)


def write_and_attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    positions: jax.Array,
    k_blocks: tuple[jax.Array, ...],
    v_blocks: tuple[jax.Array, ...],
) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """One decode step's cache write and attention for every slot, by the native kernel (call
    ``available()`` first): slot s's new key and value go in at ``positions[s]``, then its
    query attends to positions [0, positions[s]] (softmax attention, Vaswani et al. 2017,
    §3.2.1, with grouped KV heads). A position at or past the window's end marks an idle slot:
    nothing is written and its output is zeros. The blocks are updated in place
    (``input_output_aliases``) when the caller donates them, as the engine's jitted step does.

    Shapes: q [S, K, G, H] float32, already scaled by 1/sqrt(H); k_new, v_new [S, K, H]
    float32 (rounded to the cache dtype when written); positions [S] int32; key block j
    [S, K, H, n_j] and value block j [S, K, n_j, H], all float32 or all bfloat16.
    Returns (attention [S, K, G, H] float32, key blocks, value blocks).

    Raises:
        XlaRuntimeError (at run time): shapes or dtypes the kernel does not take (see ``supports``).
    """
    blocks = (*k_blocks, *v_blocks)
    first = 4  # operands before the blocks: q, positions, k_new, v_new
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32), *(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in blocks)),
        input_output_aliases={first + i: 1 + i for i in range(len(blocks))},
    )
    f32 = jnp.float32
    out, *written = call(q.astype(f32), positions.astype(jnp.int32), k_new.astype(f32), v_new.astype(f32), *blocks)
    n = len(k_blocks)
    return out, tuple(written[:n]), tuple(written[n:])
