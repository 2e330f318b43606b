"""How many token positions the paged KV pool holds: asked for in tokens (``--kv-cache-tokens``)
or in bytes per device (``--kv-cache-memory``), or, by default, from the devices' memory.

The default follows what a user of vLLM's or SGLang's scheduler expects, per platform:

* accelerators that report their memory (``Device.memory_stats()``'s ``bytes_limit``, GPUs and
  TPUs): the pool takes ``ACCELERATOR_FRACTION`` of each device's memory limit less what is in
  use once the weights are placed (vLLM's ``gpu_memory_utilization``, 0.9 by default, counts the
  weights and activations inside its fraction; the 0.1 left here is the activations' and
  compiler's room), at least one page;
* CPU devices, which share the host's memory with the process and with each other:
  ``num_slots x max_seq_len`` positions (every slot at its longest), capped so that the pool of
  all the mesh's devices takes at most ``HOST_FRACTION`` of the memory the host has available
  (``/proc/meminfo``'s MemAvailable); the cap is logged.

Bytes per position and device: 2 (K and V) x layers x KV heads held by the device (all of them,
or KV heads / the model axis where the layout splits heads) x a row of head_dim in the cache
dtype (``model.config.kv_row_bytes``: head_dim x its size, plus an 8-bit row's 2-byte scale).
With d data replicas each device holds only its replica's positions, 1/d of the pool: sizes in
tokens are the whole pool's (rounded up to a page for each replica), sizes in bytes a device's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from model.config import kv_row_bytes

log = logging.getLogger(__name__)

ACCELERATOR_FRACTION = 0.9  # of each device's memory limit, weights already in use inside it
HOST_FRACTION = 0.5  # of the host's available memory, for the pools of all CPU devices


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: Any, kv_heads_split: int = 1) -> int:
    """Bytes of K and V one cached position takes on one device: 2 x L x (K / kv_heads_split) x
    a row of H in ``kv_dtype`` (a dtype or its name: "float32", "bfloat16", "int8": its codes and
    scale, ``model.config.kv_row_bytes``; ``kv_heads_split``: the model axis where the layout
    splits KV heads over it, else 1, all the model's heads)."""
    heads = num_kv_heads // kv_heads_split
    return 2 * num_layers * heads * kv_row_bytes(head_dim, np.dtype(kv_dtype).name)


def whole_pages(tokens: int, page_size: int, replicas: int = 1) -> int:
    """``tokens`` rounded up to a whole number of pages in each of ``replicas`` pools."""
    unit = page_size * replicas
    return -(-tokens // unit) * unit


def host_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _local(devices: list[jax.Device]) -> list[jax.Device]:
    """This process's devices among ``devices`` (another process's cannot report their memory
    here: ``memory_stats`` raises)."""
    return [d for d in devices if getattr(d, "process_index", jax.process_index()) == jax.process_index()]


def _memory(devices: list[jax.Device]) -> list[tuple[int, int]] | None:
    """(memory limit, bytes in use) of each of this process's ``devices``, or None where one
    reports no limit (CPU devices) or none is local."""
    out = []
    for d in _local(devices):
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        out.append((int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))))
    return out or None


def device_free_bytes(devices: list[jax.Device]) -> int | None:
    """The least, over this process's ``devices``, of ``ACCELERATOR_FRACTION`` x the memory limit
    less the bytes in use; None when a device reports no limit (CPU devices)."""
    memory = _memory(devices)
    return None if memory is None else min(int(ACCELERATOR_FRACTION * limit) - used for limit, used in memory)


def switch_problem(devices: list[jax.Device], need_per_device: int) -> str | None:
    """Why a new engine needing ``need_per_device`` bytes on each of ``devices`` cannot be built
    now, beside the engine that keeps serving while it is built (a live layout switch holds
    both until the hand-over), or None where it fits.

    Accelerators (``memory_stats()`` reports ``bytes_limit``): each device needs
    ``need_per_device`` within its limit less its bytes in use (the old engine's weights and pool
    among them). CPU devices share the host's memory: ``need_per_device`` x the devices within
    MemAvailable. A device that reports nothing (and an unreadable /proc/meminfo) is not
    checked. The default pool on an accelerator takes ``ACCELERATOR_FRACTION`` of the memory,
    so a switch on the same devices fits only where ``--kv-cache-memory`` or
    ``--kv-cache-tokens`` left room for the new engine.
    """
    gib = 2**30
    memory = _memory(devices)
    if memory is not None:
        free = min(limit - used for limit, used in memory)
        if need_per_device > free:
            return (
                f"the new layout needs {need_per_device / gib:.2f} GiB per device (weights, any packed copy "
                f"of them, KV pool) beside the engine serving now, and a device has {max(free, 0) / gib:.2f} GiB free; "
                "serve with a smaller --kv-cache-memory (or --kv-cache-tokens) to leave room for a switch"
            )
        return None
    available = host_available_bytes()
    local = len(_local(devices))
    need = need_per_device * local
    if available is not None and need > available:
        return (
            f"the new layout needs {need / gib:.2f} GiB of host memory ({local} CPU device(s): weights, "
            f"any packed copy of them, KV pool) beside the engine serving now, and the host has {available / gib:.2f} GiB "
            "available; serve with a smaller --kv-cache-tokens (or --kv-cache-memory) to leave room for a switch"
        )
    return None


def agreed_tokens(tokens: int) -> int:
    """The least of every process's ``tokens`` (a job over several processes, each of which
    sized the pool from its own memory; all must build the same pool). A collective: every
    process of the job calls it, in the same order."""
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.asarray([tokens], np.int64))))


def pool_tokens(
    *,
    kv_cache_tokens: int,
    kv_cache_memory: int,
    num_slots: int,
    max_seq_len: int,
    page_size: int,
    per_token: int,
    num_devices: int,
    device_free: int | None,
    host_available: int | None,
    replicas: int = 1,
) -> int:
    """The pool's token positions, a whole number of pages for each data replica (see the module
    docstring).

    Args:
        kv_cache_tokens, kv_cache_memory: the user's ask (0 = not given; at most one given):
            tokens of all replicas together, or bytes on each device.
        num_slots, max_seq_len, page_size: the engine's sizes.
        per_token: ``bytes_per_token`` on one device.
        num_devices: devices of the mesh (each holds its share of its replica's positions).
        device_free: ``device_free_bytes`` (None on CPU devices).
        host_available: ``host_available_bytes`` (used when ``device_free`` is None).
        replicas: data replicas, each with its own pool on its own devices (a device holds
            1 / ``replicas`` of the positions), >= 1.

    Raises:
        ValueError: the memory asked for, or the memory free on the devices, holds less than one
            page.
    """
    unit = page_size * replicas  # a page in each replica's pool
    if kv_cache_tokens:
        return whole_pages(kv_cache_tokens, page_size, replicas)
    if kv_cache_memory:
        tokens = kv_cache_memory // per_token // page_size * unit
        if tokens < unit:
            raise ValueError(
                f"kv_cache_memory {kv_cache_memory} bytes holds no page of {page_size} positions "
                f"({per_token} bytes a position per device)"
            )
        return tokens
    if device_free is not None:
        tokens = max(device_free, 0) // per_token // page_size * unit
        if tokens < unit:
            raise ValueError(
                f"the devices have {max(device_free, 0)} bytes free for the KV cache, less than one page "
                f"({page_size} x {per_token} bytes): give kv_cache_tokens or kv_cache_memory"
            )
        return tokens
    tokens = whole_pages(num_slots * max_seq_len, page_size, replicas)
    if host_available is not None:
        cap = int(HOST_FRACTION * host_available) * replicas // (per_token * num_devices) // unit * unit
        if cap < tokens:
            log.warning(
                "KV pool: %d positions (slots x max_seq_len) would take more than %.0f%% of the host's "
                "available memory; %d positions instead (give kv_cache_tokens to choose)",
                tokens, 100 * HOST_FRACTION, max(cap, unit),
            )  # fmt: skip
            tokens = max(cap, unit)
    return tokens
