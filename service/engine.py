"""The engine: params, KV cache and compiled steps of one model on one mesh.

Two jitted programs, each with explicit in/out shardings and the KV cache donated:

* ``prefill``: one prompt chunk padded to a power-of-two bucket -> that slot's KV written, and
  the first generated token sampled when the chunk is the prompt's last;
* ``decode``: one token for every slot.

Both also take and return (donated) the ids each slot's request has seen
(``model.sampling.TokenHistory``: counts of generated ids and a mask of prompt ids, [S, V]
each, replicated), which the penalties read: a request's first prefill chunk clears its slot's
row, every chunk adds its ids to the prompt mask, and every decode step counts the id it is fed
for each active slot. That id is the one the slot's previous step sampled (read on the device
when it has not reached the host yet), so when a step samples, the counts hold exactly the ids
generated so far: the prefill's first token and every decode step's, all but the one being
drawn.

Shape variants are bounded: prefill buckets are powers of two from ``MIN_BUCKET`` up to the
chunk size (times two attention windows: none for a first chunk, the whole cache for later
chunks); decode attends to a power-of-two window of the cache that covers the longest live
sequence. Everything compiled lands in JAX's persistent compilation cache.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Collection
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import cpu_argmax, cpu_matmul
from model.config import LlamaConfig
from model.kernels import choose_attention, choose_quant_kernel, has_stored_blocks
from model.kv_cache import BlockedKVCache, KVCache
from model.llama import decode_step, prefill, stack_layers, unstack_layers
from model.packed_weights import packed_bytes, panel_weights
from model.quant_panels import QuantPanels
from model.sampling import (
    SamplingParams,
    TokenHistory,
    count_generated,
    first_argmax,
    record_prompt,
    sample,
    seed_to_key,
)
from service.arg_types import WEIGHT_MODES
from service.request import SamplingOptions
from sharding.layouts import Layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import cache_shardings, param_shardings, replicated

log = logging.getLogger(__name__)

MIN_BUCKET = 16
MIN_DECODE_WINDOW = 128
WARM_DECODE_WINDOW = 512  # decode windows compiled before SERVING without --warmup-full


def power_of_two_buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from ``smallest`` while below ``largest``, then ``largest`` itself."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= 2
    out.append(largest)
    return out


def pick_bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n. Raises ValueError if n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


TOP_LOGPROBS = 20  # most alternatives a request may ask for


def pack_step(logits: jax.Array, ids: jax.Array, want_logprobs: jax.Array | bool = True) -> jax.Array:
    """Pack a step's host-bound results into one float32 array, so each step makes a single
    device-to-host copy.

    Args:
        logits: [R, V] float32. ids: [R] int32 sampled ids.
        want_logprobs: scalar bool; when False the log-softmax and top-k over the vocabulary
            are skipped (``lax.cond``) and those columns are 0.

    Returns:
        [R, 2 + 2 * TOP_LOGPROBS] float32: the id (exact in float32 below 2**24), its
        log-probability under the model's raw distribution (log-softmax of the logits, before
        temperature and filtering), the TOP_LOGPROBS highest log-probabilities, and their ids.
    """

    def with_logprobs(_: None) -> jax.Array:
        logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)
        top_lp, top_ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        return jnp.concatenate([chosen, top_lp, top_ids.astype(jnp.float32)], axis=-1)

    def without(_: None) -> jax.Array:
        return jnp.zeros((ids.shape[0], 1 + 2 * TOP_LOGPROBS), jnp.float32)

    extra = jax.lax.cond(jnp.asarray(want_logprobs), with_logprobs, without, None)
    return jnp.concatenate([ids[:, None].astype(jnp.float32), extra], axis=-1)


@dataclasses.dataclass(frozen=True)
class HostStep:
    """A step's results on the host, one row per slot (or one row for a prefill).

    Attributes: ids [R] int32; logprob [R] float32 (of each sampled id); top_logprobs
    [R, TOP_LOGPROBS] float32, descending; top_ids [R, TOP_LOGPROBS] int32.
    """

    ids: np.ndarray
    logprob: np.ndarray
    top_logprobs: np.ndarray
    top_ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """Device results of one compiled step: ``packed`` (see ``pack_step``) and logits [R, V]."""

    packed: jax.Array
    logits: jax.Array

    def host(self) -> HostStep:
        """The one device-to-host copy of the step (blocks until the step is done)."""
        a = np.asarray(self.packed)
        n = TOP_LOGPROBS
        return HostStep(
            ids=a[:, 0].astype(np.int32),
            logprob=a[:, 1],
            top_logprobs=a[:, 2 : 2 + n],
            top_ids=a[:, 2 + n :].astype(np.int32),
        )


LAYER_MODES = ("auto", "unrolled", "scan")
NATIVE_MODES = ("auto", "xla")
MATMUL_MODES = ("auto", "xla", "bf16x3")
DTYPES = ("float32", "bfloat16")  # parameter and KV-cache dtypes
KV_CACHE_MODES = ("auto", "slots", "paged")


def resolve_kv_dtype(kv_dtype: str, dtype: str) -> str:
    """``EngineConfig.kv_dtype`` resolved: "auto" becomes the parameter ``dtype``."""
    return dtype if kv_dtype == "auto" else kv_dtype


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Sizes of one engine.

    Attributes:
        num_slots: S, decode slots (concurrent sequences).
        max_seq_len: T_max, tokens per slot in the KV cache (prompt + generated).
        chunk_size: most prompt tokens per prefill call (the largest prefill bucket).
        dtype: parameter dtype name ("float32" on CPU; "bfloat16" on accelerators).
        kv_dtype: KV-cache dtype name: "auto" (the parameters' ``dtype``), "float32" or
            "bfloat16". A bfloat16 cache with float32 weights halves the bytes each decode
            step's attention reads (2 x L x K x H x 2 bytes per cached token instead of x 4;
            llama.cpp's default KV cache is likewise 16-bit, vLLM's ``--kv-cache-dtype``
            the same choice); keys and values are rounded to nearest even once, when written,
            and attention reads them widened exactly to float32. Greedy tokens can differ
            from a float32 cache's where two logits are closer than the rounding moves them
            (tests/test_kv_dtype.py measures the logit error against Hugging Face). On CPU it
            pays only where the native kernels read and write the cache (layers="unrolled", one
            device): XLA:CPU emulates bfloat16, so a scanned engine's decode steps are slower
            than with a float32 cache (the engine logs a warning). Measurements:
            docs/cpu-kernels.md.
        layers: how the steps run the decoder blocks: "scan" (stacked weights, ``lax.scan``,
            a ``KVCache``: one block compiled, the fast start-up), "unrolled" (weights kept
            per layer, an unrolled loop, a ``BlockedKVCache``: on XLA:CPU the faster steps,
            but each program compiles L blocks instead of one, so compiles take longer;
            docs/cpu-kernels.md) or "auto": "scan" on CPU devices, where compile time dominates
            start-up on few cores, "unrolled" on accelerators, where XLA:GPU reads a scanned
            layer's weights more slowly than an unrolled one's (docs/cpu-kernels.md, "Figures
            from other docstrings"). The engine resolves "auto" when it is built
            (``Engine.ecfg.layers`` holds the form it took). See ``model.llama.unstack_layers``.
        decode_attention: how unrolled steps attend: "auto" (the native CPU kernels of
            ``model.cpu_attention`` where they apply: CPU, one device, a float32 or bfloat16
            cache, G <= 8, head_dim a multiple of 16, the kernels built; decode
            steps then write and attend through one kernel, a first prefill chunk attends
            causally through the other; else XLA's dots) or "xla" (always XLA's dots). The
            slots engine's scan form always uses XLA's; the paged engine's decode tokens attend
            through ``model.cpu_paged_attention`` under "auto" on one CPU device (G <= 8,
            head_dim a multiple of 16, the kernels built).
        matmul: how unrolled steps multiply by the weights: "auto" (the native CPU kernel of
            ``model.cpu_matmul`` over a second, panel-packed copy of the layer and LM-head
            weights where it applies: CPU, one device, float32 weights whose output widths are
            multiples of 32, the kernel built, and ``cpu_matmul.faster_than_xla`` true at the
            step's rows: S for decode steps (which then read the packed LM head too), the
            largest prefill chunk for prefill; else XLA's dots), "xla", or "bf16x3": where
            "auto" could use the float32 kernel, the AMX kernel instead, over the weights split
            into bfloat16 halves (three bf16 products per float32 product, JAX's
            Precision.HIGH: relative error per product about 2^-16 instead of 2^-24; faster
            than the float32 kernel at prefill sizes, docs/cpu-kernels.md). An opt-in
            precision, for CPUs with AMX-BF16; elsewhere the engine refuses it. The scan form
            always uses XLA's.
        kv_cache: "paged" (one pool of pages shared by every sequence, several prompts per
            step, prefix caching and preemption, run by ``service.paged_engine.PagedEngine``: the
            scan form and XLA's attention), "slots" (a fixed region of ``max_seq_len`` positions
            per slot, one prompt chunk per step, the steps of this module's ``Engine``, with the
            native CPU kernels of the unrolled form) or "auto": "slots" where ``layers`` is
            "unrolled" (asked for by name: the native kernels run only there), else "paged".
            ``paged`` holds the resolved choice.
        weights: how a GGUF's matmul weights are held: "stored" (Q8_0, Q4_0 and Q4_1 tensors
            kept in their 32-weight blocks, ``model.quant_panels``, and multiplied by float32
            activations at exactly their dequantized values: the native CPU kernel of
            ``model.quant_matmul`` on one CPU device, XLA's dequantize-then-dot elsewhere; the
            norms and any tensor of another type dequantized to ``dtype``), "float32" or
            "bfloat16" (every weight dequantized to that dtype; it sets ``dtype``), "int8" (the
            float matmul weights quantized at load to Q8_0 blocks, symmetric int8 with a float16
            scale per 32 inputs, ``model.block_params``, and multiplied as stored blocks are;
            blocks already stored kept), or "auto": "stored" where the model is a GGUF or a
            checkpoint holding blocks and every pool is one CPU device with the kernel built
            (decode measured faster there: docs/performance.md), else ``dtype``. The server
            resolves "auto" when it loads the model (``stored_weights``). A Hugging Face
            directory or float checkpoint holds float weights: "stored" keeps them as they are.
        page_size: token positions per page of the paged cache (a power of two).
        kv_cache_tokens: positions in the paged pool (0: from ``kv_cache_memory``, or by default
            from the devices' memory: ``service.kv_pool``); ``max_seq_len`` stays each request's
            limit. A ``PagedEngine``'s ``ecfg`` holds the resolved size.
        kv_cache_memory: bytes of the paged pool per device (0: not given); at most one of it
            and ``kv_cache_tokens``.
        max_num_batched_tokens: most prefill tokens one paged step runs, over the chunks of
            several prompts (each padded to whole blocks of the step's prefill region); decode
            tokens have a region of their own, one position per slot.
    """

    num_slots: int = 4
    max_seq_len: int = 2048
    chunk_size: int = 512
    dtype: str = "float32"
    kv_dtype: str = "auto"
    layers: str = "auto"
    decode_attention: str = "auto"
    matmul: str = "auto"
    kv_cache: str = "auto"
    weights: str = "auto"
    page_size: int = 16
    kv_cache_tokens: int = 0
    kv_cache_memory: int = 0
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        if self.weights in DTYPES:  # --weights bfloat16 is --dtype bfloat16
            object.__setattr__(self, "dtype", self.weights)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_dtype != "auto" and self.kv_dtype not in DTYPES:
            raise ValueError(f"kv_dtype must be 'auto' or one of {', '.join(DTYPES)}, got {self.kv_dtype!r}")
        if self.layers not in LAYER_MODES:
            raise ValueError(f"layers must be one of {', '.join(LAYER_MODES)}, got {self.layers!r}")
        if self.decode_attention not in NATIVE_MODES:
            raise ValueError(
                f"decode_attention must be one of {', '.join(NATIVE_MODES)}, got {self.decode_attention!r}"
            )
        if self.matmul not in MATMUL_MODES:
            raise ValueError(f"matmul must be one of {', '.join(MATMUL_MODES)}, got {self.matmul!r}")
        if self.matmul == "bf16x3" and (self.layers != "unrolled" or self.dtype != "float32"):
            raise ValueError("matmul='bf16x3' needs layers='unrolled' and dtype='float32'")
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHE_MODES)}, got {self.kv_cache!r}")
        if self.kv_cache == "paged" and self.layers == "unrolled":
            # The paged step runs the scan form only; saying both would silently lose one.
            raise ValueError("kv_cache='paged' runs the scan form: layers='unrolled' needs kv_cache 'slots' or 'auto'")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if self.kv_cache_tokens < 0:
            raise ValueError(f"kv_cache_tokens must be >= 0 (0: num_slots x max_seq_len), got {self.kv_cache_tokens}")
        if self.kv_cache_memory < 0:
            raise ValueError(f"kv_cache_memory must be >= 0 bytes (0: not given), got {self.kv_cache_memory}")
        if self.kv_cache_tokens and self.kv_cache_memory:
            raise ValueError("give kv_cache_tokens or kv_cache_memory, not both")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    @property
    def paged(self) -> bool:
        """Whether this config's engine is the paged one (``kv_cache`` resolved)."""
        return self.kv_cache == "paged" or (self.kv_cache == "auto" and self.layers != "unrolled")

    @property
    def num_pages(self) -> int:
        """Pages in the paged pool: ``kv_cache_tokens`` over ``page_size``, rounded up; before a
        ``PagedEngine`` resolves a size that was not given in tokens (``service.kv_pool``),
        num_slots x max_seq_len positions'."""
        tokens = self.kv_cache_tokens or self.num_slots * self.max_seq_len
        return -(-tokens // self.page_size)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + generated) one request may hold: ``max_seq_len``, and with a
        paged cache no more than the whole pool, so a request that could never fit is refused at
        admission instead of waiting forever."""
        if self.paged:
            return min(self.max_seq_len, self.num_pages * self.page_size)
        return self.max_seq_len


def resolve_layers(layers: str, platform: str) -> str:
    """``EngineConfig.layers`` on a platform ("cpu", "gpu", "tpu", ...): "auto" becomes "scan" on
    "cpu" and "unrolled" elsewhere (see ``EngineConfig``); "scan" and "unrolled" stay.

    Raises:
        ValueError: ``layers`` is not one of ``LAYER_MODES``.
    """
    if layers not in LAYER_MODES:
        raise ValueError(f"layers must be one of {', '.join(LAYER_MODES)}, got {layers!r}")
    if layers != "auto":
        return layers
    return "scan" if platform == "cpu" else "unrolled"


def write_sampling_row(
    sp: dict[str, np.ndarray], slot: int, options: SamplingOptions, logprobs: bool, eos_ids: Collection[int]
) -> None:
    """Write one request's sampling parameters into row ``slot`` of the host arrays ``sp``
    (``SamplingParams.host``'s, in place). More EOS ids than the per-row width replaces
    ``sp["eos_ids"]`` with one widened to the next power of two (-1 padding)."""
    sp["temperature"][slot] = options.temperature
    sp["top_k"][slot] = options.top_k
    sp["top_p"][slot] = options.top_p
    sp["keys"][slot] = seed_to_key(options.seed)
    sp["logprobs"][slot] = logprobs
    sp["presence_penalty"][slot] = options.presence_penalty
    sp["frequency_penalty"][slot] = options.frequency_penalty
    sp["repetition_penalty"][slot] = options.repetition_penalty
    sp["min_p"][slot] = options.min_p
    ids = sorted(eos_ids)
    rows, width = sp["eos_ids"].shape
    if len(ids) > width:
        wider = np.full((rows, 1 << (len(ids) - 1).bit_length()), -1, np.int32)
        wider[:, :width] = sp["eos_ids"]
        sp["eos_ids"] = wider
    sp["eos_ids"][slot] = -1
    sp["eos_ids"][slot, : len(ids)] = ids


def upload_host_arrays(host: dict[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Device copies of host arrays (the sampling parameters), shapes and dtypes kept. Copies
    first: ``write_sampling_row`` writes the host arrays in place, and a CPU ``device_put`` may
    alias numpy memory."""
    return {k: global_array(v.copy(), sharding) for k, v in host.items()}


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``host`` on ``sharding``: ``jax.device_put`` where the sharding's devices are all this
    process's; where it spans several processes (jax.distributed, ``service.distributed``), built
    from this process's own shards of ``host``, which every process must hold alike (not
    checked: ``device_put`` would compare it across the processes, a collective per array, and
    ``jit`` refuses numpy inputs for a sharding there that is not fully replicated)."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes of ``tree``'s array shards held by each device, keyed by device id string."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device.id)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out


def place_params(params: Any, dtype: jnp.dtype, layers: str, mesh: jax.sharding.Mesh, rules: Any) -> tuple[Any, Any]:
    """A model state on a layout's mesh: float host arrays cast to ``dtype``, in the form of
    ``layers`` ("unrolled": per-layer tuples, else stacked), placed by ``param_shardings``. GGUF
    blocks kept as stored (``QuantPanels``) keep their dtypes and are multiplied by the native
    CPU kernel (``model.quant_matmul``) on one CPU device where it is built, else by XLA
    (``model.kernels.choose_quant_kernel``: the one place the choice is made).

    Returns:
        (the placed state, its tree of shardings).

    Raises:
        LayoutError: a split axis does not divide (``param_shardings``).
    """
    params = jax.tree.map(
        lambda a: np.asarray(a, dtype) if isinstance(a, np.ndarray) else a,
        params,
        is_leaf=lambda x: isinstance(x, QuantPanels),
    )
    params = unstack_layers(params) if layers == "unrolled" else stack_layers(params)
    if has_stored_blocks(params):
        params, kernel = choose_quant_kernel(params, list(mesh.devices.flat))
        log.info(
            "weights held as blocks: multiplied by %s",
            "the native CPU kernel" if kernel == "native" else "XLA (dequantize, dot)",
        )
    sharding = param_shardings(params, mesh, rules)
    if mesh.is_multi_process:
        # Each process places only its own shards of the host copy it read (``global_array``):
        # no collective per weight comparing whole arrays across processes.
        def place(s: jax.sharding.Sharding, sub: Any) -> Any:  # ``sharding`` is a prefix of ``params``
            return jax.tree.map(
                lambda a: global_array(a, s) if isinstance(a, np.ndarray) else jax.device_put(a, s), sub
            )

        return jax.tree.map(place, sharding, params), sharding
    return jax.device_put(params, sharding), sharding


class Engine:
    """Owns the sharded params, the KV cache and the compiled steps of one layout.

    Not thread-safe: one engine-loop thread calls every method after construction.

    Args:
        cfg: model hyperparameters.
        graphdef: the Llama module's graph (``nnx.split``).
        params: host or device state of the parameters (placed here with the layout's shardings).
        layout: the mesh layout.
        engine_cfg: slot count, max length, chunk size, dtype.
        devices: devices to build the mesh on (default: all).

    Raises:
        LayoutError: the layout does not fit the devices or does not divide the model's axes.
        ValueError: ``matmul="bf16x3"`` where it cannot run (not one CPU device, no AMX-BF16,
            the kernels not built, or weight widths not multiples of 32).
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        graphdef: nnx.GraphDef,
        params: Any,
        layout: Layout,
        engine_cfg: EngineConfig,
        devices: list[jax.Device] | None = None,
    ):
        self.cfg = cfg
        self.graphdef = graphdef
        self.layout = layout
        self.dtype = jnp.dtype(engine_cfg.dtype)
        self.plan = make_plan(layout, cfg, engine_cfg.num_slots)
        self.mesh = make_mesh(layout, devices)
        platform = self.mesh.devices.flat[0].platform
        layers = resolve_layers(engine_cfg.layers, platform)
        kv_dtype = resolve_kv_dtype(engine_cfg.kv_dtype, engine_cfg.dtype)
        engine_cfg = dataclasses.replace(engine_cfg, layers=layers, kv_dtype=kv_dtype)
        self.ecfg = engine_cfg
        self.kv_dtype = jnp.dtype(kv_dtype)
        rules = self.plan.rules
        S, T = engine_cfg.num_slots, engine_cfg.max_seq_len
        # Per-layer weights (the steps loop over the layers) or stacked ones (lax.scan); both
        # conversions leave a state already in their form as it is.
        self.params, self.param_sharding = place_params(params, self.dtype, engine_cfg.layers, self.mesh, rules)
        # The cache form follows the weights': one [L, S, K, T, H] array each for K and V with
        # the scan, separate blocks per layer with the unrolled loop (see BlockedKVCache).
        cache_cls = BlockedKVCache if engine_cfg.layers == "unrolled" else KVCache
        cache_sh = cache_shardings(cache_cls.abstract(cfg, S, T, self.kv_dtype), self.mesh, rules)
        self.repl = replicated(self.mesh)
        self.cache = jax.jit(partial(cache_cls.zeros, cfg, S, T, self.kv_dtype), out_shardings=cache_sh)()
        # The ids each slot's request has seen, for the penalties: [S, V] each, replicated (the
        # penalties act on whole rows of the logits, which the steps return replicated too).
        self.history = jax.jit(partial(TokenHistory.zeros, S, cfg.vocab_size), out_shardings=self.repl)()
        one_cpu = engine_cfg.layers == "unrolled" and self.mesh.devices.size == 1 and platform == "cpu"
        # Unrolled layers on one CPU device attend through the native kernels where they are built.
        cache_form = "blocked" if engine_cfg.layers == "unrolled" else "dense"
        self.kernels = choose_attention(
            cache_form, list(self.mesh.devices.flat), engine_cfg.decode_attention, cfg, self.kv_dtype
        )
        if self.kv_dtype == jnp.bfloat16 and not self.kernels.native and platform == "cpu":
            log.warning(
                "a bfloat16 KV cache on XLA:CPU without the native kernels (they need layers='unrolled' on one "
                "CPU device): XLA emulates bfloat16 there, so decode steps are several times slower than "
                "with a float32 cache; use layers='unrolled' or kv_dtype='float32'"
            )
        # Greedy ids (and the Gumbel-max draw) by the native argmax where the other kernels run.
        self.argmax = cpu_argmax.first_argmax if one_cpu and cpu_argmax.available() else first_argmax
        # The matmul weights packed for a native kernel (a second copy), or None, and the ones
        # prefill chunks and decode steps read: the float32 kernel only where
        # cpu_matmul.faster_than_xla says it beats XLA's dots at their rows (S for a decode step,
        # the largest chunk for prefill).
        self.panels: dict[str, Any] | None = None
        self._prefill_panels: dict[str, Any] | None = None
        self._decode_panels: dict[str, Any] | None = None
        if engine_cfg.matmul == "bf16x3":
            if not (one_cpu and cpu_matmul.amx_available()):
                raise ValueError(
                    "matmul='bf16x3' needs one CPU device with AMX-BF16 (Sapphire Rapids or later, "
                    "Linux >= 5.16) and the native kernels built; use matmul='auto'"
                )
            # Decode with one slot stays on XLA's matrix-vector products (not timed on AMX at M = 1).
            self.panels = panel_weights(nnx.merge(graphdef, self.params), lm_head=S >= 2, format="bf16x3")
            self._prefill_panels = self.panels
            self._decode_panels = self.panels if S >= 2 else None
        elif one_cpu and engine_cfg.matmul == "auto" and cpu_matmul.available():
            decode = cpu_matmul.faster_than_xla(S)
            prefill = cpu_matmul.faster_than_xla(min(engine_cfg.chunk_size, T))
            if decode or prefill:
                try:  # decode reads the packed LM head too
                    self.panels = panel_weights(nnx.merge(graphdef, self.params), lm_head=decode)
                except ValueError as e:
                    log.info("matmuls stay XLA's: %s", e)
            self._prefill_panels = self.panels if prefill else None
            self._decode_panels = self.panels if decode else None
        if engine_cfg.layers == "unrolled":
            kernel = "AMX bf16x3" if engine_cfg.matmul == "bf16x3" else "float32"
            log.info(
                "decode attention: %s; matmuls: %s",
                self.kernels.name,
                f"native CPU kernel, {kernel} ({self.panel_bytes() / 1e6:.0f} MB of packed weights), for "
                + " and ".join(
                    step for step, w in (("prefill", self._prefill_panels), ("decode", self._decode_panels)) if w
                )
                if self.panels is not None
                else "XLA dots",
            )
        self._cache_sh = cache_sh

        self.prefill_buckets = power_of_two_buckets(MIN_BUCKET, min(engine_cfg.chunk_size, T))
        self.decode_windows = power_of_two_buckets(min(MIN_DECODE_WINDOW, T), T)
        self._prefill_fns: dict[int, Any] = {}
        self._decode_fns: dict[int, Any] = {}

        # The per-slot sampling parameters but ``ban_eos`` (which changes every step): host
        # arrays, which ``set_sampling`` writes and prefill reads a row of, and their replicated
        # device copy, which decode steps read (device arrays skip a host transfer per step).
        self._sp = SamplingParams.host(S)
        del self._sp["ban_eos"]
        self._sampling = upload_host_arrays(self._sp, self.repl)
        # Stand-ins for "no previous step" outputs: device arrays with the outputs' sharding, so
        # a decode step's argument signature is the same whether or not the previous step's
        # outputs are passed (a numpy stand-in made the loop's second step compile again).
        width = 2 + 2 * TOP_LOGPROBS
        self._no_decode = jax.device_put(np.zeros((S, width), np.float32), self.repl)
        self._no_prefill = jax.device_put(np.zeros((1, width), np.float32), self.repl)

    # ---- compiled programs ---------------------------------------------------------------
    def _prefill_fn(self, kv_len: int) -> Any:
        if kv_len not in self._prefill_fns:
            # Locals, not ``self``: a jitted function closing over the engine that holds it is a
            # reference cycle, which kept each engine (weights, KV cache) alive until a full
            # garbage collection, e.g. the old one after a live layout switch.
            graphdef, kernels, argmax = self.graphdef, self.kernels, self.argmax

            def run(params, panels, cache, history, tokens, start, true_len, slot, sp):  # type: ignore[no-untyped-def]
                history = record_prompt(history, slot, tokens, true_len, start == 0)
                model = nnx.merge(graphdef, params)
                logits, cache = prefill(
                    model,
                    cache,
                    tokens,
                    start,
                    true_len,
                    slot,
                    kv_len=kv_len,
                    kernels=kernels,
                    panels=panels,
                )
                token = sample(logits[None], sp, (start + true_len)[None], argmax, history.row(slot))
                return pack_step(logits[None], token, jnp.any(sp.logprobs)), logits, cache, history

            r = self.repl
            self._prefill_fns[kv_len] = jax.jit(
                run,
                in_shardings=(self.param_sharding, r, self._cache_sh, r, r, r, r, r, r),
                out_shardings=(r, r, self._cache_sh, r),
                donate_argnums=(2, 3),
            )
        return self._prefill_fns[kv_len]

    def _decode_fn(self, kv_len: int) -> Any:
        if kv_len not in self._decode_fns:
            # Locals, not ``self``: a jitted function closing over the engine that holds it is a
            # reference cycle, which kept each engine (weights, KV cache) alive until a full
            # garbage collection, e.g. the old one after a live layout switch.
            graphdef, kernels, argmax = self.graphdef, self.kernels, self.argmax
            idle = self.ecfg.max_seq_len  # the position of an idle slot

            def run(params, panels, cache, history, host_tokens, source, prev_decode, prev_prefill, positions, sp, ban):  # type: ignore[no-untyped-def]
                # Each slot's input id comes from the host (source 0), from the previous decode
                # step's output (1) or from the previous prefill's output (2), so the next step
                # can be dispatched before the previous one's ids reach the host.
                from_decode = prev_decode[:, 0].astype(jnp.int32)
                from_prefill = jnp.broadcast_to(prev_prefill[0, 0].astype(jnp.int32), host_tokens.shape)
                tokens = jnp.select([source == 1, source == 2], [from_decode, from_prefill], host_tokens)
                # Each active slot's input is the id its previous step generated: count it.
                history = count_generated(history, tokens, positions < idle)
                model = nnx.merge(graphdef, params)
                logits, cache = decode_step(
                    model,
                    cache,
                    tokens,
                    positions,
                    kv_len=kv_len,
                    kernels=kernels,
                    panels=panels,
                )
                sp = SamplingParams(**sp, ban_eos=ban)  # the device parameters and this step's bans
                next_ids = sample(logits, sp, positions + 1, argmax, history)
                return pack_step(logits, next_ids, jnp.any(sp.logprobs)), logits, cache, history

            r = self.repl
            self._decode_fns[kv_len] = jax.jit(
                run,
                in_shardings=(self.param_sharding, r, self._cache_sh, r, r, r, r, r, r, r, r),
                out_shardings=(r, r, self._cache_sh, r),
                donate_argnums=(2, 3),
            )
        return self._decode_fns[kv_len]

    # ---- steps -----------------------------------------------------------------------------
    def set_sampling(
        self, slot: int, options: SamplingOptions, logprobs: bool = False, eos_ids: Collection[int] = ()
    ) -> None:
        """Install a request's sampling parameters in its slot (no recompile); ``logprobs``: the
        request wants log-probabilities computed; ``eos_ids``: the ids a step called with
        ``ban_eos`` set for the slot may not pick (the request's ``eos_ids``).

        Writes the host arrays, then uploads them once for the decode steps to read. More EOS
        ids than any request so far widens the per-slot array to the next power of two (the
        steps then compile once more for the new shape)."""
        write_sampling_row(self._sp, slot, options, logprobs, eos_ids)
        self._sampling = upload_host_arrays(self._sp, self.repl)

    def _slot_sampling(self, slot: int, ban_eos: bool) -> SamplingParams:
        """Row ``slot`` of the host sampling arrays ([1, ...] each) with ``ban_eos`` [1] bool."""
        sp = {k: v[slot : slot + 1] for k, v in self._sp.items()}
        return SamplingParams(**sp, ban_eos=np.array([ban_eos]))

    def prefill(self, slot: int, tokens: list[int], start: int, ban_eos: bool = False) -> StepOutput:
        """Write prompt tokens at positions [start, start + len(tokens)) of ``slot``.

        Args:
            slot: the slot being filled.
            tokens: 1..chunk_size prompt ids.
            start: position of tokens[0]; later chunks attend to the slot's cached prefix. A
                chunk at 0 starts a request: it clears the slot's history (the ids seen).
            ban_eos: the sampled first token may not be one of the slot's EOS ids.

        Returns:
            The step's output for one row (the slot): the sampled first token, its log-probs, and
            the last position's logits [1, V]; meaningful only after the prompt's last chunk.
            Dispatch is asynchronous.
        """
        n = len(tokens)
        if start + n > self.ecfg.max_seq_len:
            raise ValueError(f"prefill past the cache: {start} + {n} > {self.ecfg.max_seq_len}")
        bucket = pick_bucket(n, self.prefill_buckets)
        padded = np.zeros(bucket, np.int32)
        padded[:n] = tokens
        kv_len = 0 if start == 0 else self.ecfg.max_seq_len
        packed, logits, self.cache, self.history = self._prefill_fn(kv_len)(
            self.params,
            self._prefill_panels,
            self.cache,
            self.history,
            padded,
            np.int32(start),
            np.int32(n),
            np.int32(slot),
            self._slot_sampling(slot, ban_eos),
        )
        return StepOutput(packed, logits[None])

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        source: np.ndarray | None = None,
        prev_decode: StepOutput | None = None,
        prev_prefill: StepOutput | None = None,
        ban_eos: np.ndarray | None = None,
    ) -> StepOutput:
        """One decode step for all slots.

        Args:
            tokens: [S] int32, each slot's last id when it is known on the host (anything for
                idle slots).
            positions: [S] int32, each id's position; ``max_seq_len`` marks an idle slot.
            source: [S] int32 or None (all 0): where each slot's input id is: 0 ``tokens``,
                1 row ``slot`` of ``prev_decode``, 2 row 0 of ``prev_prefill`` (still on the
                device: the caller need not wait for the previous step).
            prev_decode, prev_prefill: the previous step's outputs, when ``source`` uses them.
            ban_eos: [S] bool or None (all False): the slot's sampled id may not be one of its
                EOS ids (``set_sampling``).

        Returns:
            One row per slot (dispatch is async; rows of idle slots are meaningless).
        """
        S = self.ecfg.num_slots
        live = positions[positions < self.ecfg.max_seq_len]
        need = int(live.max()) + 1 if live.size else 1
        kv_len = pick_bucket(need, self.decode_windows)
        packed, logits, self.cache, self.history = self._decode_fn(kv_len)(
            self.params,
            self._decode_panels,
            self.cache,
            self.history,
            tokens.astype(np.int32),
            np.zeros(S, np.int32) if source is None else source.astype(np.int32),
            prev_decode.packed if prev_decode is not None else self._no_decode,
            prev_prefill.packed if prev_prefill is not None else self._no_prefill,
            positions.astype(np.int32),
            self._sampling,
            np.zeros(S, bool) if ban_eos is None else ban_eos.astype(bool),
        )
        return StepOutput(packed, logits)

    def warmup(self, full: bool = False) -> float:
        """Compile (and run once) the programs requests need: every first-chunk prefill bucket and
        the decode windows up to ``WARM_DECODE_WINDOW`` tokens; every variant (later chunks of
        long prompts, all windows) if ``full``. Anything else compiles on first use (and lands in
        the persistent compilation cache).

        Returns the seconds spent. Writes only to positions that are masked for every request.
        """
        t0 = time.perf_counter()
        S, T = self.ecfg.num_slots, self.ecfg.max_seq_len
        buckets = self.prefill_buckets
        for b in buckets:
            self.prefill(0, [0] * b, 0).host()
        if full and self.prefill_buckets[-1] < T:
            for b in buckets:
                self.prefill(0, [0] * b, 1).host()
        windows = self.decode_windows if full else [w for w in self.decode_windows if w <= WARM_DECODE_WINDOW]
        idle = np.full(S, T, np.int32)
        for w in windows:
            pos = idle.copy()
            pos[0] = w - 1
            self.decode(np.zeros(S, np.int32), pos).host()
        elapsed = time.perf_counter() - t0
        log.info("warm-up compiled %d prefill and %d decode programs in %.1f s", len(buckets), len(windows), elapsed)
        return elapsed

    # ---- layout switch -----------------------------------------------------------------------
    def warmup_to_replace(self, old: Engine) -> float:
        """Before this engine takes over from ``old`` (a live switch): compile every variant
        (``warmup(full=True)``), so nothing compiles after the switch. Returns the seconds spent."""
        return self.warmup(full=True)

    def relayout(self, layout: Layout, devices: list[jax.Device], params: Any = None) -> Engine:
        """A new engine with this engine's weights on ``layout``'s mesh over ``devices``.

        The weights move device to device (``jax.device_put`` to the new shardings), unless
        ``params`` (e.g. restored from a checkpoint into the new shardings) are given; the new
        engine has its own zeroed KV cache and token history until ``adopt_state`` moves the
        live ones. Safe to call
        from another thread while this engine keeps stepping (it only reads the weights).

        Raises:
            LayoutError: the layout does not fit ``devices`` or the model's axes.
        """
        return Engine(self.cfg, self.graphdef, self.params if params is None else params, layout, self.ecfg, devices)

    def adopt_state(self, old: Engine) -> None:
        """Take over ``old``'s live KV cache, token history and per-slot sampling parameters
        (host arrays copied, device ones moved to this mesh). Call between two steps of ``old``,
        on the thread that steps it."""
        self.cache = jax.device_put(old.cache, self._cache_sh)
        self.history = jax.device_put(old.history, self.repl)
        self._sp = {k: v.copy() for k, v in old._sp.items()}
        self._sampling = jax.device_put(old._sampling, self.repl)

    # ---- facts -------------------------------------------------------------------------------
    @property
    def decode_panels(self) -> dict[str, Any] | None:
        """The packed weights decode steps read (a jit argument of every decode call), or None
        when decode multiplies by the module's weights (XLA's dots)."""
        return self._decode_panels

    def packed_bytes_on(self, devices: list[jax.Device]) -> int:
        """Bytes of the packed weight copy a ``relayout`` onto ``devices`` (its mesh's devices)
        may add beside the weights, without building it: where the new engine could pack (the
        unrolled layers on one CPU device, ``matmul`` "bf16x3", or "auto" with the kernel built),
        every weight the kernel takes, LM head included: an upper bound, since "auto" packs only
        where ``cpu_matmul.faster_than_xla`` says so. bf16x3 panels take 4 bytes per weight too
        (two bfloat16 halves)."""
        one_cpu = self.ecfg.layers == "unrolled" and len(devices) == 1 and devices[0].platform == "cpu"
        native = self.ecfg.matmul == "bf16x3" or (self.ecfg.matmul == "auto" and cpu_matmul.available())
        return packed_bytes(nnx.merge(self.graphdef, self.params)) if one_cpu and native else 0

    def panel_bytes(self) -> int:
        """Bytes of the panel-packed weight copy the native matmuls read (0 without it)."""
        return sum(leaf.nbytes for leaf in jax.tree.leaves(self.panels))

    def weight_bytes_per_device(self) -> dict[str, int]:
        """Bytes of parameters held by each device, keyed by device id string (without the
        packed copy of the native matmuls, ``panel_bytes``)."""
        return bytes_per_device(self.params)
