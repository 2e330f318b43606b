"""The one place where the platform picks the model's kernels: ``choose`` returns what an engine
on a set of devices runs (attention backend, argmax, the form its weights take, its layer loop),
and ``to_form`` puts a model's parameters in that form. The forward pass (``model.llama``) and
the engine read the choice; neither branches on the platform.

On one CPU device, where the native kernels are built (``model.native``): attention through
``model.attention.cpu`` (pages read in place), float32 matmul weights packed into panels
(``model.weights.packed_weights``), GGUF blocks multiplied by ``model.native.quant_matmul`` and greedy
ids by ``model.native.cpu_argmax``. Everywhere else (several devices, accelerators, no
compiler): XLA's paths, which also serve as the reference the native kernels are tested
against.

The layer loop: ``lax.scan`` over stacked weights on CPU (one block compiled: the fast start
on few cores, and the native kernels read a stacked weight in place at the scan's index) and
an unrolled loop over per-layer weights on accelerators, where a scanned chain of matmuls read
its weights at a fraction of the unrolled one's rate (docs/performance.md;
``benchmarks/gpu_check.sh`` measures both forms of the served engine).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from model import sampling
from model.attention import cpu as cpu_attention
from model.attention.base import AttentionBackend
from model.attention.xla import XlaAttention
from model.config import LlamaConfig
from model.llama import stack_layers, unstack_layers
from model.native import cpu_argmax, cpu_matmul, quant_matmul
from model.weights.packed_weights import pack_panels, unpack_panels
from model.weights.quant_panels import QuantPanels

ATTENTION_MODES = ("auto", "xla")  # EngineConfig.attention
MATMUL_MODES = ("auto", "xla")  # EngineConfig.matmul
LAYER_LOOPS = ("auto", "scan", "unrolled")  # EngineConfig.layer_loop


@dataclasses.dataclass(frozen=True)
class Kernels:
    """What an engine runs on its devices.

    Attributes:
        attention: the attention backend (``model.attention.base``).
        argmax: greedy decoding's first-maximum index over the vocabulary, [R, V] -> [R] int32.
        panels: float32 matmul weights are packed into panels for the native kernel.
        quant_kernel: how GGUF blocks kept as stored are multiplied: "native" or "xla".
        layer_loop: "scan" (stacked weights, ``lax.scan``) or "unrolled" (per-layer weights).
    """

    attention: AttentionBackend
    argmax: Callable[[jax.Array], jax.Array]
    panels: bool
    quant_kernel: str
    layer_loop: str

    def describe(self) -> str:
        """One line for the engine's log."""
        matmuls = "native float32 panels" if self.panels else "XLA's dots"
        return (
            f"attention: {self.attention.name}; float matmuls: {matmuls}; stored blocks: {self.quant_kernel} kernel; "
            f"layers: {self.layer_loop}"
        )


def one_cpu(devices: Sequence[jax.Device]) -> bool:
    """Whether ``devices`` is one CPU device, where the native kernels run."""
    return len(devices) == 1 and devices[0].platform == "cpu"


def choose(
    devices: Sequence[jax.Device],
    cfg: LlamaConfig,
    dtype: Any,
    kv_dtype: Any,
    *,
    attention: str = "auto",
    matmul: str = "auto",
    layer_loop: str = "auto",
) -> Kernels:
    """The kernels an engine on ``devices`` runs (see the module docstring).

    Args:
        devices: the engine's mesh devices.
        cfg: the model's shapes (query heads per KV head, head dim).
        dtype: the float parameters' dtype; kv_dtype: the cache's.
        attention: "auto" (the native kernels where they apply) or "xla".
        matmul: "auto" (float32 panels where they apply) or "xla".
        layer_loop: "auto" (scan on CPU, unrolled elsewhere), "scan" or "unrolled".

    Raises:
        ValueError: a mode outside its choices.
    """
    for name, value, modes in (("attention", attention, ATTENTION_MODES), ("matmul", matmul, MATMUL_MODES),
                               ("layer_loop", layer_loop, LAYER_LOOPS)):  # fmt: skip
        if value not in modes:
            raise ValueError(f"{name} must be one of {', '.join(modes)}, got {value!r}")
    cpu = one_cpu(devices)
    if layer_loop == "auto":
        layer_loop = "scan" if devices[0].platform == "cpu" else "unrolled"
    native_attention = (
        attention == "auto"
        and cpu
        and cpu_attention.supports(cfg.q_per_kv, cfg.head_dim, kv_dtype)
        and cpu_attention.available()
    )
    return Kernels(
        attention=cpu_attention.NativeCpuAttention() if native_attention else XlaAttention(),
        argmax=cpu_argmax.first_argmax if cpu and cpu_argmax.available() else sampling.first_argmax,
        # The native kernels read a stack in place at the scan's layer index.
        panels=cpu and matmul == "auto" and layer_loop == "scan" and jnp.dtype(dtype) == jnp.float32
        and cpu_matmul.available(),
        quant_kernel="native" if cpu and quant_matmul.available() else "xla",
        layer_loop=layer_loop,
    )  # fmt: skip


def keeps_blocks(platform: str, devices_per_pool: Sequence[int]) -> bool:
    """Whether ``weights="auto"`` keeps a model's GGUF blocks as stored: where every pool is one
    device of a CPU whose native quantized matmul is built (faster decode than float32 there,
    and the same values; docs/performance.md, "The one engine against the commit before it and
    llama.cpp"); elsewhere they are dequantized to the engine's dtype."""
    return platform == "cpu" and all(n == 1 for n in devices_per_pool) and quant_matmul.available()


def to_form(graphdef: nnx.GraphDef, state: nnx.State, kernels: Kernels) -> tuple[nnx.GraphDef, nnx.State]:
    """A model's parameters in the form ``kernels`` runs: stacked (scan) or per layer
    (unrolled), float32 weights packed into panels or not (packed ones unpacked), stored blocks
    marked with their kernel. The graph changes where a tied model gains or drops its packed
    head (``pack_panels``). Arrays are converted where they are (host or device)."""
    model = nnx.merge(graphdef, stack_layers(state))
    if kernels.panels:
        pack_panels(model)
    else:
        unpack_panels(model)
    graphdef, state = nnx.split(model)
    if kernels.layer_loop == "unrolled":
        state = unstack_layers(state)
    state = jax.tree.map(
        lambda v: dataclasses.replace(v, kernel=kernels.quant_kernel) if isinstance(v, QuantPanels) else v,
        state,
        is_leaf=lambda x: isinstance(x, QuantPanels),
    )
    return graphdef, state
