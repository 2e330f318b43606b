"""An analytic roofline for one Llama config on one chip type, layout and workload (no JAX).

What a step costs, per device of one model replica (a tensor-parallel group of ``tp`` devices;
``dp`` such replicas serve independent sequences):

* bytes from memory: every weight the step multiplies by, once per step whatever the batch, plus
  the KV cache of every sequence in the batch (Pope et al. 2022, "Efficiently Scaling Transformer
  Inference", §2: decode cost is dominated by loading weights and the KV cache);
* FLOPs: 2 per weight per token for the matmuls, plus attention: 4·N·H per (query, key) pair
  (QKᵀ and PV), causal in prefill (T(T+1)/2 pairs), B·S pairs in decode;
* collectives: each tensor-parallel all-reduce of the residual stream, B·D·itemsize bytes, costs
  ``2(n-1)/n · bytes / W_ici`` on a ring of n devices (plus ``2(n-1)`` hop latencies if given);
  see "Several hosts" below for a group that spans hosts.

Step time = max(bytes / W_hbm, FLOPs / peak) + collective time: the roofline of Williams et al.
(2009) as the JAX scaling book's inference chapter applies it ("How to Scale Your Model",
jax-ml/scaling-book ``inference.md``, §"rooflines": T_step ≈ B·KV/W_hbm + max(2·B·P/C, P·bytes/W_hbm)),
with collectives not overlapped (an upper bound; XLA may overlap some). Decode is memory-bound
while the arithmetic intensity FLOPs/bytes is below the hardware's ridge C / W_hbm (FLOP/byte); for
the weight matmuls that intensity is 2·B/itemsize, so the critical batch is
``B_crit = (C / W_hbm) · itemsize / 2`` (bf16: B_crit = C / W_hbm, e.g. 333 for 1e15 FLOP/s and
3e12 B/s). KV reads never amortize over the batch (attention intensity ≈ 1 FLOP/byte in bf16,
scaling book §"attention"), so with a long context decode can stay memory-bound at any batch.

Which weights a device holds follows ``sharding/plan.py`` (Megatron TP, Shoeybi et al. 2019):
MLP and vocabulary split over ``tp``; attention and the KV cache split over heads in ``heads``
mode, whole on each device in ``replicated`` mode; norms replicated. All-reduces per layer:
2 in ``heads`` mode (after O and after down), 1 in ``replicated`` mode, plus 1 for the embedding
lookup of the vocabulary-split table. meshserve keeps the residual stream in float32, so the
all-reduced activations are 4 bytes per element whatever the weight dtype.

Several hosts (processes). A mesh puts the devices in JAX's global order, process by process
(``jax.make_mesh``; on GPUs sorted by id), shaped (data, model): data-major, model-minor, so a
replica's ``tp`` devices are consecutive and, with ``devices_per_host`` = k devices on each host,
a replica stays inside one host while ``tp <= k`` (k a multiple of ``tp``) and spans h = tp / k
hosts, k devices on each, when ``tp > k`` (``tp`` a multiple of k); other shapes are refused
(:class:`TopologyError`). A crossing all-reduce is priced as the two-level all-reduce
(reduce-scatter inside each host, an all-reduce of each device's 1/k shard with its peers on the
other hosts, all-gather inside each host):

    t = 2(k-1)/k · bytes / W_ici + 2(k-1) · lat_ici            (inside a host)
      + 2(h-1)/h · (bytes / k) / W_inter + 2(h-1) · lat_inter  (across hosts)

with W_inter and lat_inter the preset's ``inter_host_bytes_per_s`` (per device: each device has its
own NIC share) and ``inter_host_latency_s`` (per hop). It is the hierarchical all-reduce of
Jia et al. 2018 ("Highly Scalable Deep Learning Training System with Mixed-Precision") and
Horovod's ``HOROVOD_HIERARCHICAL_ALLREDUCE``. It is chosen over one flat ring throttled by its
slowest hop (2(n-1)/n · bytes / W_inter) because that is not what runs on hosts with a NIC per
device: NCCL's rings over several hosts use one channel per NIC, each carrying 1/k of the data, so
they are bound near 2(n-1)/n · bytes / (k · W_inter), as the inter-host term above is. Its bytes
sent per device add up to the flat ring's 2(n-1)/n · bytes, and with h = 1 it is exactly the
one-host ring above. The latency inside a host is the workload's ``hop_latency_s`` (0 unless
``--hop-latency-us``); across hosts it is the preset's. The ``data`` axis costs nothing in the model's forward pass (each replica
reads its own pages), but the engine's step returns its packed host-bound results
(``service.engine.output.pack_step``: 2 + 2 · TOP_LOGPROBS float32 per row) replicated to every device
(``service/engine/runner.py``: ``out_shardings`` ``repl``), an all-gather over the replicas. Inside a
host it is left out (a few kB, as before); when the replicas sit on g > 1 host groups it is priced
as a ring all-gather of the dp · B rows among those groups over the inter-host link:
``(g-1)/g · bytes / W_inter + (g-1) · lat_inter`` (latency-bound in practice).

Simplifications (an ideal to measure against, not a simulator): no kernel-launch or host
overhead, no chunked-prefill re-reads, the LM head evaluated on the last prompt position only
(as ``model.llama.ragged_step`` does: the logits of each row's sampling token only), sampling and the vocabulary-split logits' small reductions
not counted, a decode step reading exactly ``context_len`` KV positions per sequence.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from model.config import LlamaConfig
from model.config import itemsize as _itemsize
from service.engine.config import WEIGHT_MODES
from service.server.arg_types import nonnegative_float, positive_int

HARDWARE_FILE = Path(__file__).resolve().parent.parent / "configs" / "hardware.yaml"
ATTENTION_MODES = ("heads", "replicated")


class HardwareError(ValueError):
    """Unknown hardware preset, or a dtype the preset has no peak for."""


class TopologyError(ValueError):
    """A layout that does not tile the hosts, or spans hosts on hardware with no inter-host link."""


# ---- hardware -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hardware:
    """One chip's limits.

    Attributes:
        name: preset name (a key of ``configs/hardware.yaml``).
        hbm_bytes_per_s: memory bandwidth, bytes/s.
        peak_flops: dense matmul peak, FLOP/s, by dtype name.
        interconnect_bytes_per_s: bytes/s one device sends into a ring collective.
        memory_bytes: memory capacity, bytes (None = unknown).
        description: one line for tables.
        source: where the numbers come from.
        shared: the figures are one machine's totals that every device of a mesh shares (fake
            XLA CPU devices on one host): each of n devices gets 1/n of each.
        inter_host_bytes_per_s: bytes/s one device sends across hosts, each way (its share of its
            host's NICs: the W_inter of the module docstring's two-level all-reduce); None = no
            link between hosts (CPU presets): a layout that spans hosts is refused.
        inter_host_latency_s: seconds per hop of a collective across hosts.
        devices_per_host: devices one host (one process of a job) holds; None = all devices on one
            host (no collective crosses hosts: the one-host numbers). ``meshserve-bench roofline
            --devices-per-host`` / ``--hosts`` set it; the shipped presets leave it unset.
    """

    name: str
    hbm_bytes_per_s: float
    peak_flops: dict[str, float]
    interconnect_bytes_per_s: float
    memory_bytes: float | None = None
    description: str = ""
    source: str = ""
    shared: bool = False
    inter_host_bytes_per_s: float | None = None
    inter_host_latency_s: float = 0.0
    devices_per_host: int | None = None

    def __post_init__(self) -> None:
        if self.devices_per_host is not None and self.devices_per_host < 1:
            raise HardwareError(f"hardware {self.name!r}: devices_per_host must be >= 1, got {self.devices_per_host}")

    def per_device(self, num_devices: int) -> Hardware:
        """What one of ``num_devices`` mesh devices gets: itself, or 1/n of a shared machine (the
        inter-host link is per device already and stays as it is)."""
        if not self.shared or num_devices == 1:
            return self
        n = float(num_devices)
        return dataclasses.replace(
            self,
            hbm_bytes_per_s=self.hbm_bytes_per_s / n,
            peak_flops={k: v / n for k, v in self.peak_flops.items()},
            interconnect_bytes_per_s=self.interconnect_bytes_per_s / n,
            memory_bytes=None if self.memory_bytes is None else self.memory_bytes / n,
        )

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for matmuls in ``dtype``.

        Raises:
            HardwareError: the preset gives no peak for that dtype.
        """
        if dtype not in self.peak_flops:
            raise HardwareError(
                f"hardware {self.name!r} has no {dtype} peak (it has: {', '.join(sorted(self.peak_flops))})"
                + ("; bfloat16 has no native support on this CPU (peers.md)" if self.name.startswith("cpu") else "")
            )
        return self.peak_flops[dtype]

    def ridge(self, dtype: str) -> float:
        """The ridge point C / W_hbm in FLOP/byte: below it a kernel is memory-bound."""
        return self.peak(dtype) / self.hbm_bytes_per_s


def _total_memory_bytes() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


@functools.cache
def measure_cpu(read_bytes: int = 512 * 2**20, matmul_n: int = 2048, repeats: int = 3) -> tuple[float, float]:
    """Measure this CPU once per process (cached per argument set): (read bytes/s, float32 FLOP/s).

    Read bandwidth: the best of ``repeats`` matrix-vector products over a ``read_bytes`` float32
    matrix of 576 columns (BLAS sgemv on all cores: a streaming read of a weight matrix, as a
    batch-1 decode step does; a numpy sum runs on one core and reads a fraction of what sgemv
    reads on several). Peak: the best of ``repeats`` ``matmul_n``³
    float32 matmuls (2·n³ FLOPs each; numpy's BLAS sgemm on all cores).
    """
    cols = 576
    a = np.ones((max(1, read_bytes // 4 // cols), cols), dtype=np.float32)
    v = np.ones(cols, dtype=np.float32)
    a @ v
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ v
        best = min(best, time.perf_counter() - t0)
    bandwidth = a.nbytes / best
    del a
    rng = np.random.default_rng(0)
    x = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)
    y = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)
    x @ y
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - t0)
    return bandwidth, 2.0 * matmul_n**3 / best


def _read_presets(path: Path = HARDWARE_FILE) -> dict[str, dict[str, Any]]:
    return yaml.safe_load(path.read_text()) or {}


def hardware_names(path: Path = HARDWARE_FILE) -> list[str]:
    """The preset names in ``configs/hardware.yaml``, in file order."""
    return list(_read_presets(path))


def load_hardware(name: str, path: Path = HARDWARE_FILE) -> Hardware:
    """A preset from ``configs/hardware.yaml``; ``measure: cpu`` presets run :func:`measure_cpu`.

    Raises:
        HardwareError: no such preset (the message lists them).
    """
    presets = _read_presets(path)
    if name not in presets:
        raise HardwareError(f"unknown hardware {name!r}; presets: {', '.join(presets)}")
    entry = presets[name]
    inter_bw, per_host = entry.get("inter_host_bytes_per_s"), entry.get("devices_per_host")
    common: dict[str, Any] = {
        "name": name,
        "description": str(entry.get("description", "")),
        "source": str(entry.get("source", "")),
        "shared": bool(entry.get("shared", False)),
        "inter_host_bytes_per_s": None if inter_bw is None else float(inter_bw),
        "inter_host_latency_s": float(entry.get("inter_host_latency_s", 0.0)),
        "devices_per_host": None if per_host is None else int(per_host),
    }
    if entry.get("measure") == "cpu":
        bandwidth, flops = measure_cpu()
        return Hardware(
            hbm_bytes_per_s=bandwidth,
            peak_flops={"float32": flops},
            interconnect_bytes_per_s=bandwidth,
            memory_bytes=_total_memory_bytes(),
            **common,
        )
    memory = entry.get("memory_bytes")
    return Hardware(
        hbm_bytes_per_s=float(entry["hbm_bytes_per_s"]),
        peak_flops={str(k): float(v) for k, v in entry["peak_flops"].items()},
        interconnect_bytes_per_s=float(entry["interconnect_bytes_per_s"]),
        memory_bytes=None if memory is None else float(memory),
        **common,
    )


# ---- utilization ----------------------------------------------------------------------------------
def mbu(bytes_per_step: float, step_s: float, bandwidth: float) -> float:
    """Model bandwidth utilization: achieved bytes/s over the peak, (bytes / step time) / W_hbm."""
    return bytes_per_step / step_s / bandwidth


def mfu(flops_per_step: float, step_s: float, peak: float) -> float:
    """Model FLOPs utilization (Chowdhery et al. 2022, PaLM, §4.1): (FLOPs / step time) / peak."""
    return flops_per_step / step_s / peak


def ring_all_reduce_s(nbytes: float, n: int, bandwidth: float, hop_latency_s: float = 0.0) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` devices (reduce-scatter + all-gather):
    ``2(n-1)/n · nbytes / bandwidth + 2(n-1) · hop_latency_s``; 0 for n = 1."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * hop_latency_s


# ---- the model ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Parallelism:
    """A layout reduced to what the roofline needs.

    Attributes:
        dp: model replicas (the ``data`` mesh axis).
        tp: devices per replica (the ``model`` mesh axis, tensor parallelism).
        attention: ``"heads"`` (attention and KV split over heads) or ``"replicated"`` (whole on
            each device), as ``sharding.plan.make_plan`` resolves it.
    """

    dp: int = 1
    tp: int = 1
    attention: str = "heads"

    def __post_init__(self) -> None:
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"dp and tp must be >= 1, got dp={self.dp} tp={self.tp}")
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {self.attention!r}")

    @classmethod
    def from_plan(cls, plan: Any) -> Parallelism:
        """From a ``sharding.plan.ShardingPlan`` (duck-typed, so this module never imports JAX)."""
        return cls(dp=plan.layout.data, tp=plan.layout.model, attention=plan.attention)

    @property
    def attn_split(self) -> int:
        """How many ways attention weights and the KV cache are split."""
        return self.tp if self.attention == "heads" else 1

    @property
    def all_reduces_per_layer(self) -> int:
        """As ``ShardingPlan.all_reduces_per_layer``: 0 without TP, else 2 (heads) or 1 (replicated)."""
        if self.tp == 1:
            return 0
        return 2 if self.attention == "heads" else 1

    @property
    def num_devices(self) -> int:
        return self.dp * self.tp


@dataclasses.dataclass(frozen=True)
class HostSplit:
    """How a layout's devices fall on hosts (data-major, model-minor, process by process).

    Attributes:
        per_host: k, devices of one replica's all-reduce group on each host it spans.
        group_hosts: h, hosts one replica spans (1: its all-reduces stay inside a host).
        data_groups: g, host groups the replicas sit on (1: the step's gather stays inside a host).
        hosts: hosts the layout's devices occupy.
    """

    per_host: int
    group_hosts: int
    data_groups: int
    hosts: int

    @property
    def crosses(self) -> bool:
        return self.group_hosts > 1 or self.data_groups > 1


def host_split(par: Parallelism, devices_per_host: int | None) -> HostSplit:
    """Where ``par``'s devices sit with ``devices_per_host`` devices on each host (None: all on one).

    Raises:
        TopologyError: the model axis neither fits a whole number of times in a host nor spans a
            whole number of hosts (e.g. tp = 3 on hosts of 8 devices: a replica would straddle).
    """
    n, tp = par.num_devices, par.tp
    k = n if devices_per_host is None else devices_per_host
    if k >= n:
        return HostSplit(per_host=tp, group_hosts=1, data_groups=1, hosts=1)
    hosts = -(-n // k)
    if tp > k:
        if tp % k:
            raise TopologyError(f"the model axis ({tp} devices) does not span a whole number of {k}-device hosts")
        return HostSplit(per_host=k, group_hosts=tp // k, data_groups=par.dp, hosts=hosts)
    if k % tp:
        raise TopologyError(f"hosts of {k} devices do not hold a whole number of {tp}-device model groups")
    return HostSplit(per_host=tp, group_hosts=1, data_groups=-(-par.dp // (k // tp)), hosts=hosts)


@dataclasses.dataclass(frozen=True)
class Workload:
    """What is being served.

    Attributes:
        batch: sequences decoding together in each replica (per-replica batch B).
        context_len: KV positions each sequence attends to in a decode step (S).
        prompt_len: prompt tokens of the request whose TTFT is predicted (T).
        dtype: weights dtype (and the matmuls' peak).
        kv_dtype: KV cache dtype; None = ``dtype``.
        act_itemsize: bytes per element of the all-reduced residual stream (4: meshserve keeps
            it in float32).
        hop_latency_s: fixed latency per ring hop of a collective (0 = bandwidth only; the scaling
            book puts TPU ICI at about 1 µs per hop).
    """

    batch: int = 1
    context_len: int = 2048
    prompt_len: int = 128
    dtype: str = "bfloat16"
    kv_dtype: str | None = None
    act_itemsize: int = 4
    hop_latency_s: float = 0.0

    @property
    def itemsize(self) -> int:
        """Bytes per weight element."""
        return _itemsize(self.dtype)

    @property
    def kv_itemsize(self) -> int:
        """Bytes per KV cache element."""
        return _itemsize(self.kv_dtype or self.dtype)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """One step on one device of one replica.

    Attributes:
        flops: FLOPs.
        weight_bytes, kv_bytes: bytes read from (KV: read or written to) memory.
        collective_bytes: bytes this device sends into its all-reduces (ring: 2(n-1)/n each).
        num_collectives: all-reduces in the step.
        memory_s, compute_s, collective_s: bytes / W_hbm, FLOPs / peak, collective time
            (``inside_host_s + across_hosts_s``).
        inside_host_s: the collectives' time over the links inside a host (all of it on one host).
        across_hosts_s: their time over the inter-host link: the all-reduces' inter-host stage
            and the gather of the step's results over replicas on other hosts (0 on one host).
        across_hosts_bytes: bytes this device sends over the inter-host link (part of
            ``collective_bytes`` for the all-reduces, plus the gather's share).
    """

    flops: float
    weight_bytes: float
    kv_bytes: float
    collective_bytes: float
    num_collectives: int
    memory_s: float
    compute_s: float
    collective_s: float
    inside_host_s: float = 0.0
    across_hosts_s: float = 0.0
    across_hosts_bytes: float = 0.0

    @property
    def memory_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def time_s(self) -> float:
        """max(memory, compute) + collectives (not overlapped)."""
        return max(self.memory_s, self.compute_s) + self.collective_s

    @property
    def regime(self) -> str:
        """``"memory"`` or ``"compute"``, whichever of the two roofline terms is larger."""
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP per byte of memory traffic."""
        return self.flops / self.memory_bytes if self.memory_bytes else math.inf


@dataclasses.dataclass(frozen=True)
class Roofline:
    """The prediction for one (model, hardware, layout, workload).

    Attributes:
        prefill: one prompt of ``prompt_len`` tokens on one replica; its time is the TTFT.
        decode: one decode step of ``batch`` sequences on one replica; its time is the TPOT.
        ridge: the hardware's C / W_hbm, FLOP/byte.
        critical_batch: batch at which the weight matmuls turn compute-bound, ridge · itemsize / 2.
        weights_stored_bytes, kv_stored_bytes: per device: all weights held, and the KV cache of
            ``batch`` sequences of ``context_len`` tokens.
        held: the weights held as blocks it was priced with (None: all ``workload.dtype``).
    """

    hardware: Hardware
    parallelism: Parallelism
    workload: Workload
    prefill: StepCost
    decode: StepCost
    ridge: float
    critical_batch: float
    weights_stored_bytes: float
    kv_stored_bytes: float
    held: HeldWeights | None = None

    @property
    def ttft_s(self) -> float:
        return self.prefill.time_s

    @property
    def tpot_s(self) -> float:
        return self.decode.time_s

    @property
    def tokens_per_s_per_replica(self) -> float:
        return self.workload.batch / self.tpot_s

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput of all replicas: dp · B / TPOT."""
        return self.parallelism.dp * self.tokens_per_s_per_replica

    @property
    def regime(self) -> str:
        return self.decode.regime

    @property
    def hosts(self) -> int:
        """Hosts the layout's devices occupy (``hardware.devices_per_host`` each)."""
        return host_split(self.parallelism, self.hardware.devices_per_host).hosts

    @property
    def fits(self) -> bool | None:
        """Whether weights plus KV fit in one device's memory (None if the capacity is unknown)."""
        if self.hardware.memory_bytes is None:
            return None
        return self.weights_stored_bytes + self.kv_stored_bytes <= self.hardware.memory_bytes

    def as_dict(self) -> dict[str, Any]:
        """Plain numbers (seconds, bytes, FLOPs) for JSON."""

        def step(s: StepCost) -> dict[str, Any]:
            return {**dataclasses.asdict(s), "time_s": s.time_s, "regime": s.regime, "intensity": s.intensity}

        return {
            "hardware": self.hardware.name,
            "dp": self.parallelism.dp,
            "tp": self.parallelism.tp,
            "attention": self.parallelism.attention,
            "devices_per_host": self.hardware.devices_per_host,
            "hosts": self.hosts,
            **dataclasses.asdict(self.workload),
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_replica": self.tokens_per_s_per_replica,
            "regime": self.regime,
            "ridge_flop_per_byte": self.ridge,
            "critical_batch": self.critical_batch,
            "weights_stored_bytes": self.weights_stored_bytes,
            "kv_stored_bytes": self.kv_stored_bytes,
            "fits": self.fits,
            "prefill": step(self.prefill),
            "decode": step(self.decode),
            # Only when some weights are blocks, so the float predictions' JSON is unchanged.
            **({} if self.held is None else {"held_weights": dataclasses.asdict(self.held)}),
        }


@dataclasses.dataclass(frozen=True)
class _Elements:
    """Weight elements on one device, by group."""

    attn: int  # Q, K, V, O of all layers
    mlp: int  # gate, up, down of all layers
    lm_head: int  # the output projection (the embedding table when tied)
    embed: int  # a separate input embedding table (untied only; a step gathers rows of it)
    norms: int

    @property
    def matmul(self) -> int:
        return self.attn + self.mlp + self.lm_head


def _elements(cfg: LlamaConfig, par: Parallelism) -> _Elements:
    L, D, N, K, H, F, V = cfg.dims
    return _Elements(
        attn=L * D * H * (2 * N + 2 * K) // par.attn_split,
        mlp=L * 3 * D * F // par.tp,
        lm_head=V * D // par.tp,
        embed=0 if cfg.tie_word_embeddings else V * D // par.tp,
        norms=(2 * cfg.num_layers + 1) * D,
    )


def weight_bytes_per_device(cfg: LlamaConfig, par: Parallelism, itemsize: int) -> int:
    """Parameter bytes held by each device (equals ``ShardingPlan.weight_bytes_per_device``)."""
    e = _elements(cfg, par)
    return (e.matmul + e.embed + e.norms) * itemsize


@dataclasses.dataclass(frozen=True)
class HeldWeights:
    """The weights as each device holds them, in bytes by group, when some are GGUF blocks (as
    stored, or int8) rather than all ``Workload.dtype`` floats: ``held_weights`` reads them from
    ``sharding.plan.ShardingPlan.param_bytes``, which prices each parameter as the placement
    splits it (a block array may stay whole where its float weight would be split, e.g. gate/up's
    panels over ``model``). A step reads every byte a device holds of the matmul weights and the
    norms, and the rows it looks up of a separate embedding table (``embed`` / V bytes each, the
    share of a row a device holds on average).

    Attributes:
        attn: Q, K, V, O of all layers (wqkv, wo). mlp: gate, up, down (w_gate_up, w_down).
        lm_head: the output projection (the embedding table when tied). embed: a separate input
            embedding table (untied only; 0 when tied). norms: the RMSNorm weights.
        label: how they are held, for the header ("blocks as stored (q4_1: ...; the rest float32)").
    """

    attn: int
    mlp: int
    lm_head: int
    embed: int
    norms: int
    label: str = ""

    @property
    def matmul(self) -> int:
        return self.attn + self.mlp + self.lm_head

    @property
    def total(self) -> int:
        return self.matmul + self.embed + self.norms

    def embed_rows(self, cfg: LlamaConfig, rows: int) -> float:
        """Bytes of ``rows`` looked-up rows of the separate embedding table, per device."""
        return min(rows, cfg.vocab_size) * self.embed / cfg.vocab_size


def held_weights(cfg: LlamaConfig, plan: Any, itemsize: int, formats: dict[str, str], label: str = "") -> HeldWeights:
    """``HeldWeights`` of one layout's devices from ``plan.param_bytes`` (a ``ShardingPlan``,
    duck-typed so this module never imports JAX): ``formats`` the parameters held as blocks by
    name ("wqkv": "q4_1", ...), the rest floats of ``itemsize`` bytes.

    Raises:
        ValueError: see ``ShardingPlan.param_bytes``.
    """
    b = plan.param_bytes(cfg, itemsize, formats)
    tied = cfg.tie_word_embeddings
    return HeldWeights(
        attn=b["wqkv"] + b["wo"],
        mlp=b["w_gate_up"] + b["w_down"],
        lm_head=b["embed"] if tied else b["lm_head"],
        embed=0 if tied else b["embed"],
        norms=b["attn_norm"] + b["mlp_norm"] + b["final_norm"],
        label=label,
    )


# Bytes per row of the step's packed host-bound results (``service.engine.output.pack_step``): the id, its
# log-probability, TOP_LOGPROBS (20) log-probabilities and their ids, float32 each.
PACKED_ROW_BYTES = (2 + 2 * 20) * 4


@dataclasses.dataclass(frozen=True)
class _Comm:
    count: int  # all-reduces
    sent: float  # bytes each device sends into them (both stages) and into the gather
    inside_s: float
    across_s: float
    across_bytes: float


def _collectives(cfg: LlamaConfig, par: Parallelism, tokens: int, hw: Hardware, wl: Workload) -> _Comm:
    """One step's collectives over ``tokens`` rows, per device.

    All-reduces: ``num_layers · all_reduces_per_layer + 1`` of ``tokens · D · act_itemsize`` bytes,
    each a ring inside a host, or the two-level all-reduce of the module docstring when a replica
    spans h > 1 hosts. The gather of the step's ``dp · batch`` packed rows is priced only when the
    replicas sit on several host groups (module docstring, "Several hosts").

    Raises:
        TopologyError: the layout does not tile the hosts, or spans hosts and ``hw`` has no
            inter-host link.
    """
    split = host_split(par, hw.devices_per_host)
    if split.crosses and hw.inter_host_bytes_per_s is None:
        raise TopologyError(
            f"hardware {hw.name!r} has no inter-host link (inter_host_bytes_per_s in configs/hardware.yaml): "
            f"a layout over {split.hosts} hosts ({hw.devices_per_host} devices per host) cannot be priced on it"
        )
    inter_bw, inter_lat = hw.inter_host_bytes_per_s or math.inf, hw.inter_host_latency_s
    count, sent, inside_s, across_s, across_bytes = 0, 0.0, 0.0, 0.0, 0.0
    if par.tp > 1:
        k, h = split.per_host, split.group_hosts
        count = cfg.num_layers * par.all_reduces_per_layer + 1  # + the vocabulary-split embedding lookup
        nbytes = tokens * cfg.hidden_size * wl.act_itemsize
        sent = count * 2 * (k - 1) / k * nbytes
        inside_s = count * ring_all_reduce_s(nbytes, k, hw.interconnect_bytes_per_s, wl.hop_latency_s)
        if h > 1:
            across_bytes = count * 2 * (h - 1) / h * nbytes / k
            sent += across_bytes
            across_s = count * ring_all_reduce_s(nbytes / k, h, inter_bw, inter_lat)
    g = split.data_groups
    if g > 1:
        gathered = par.dp * wl.batch * PACKED_ROW_BYTES
        share = (g - 1) / g * gathered
        sent += share
        across_bytes += share
        across_s += share / inter_bw + (g - 1) * inter_lat
    return _Comm(count=count, sent=sent, inside_s=inside_s, across_s=across_s, across_bytes=across_bytes)


def _held_step_bytes(cfg: LlamaConfig, held: HeldWeights, tokens: int) -> float:
    """Weight bytes one device reads in a step over ``tokens`` tokens with ``held`` weights."""
    return held.matmul + held.norms + held.embed_rows(cfg, tokens)


def decode_step(
    cfg: LlamaConfig, hw: Hardware, par: Parallelism, wl: Workload, held: HeldWeights | None = None
) -> StepCost:
    """One decode step of ``wl.batch`` sequences at context ``wl.context_len``, per device.

    bytes = (matmul weights + norms) · itemsize [+ B gathered embedding rows when untied]
          + B · S · kv_bytes_per_token / attn_split
    FLOPs = 2 · B · matmul weights + 4 · B · S · L · N · H / attn_split

    ``held``: weights held as blocks; the weight bytes are then ``held``'s (the matmul weights'
    and norms' bytes a device holds, plus B embedding rows), the FLOPs the same (the blocks'
    dequantization is not counted).
    """
    e, w, B, S = _elements(cfg, par), wl.itemsize, wl.batch, wl.context_len
    embed_rows = min(B, cfg.vocab_size) * cfg.hidden_size // par.tp if e.embed else 0
    weight_bytes = (e.matmul + e.norms + embed_rows) * w if held is None else _held_step_bytes(cfg, held, B)
    kv_bytes = B * S * cfg.kv_bytes_per_token(wl.kv_itemsize) / par.attn_split
    attn_flops = 4 * B * S * cfg.num_layers * cfg.num_heads * cfg.head_dim / par.attn_split
    flops = 2 * B * e.matmul + attn_flops
    comm = _collectives(cfg, par, B, hw, wl)
    return StepCost(
        flops=float(flops),
        weight_bytes=float(weight_bytes),
        kv_bytes=float(kv_bytes),
        collective_bytes=comm.sent,
        num_collectives=comm.count,
        memory_s=(weight_bytes + kv_bytes) / hw.hbm_bytes_per_s,
        compute_s=flops / hw.peak(wl.dtype),
        collective_s=comm.inside_s + comm.across_s,
        inside_host_s=comm.inside_s,
        across_hosts_s=comm.across_s,
        across_hosts_bytes=comm.across_bytes,
    )


def prefill_step(
    cfg: LlamaConfig, hw: Hardware, par: Parallelism, wl: Workload, held: HeldWeights | None = None
) -> StepCost:
    """Prefill of one prompt of T = ``wl.prompt_len`` tokens on an empty cache, per device.

    bytes = weights once + T embedding rows (untied) + T · kv_bytes_per_token written
    FLOPs = 2 · T · (attention + MLP weights) + 2 · V · D / tp (LM head, last position)
          + 2 · T(T+1) · L · N · H / attn_split (causal QKᵀ and PV: 4·N·H per pair, T(T+1)/2 pairs)

    ``held``: weights held as blocks, as in :func:`decode_step`.
    """
    e, w, T = _elements(cfg, par), wl.itemsize, wl.prompt_len
    embed_rows = min(T, cfg.vocab_size) * cfg.hidden_size // par.tp if e.embed else 0
    weight_bytes = (e.matmul + e.norms + embed_rows) * w if held is None else _held_step_bytes(cfg, held, T)
    kv_bytes = T * cfg.kv_bytes_per_token(wl.kv_itemsize) / par.attn_split
    attn_flops = 2 * T * (T + 1) * cfg.num_layers * cfg.num_heads * cfg.head_dim / par.attn_split
    flops = 2 * T * (e.attn + e.mlp) + 2 * e.lm_head + attn_flops
    comm = _collectives(cfg, par, T, hw, wl)
    return StepCost(
        flops=float(flops),
        weight_bytes=float(weight_bytes),
        kv_bytes=float(kv_bytes),
        collective_bytes=comm.sent,
        num_collectives=comm.count,
        memory_s=(weight_bytes + kv_bytes) / hw.hbm_bytes_per_s,
        compute_s=flops / hw.peak(wl.dtype),
        collective_s=comm.inside_s + comm.across_s,
        inside_host_s=comm.inside_s,
        across_hosts_s=comm.across_s,
        across_hosts_bytes=comm.across_bytes,
    )


def roofline(
    cfg: LlamaConfig, hw: Hardware, par: Parallelism, wl: Workload, held: HeldWeights | None = None
) -> Roofline:
    """Predict TTFT, TPOT, throughput and the regime.

    TTFT = prefill time of one prompt; TPOT = decode step time; throughput = dp · B / TPOT.
    On ``shared`` hardware (fake CPU devices) each of the layout's devices gets 1/n of the machine.
    With ``hw.devices_per_host`` set, collectives that cross hosts are priced as the module
    docstring's "Several hosts" says. ``held``: weights held as blocks (``held_weights``), priced
    by their bytes instead of ``wl.dtype``'s itemsize: the steps' weight bytes, the bytes stored,
    and the critical batch (ridge · bytes per matmul weight / 2).

    Raises:
        HardwareError: ``hw`` has no peak for ``wl.dtype``.
        TopologyError: the layout does not tile ``hw``'s hosts, or spans hosts without a link.
    """
    hw = hw.per_device(par.num_devices)
    ridge = hw.ridge(wl.dtype)
    per_weight = wl.itemsize if held is None else held.matmul / _elements(cfg, par).matmul
    return Roofline(
        hardware=hw,
        parallelism=par,
        workload=wl,
        prefill=prefill_step(cfg, hw, par, wl, held),
        decode=decode_step(cfg, hw, par, wl, held),
        ridge=ridge,
        critical_batch=ridge * per_weight / 2,
        weights_stored_bytes=float(weight_bytes_per_device(cfg, par, wl.itemsize) if held is None else held.total),
        kv_stored_bytes=wl.batch * wl.context_len * cfg.kv_bytes_per_token(wl.kv_itemsize) / par.attn_split,
        held=held,
    )


# ---- a measurement against the roofline -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Utilization:
    """One measured step next to the roofline's prediction of it.

    Attributes:
        predicted_s: the roofline's step time, seconds (TPOT for decode, TTFT for prefill).
        measured_s: the measured step time, seconds.
        mbu: :func:`mbu` of the measured step: (bytes per device / measured_s) / W_hbm per device.
        mfu: :func:`mfu` of the measured step: (FLOPs per device / measured_s) / peak per device.
    """

    predicted_s: float
    measured_s: float
    mbu: float
    mfu: float


def _utilization(step: StepCost, hw: Hardware, dtype: str, measured_s: float) -> Utilization:
    return Utilization(
        predicted_s=step.time_s,
        measured_s=measured_s,
        mbu=mbu(step.memory_bytes, measured_s, hw.hbm_bytes_per_s),
        mfu=mfu(step.flops, measured_s, hw.peak(dtype)),
    )


def decode_utilization(
    cfg: LlamaConfig,
    hw: Hardware,
    par: Parallelism,
    batch: int,
    context_len: int,
    dtype: str,
    step_s: float,
    kv_dtype: str | None = None,
    held: HeldWeights | None = None,
) -> Utilization:
    """Predicted TPOT, MBU and MFU of a measured decode step of ``step_s`` seconds.

    ``batch`` sequences per replica at ``context_len`` KV positions each, weights in ``dtype``,
    the KV cache in ``kv_dtype`` (None: ``dtype``). The bytes (weights + B·S KV) and FLOPs
    (2·B·matmul weights + 4·B·S·L·N·H attention)
    are :func:`decode_step`'s, per device; on ``shared`` hardware each device gets 1/n of it, as
    in :func:`roofline`. MBU as in Pope et al. 2022 §2 / the scaling book's inference chapter
    ("How to Scale Your Model"); MFU as in Chowdhery et al. 2022 (PaLM) §4.1. ``held``: weights
    held as blocks (:func:`held_weights`), whose bytes the MBU counts.

    Raises:
        HardwareError: ``hw`` has no peak for ``dtype``.
    """
    hw = hw.per_device(par.num_devices)
    wl = Workload(batch=batch, context_len=context_len, dtype=dtype, kv_dtype=kv_dtype)
    step = decode_step(cfg, hw, par, wl, held)
    return _utilization(step, hw, dtype, step_s)


def prefill_utilization(
    cfg: LlamaConfig,
    hw: Hardware,
    par: Parallelism,
    prompt_len: int,
    dtype: str,
    step_s: float,
    kv_dtype: str | None = None,
    held: HeldWeights | None = None,
) -> Utilization:
    """Predicted TTFT, MBU and MFU of a measured prefill of one ``prompt_len``-token prompt taking
    ``step_s`` seconds (bytes and FLOPs of :func:`prefill_step`, per device; the KV cache in
    ``kv_dtype``, None: ``dtype``). Prefill is
    compute-bound at any useful prompt length, so its MFU is the figure that matters (PaLM §4.1).
    ``held``: weights held as blocks, as in :func:`decode_utilization`.

    Raises:
        HardwareError: ``hw`` has no peak for ``dtype``.
    """
    hw = hw.per_device(par.num_devices)
    step = prefill_step(cfg, hw, par, Workload(prompt_len=prompt_len, dtype=dtype, kv_dtype=kv_dtype), held)
    return _utilization(step, hw, dtype, step_s)


# ---- a table ----------------------------------------------------------------------------------------
def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _fmt_b(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def format_table(rows: list[tuple[str, Roofline]], hosts: bool = False) -> str:
    """A fixed-width table, one line per (label, prediction): decode bytes per step and device
    split into weights / KV / collectives, the three time terms, TPOT, throughput, regime, TTFT.
    With ``hosts``, three more columns after t_comm: the hosts the layout spans, and t_comm split
    into its time inside a host (``t_in``) and across hosts (``t_across``)."""
    split = f" {'hosts':>5s} {'t_in':>9s} {'t_across':>9s}" if hosts else ""
    header = (
        f"{'layout':10s} {'DxM':>5s} {'attn':>5s} {'B':>5s} {'weights':>9s} {'KV':>9s} {'coll':>9s} "
        f"{'t_mem':>9s} {'t_flop':>9s} {'t_comm':>9s}{split} {'TPOT':>9s} {'tok/s':>10s} {'regime':>7s} "
        f"{'MBU@roof':>8s} {'TTFT':>9s} {'fits':>4s}"
    )
    lines = [header]
    for label, r in rows:
        d, p = r.decode, r.parallelism
        fits = {True: "yes", False: "NO", None: "?"}[r.fits]
        split = f" {r.hosts:5d} {_fmt_s(d.inside_host_s):>9s} {_fmt_s(d.across_hosts_s):>9s}" if hosts else ""
        lines.append(
            f"{label:10s} {p.dp}x{p.tp:<3d} {p.attention[:5]:>5s} {r.workload.batch:5d} {_fmt_b(d.weight_bytes):>9s} "
            f"{_fmt_b(d.kv_bytes):>9s} {_fmt_b(d.collective_bytes):>9s} {_fmt_s(d.memory_s):>9s} "
            f"{_fmt_s(d.compute_s):>9s} {_fmt_s(d.collective_s):>9s}{split} {_fmt_s(r.tpot_s):>9s} "
            f"{r.tokens_per_s:10.1f} {r.regime:>7s} "
            f"{mbu(d.memory_bytes, r.tpot_s, r.hardware.hbm_bytes_per_s):8.0%} {_fmt_s(r.ttft_s):>9s} {fits:>4s}"
        )
    return "\n".join(lines)


# ---- ``meshserve-bench roofline`` -----------------------------------------------------------------------
def add_roofline_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``meshserve-bench roofline`` (``benchmarks/cli.py`` makes the subcommand)."""
    p.add_argument("--model", help="GGUF file or model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", help="model cache (default $MESHSERVE_CACHE or ~/.cache/meshserve)")
    p.add_argument(
        "--hardware", nargs="+", default=["cpu-this-machine"], help="presets of configs/hardware.yaml (%(default)s)"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 where the chip has it")
    p.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="auto",
        help="how the weights are held, priced by their bytes: auto (default), stored: a GGUF's Q8_0/Q4_0/Q4_1/K-quant "
        "matmul weights (or a converted checkpoint's blocks) as their blocks, the rest --dtype (a model without "
        "blocks: all --dtype); int8: the float matmul weights as Q8_0 blocks too; float32, bfloat16: every "
        "weight dequantized to that dtype (sets --dtype)",
    )
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], help="KV-cache dtype (default: --dtype's)")
    p.add_argument("--batch", nargs="+", type=positive_int, default=[1], help="sequences per replica (%(default)s)")
    p.add_argument("--context", type=positive_int, default=2048, help="KV tokens per sequence in decode (%(default)s)")
    p.add_argument("--prompt", type=positive_int, default=128, help="prompt tokens for TTFT (%(default)s)")
    p.add_argument("--layout", nargs="+", default=["single"], help="presets or DxM, e.g. 1x1 1x8 8x1 (%(default)s)")
    p.add_argument("--attention", choices=["auto", "heads", "replicated"], help="override the layouts' attention")
    p.add_argument(
        "--act-bytes", type=positive_int, default=4, help="bytes per all-reduced element (4: float32 residual)"
    )
    p.add_argument(
        "--hop-latency-us", type=nonnegative_float, default=0.0, help="latency per ring hop of a collective, µs"
    )
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument(
        "--devices-per-host",
        type=positive_int,
        help="devices on each host (process); collectives between hosts go over the preset's inter-host link "
        "(default: every layout on one host)",
    )
    hosts.add_argument(
        "--hosts", type=positive_int, help="split each layout's devices evenly over this many hosts (processes)"
    )
    p.add_argument("--json", help="also write every prediction to this JSON file")


def _si(value: float, unit: str) -> str:
    """1.23e12, "B/s" -> "1.23 TB/s"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _inter_host_line(hw: Hardware) -> str:
    if hw.inter_host_bytes_per_s is None:
        return "  no inter-host link: layouts over several hosts are unusable on it\n"
    return (
        f"  across hosts: {_si(hw.inter_host_bytes_per_s, 'B/s')} per device, "
        f"{_fmt_s(hw.inter_host_latency_s)} per hop\n"
    )


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``meshserve-bench roofline``: print the predicted TTFT, TPOT, throughput and regime per hardware
    preset, layout and batch; with ``--json``, write them too.

    Returns 0, or 1 when no layout was usable. Exits with a message on an unreadable model, an
    unknown hardware preset or dtype, or a ``--json`` path that cannot be written.
    """
    from benchmarks import check_writable_file
    from model.weights.fetch import FetchError, resolve_model
    from model.weights.loader import held_formats, read_model_config
    from sharding.layouts import Layout, LayoutError, load_layout
    from sharding.plan import make_plan

    if args.json:
        check_writable_file(args.json, "meshserve-bench roofline")
    floats = ("float32", "bfloat16")
    if args.weights in floats and args.dtype not in (None, args.weights):
        raise SystemExit(
            f"meshserve-bench roofline: --weights {args.weights} and --dtype {args.dtype} contradict each other "
            f"(--weights {args.weights} holds every weight as that dtype); give one of them"
        )
    try:
        path = resolve_model(args.model, args.cache_dir)
        cfg = read_model_config(path)
        # The blocks the model is served with (``serve --weights``'s ``held_formats``); none: floats.
        formats = {} if args.weights in floats else held_formats(path, True, "int8" if args.weights == "int8" else None)
        quantized = args.weights == "int8" and formats != held_formats(path, True)
    except (OSError, ValueError, FetchError) as exc:  # missing file, not a GGUF / model directory
        raise SystemExit(f"meshserve-bench roofline: {args.model or 'the default model'}: {exc}") from None
    if args.context > cfg.max_position_embeddings:
        print(
            f"meshserve-bench roofline: warning: --context {args.context} is past the model's "
            f"{cfg.max_position_embeddings} positions",
            file=sys.stderr,
        )
    results: list[dict[str, Any]] = []
    unusable: list[str] = []
    by_hosts = args.devices_per_host is not None or args.hosts is not None
    for hw_name in args.hardware:
        try:
            hw = load_hardware(hw_name)
            dtype = args.dtype or (args.weights if args.weights in floats else None)
            dtype = dtype or ("bfloat16" if "bfloat16" in hw.peak_flops else "float32")
            peak, itemsize = hw.peak(dtype), _itemsize(dtype)
        except HardwareError as exc:
            raise SystemExit(f"meshserve-bench roofline: {exc}") from None
        ridge = peak / hw.hbm_bytes_per_s
        weights, per_weight = dtype, float(itemsize)  # how the weights are held; bytes per matmul weight
        if formats:
            from service.server.startup import describe_weights

            weights = describe_weights("int8" if quantized else "stored", formats, dtype)
            whole = held_weights(cfg, make_plan(Layout("1x1"), cfg), itemsize, formats)  # unsplit: the model's own
            per_weight = whole.matmul / _elements(cfg, Parallelism()).matmul
        memory = f", {_si(hw.memory_bytes, 'B')}" if hw.memory_bytes else ""
        print(
            f"hardware {hw.name}: {hw.description}: {_si(hw.hbm_bytes_per_s, 'B/s')} memory, "
            f"{_si(peak, 'FLOP/s')} {dtype}, {_si(hw.interconnect_bytes_per_s, 'B/s')} interconnect{memory}"
            f"{' in all, shared by the mesh devices (each of n gets 1/n)' if hw.shared else ''}\n"
            f"  source: {hw.source}\n"
            f"  ridge {ridge:.0f} FLOP/byte: weight matmuls turn compute-bound at batch {ridge * per_weight / 2:.0f}\n"
            f"{_inter_host_line(hw) if by_hosts else ''}"
            f"model {path.name}: {cfg.param_count() / 1e6:.1f} M parameters, {cfg.num_layers} layers, "
            f"{cfg.num_heads}/{cfg.num_kv_heads} heads; {weights} weights, {args.kv_dtype or dtype} KV; "
            f"context {args.context}, "
            f"prompt {args.prompt} tokens"
        )
        rows = []
        for name in args.layout:
            try:
                layout = load_layout(name)
                if args.attention:
                    layout = dataclasses.replace(layout, attention=args.attention)
                plan = make_plan(layout, cfg)
            except LayoutError as exc:
                print(f"  {name}: unusable: {exc}")
                unusable.append(name)
                continue
            on_hosts = hw
            if args.hosts is not None:
                if layout.num_devices % args.hosts:
                    print(
                        f"  {name}: unusable: {layout.num_devices} devices do not split evenly over {args.hosts} hosts"
                    )
                    unusable.append(name)
                    continue
                on_hosts = dataclasses.replace(hw, devices_per_host=layout.num_devices // args.hosts)
            elif args.devices_per_host is not None:
                on_hosts = dataclasses.replace(hw, devices_per_host=args.devices_per_host)
            for batch in args.batch:
                workload = Workload(
                    batch=batch,
                    context_len=args.context,
                    prompt_len=args.prompt,
                    dtype=dtype,
                    kv_dtype=args.kv_dtype,
                    act_itemsize=args.act_bytes,
                    hop_latency_s=args.hop_latency_us * 1e-6,
                )
                held = held_weights(cfg, plan, itemsize, formats, weights) if formats else None
                try:
                    r = roofline(cfg, on_hosts, Parallelism.from_plan(plan), workload, held)
                except TopologyError as exc:
                    print(f"  {name}: unusable: {exc}")
                    unusable.append(name)
                    break
                rows.append((layout.name, r))
                results.append({"layout": layout.name, "model": str(path), **r.as_dict()})
        print(format_table(rows, hosts=by_hosts) + "\n")
    print(
        "per decode step and device: weights, KV = bytes read; coll = bytes sent into TP all-reduces; t_mem = bytes / "
        "bandwidth; t_flop = FLOPs / peak; t_comm = ring all-reduces; TPOT = max(t_mem, t_flop) + t_comm; "
        "tok/s = DP x B / TPOT (B = sequences per replica); MBU@roof = t_mem / TPOT, the most a real run can "
        "reach; TTFT = prefill of one prompt. Collectives cost bandwidth only unless --hop-latency-us is given."
        + (
            " hosts = hosts the layout spans; coll includes the bytes of the gather across hosts; t_comm = t_in (inside a host: ring, or the reduce-scatter/all-gather "
            "stages) + t_across (inter-host link: the all-reduces' middle stage and the gather of the step's sampled "
            "rows over replicas on other hosts, with the preset's inter-host latency per hop)."
            if by_hosts
            else ""
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
        print(f"meshserve: wrote {args.json}", file=sys.stderr)
    if not results:
        print(f"meshserve-bench roofline: no usable layout among {', '.join(dict.fromkeys(unusable))}", file=sys.stderr)
        return 1
    return 0
