"""Build the ``model.llama.Llama`` module's graph and state: abstract (no weights), random, or
from a param tree that a format reader returned.

The format readers (``model/weights/gguf_weights.py``, ``model/weights/hf_weights.py``, ``model/weights/checkpoint.py``)
return pure param dicts; ``model/weights/loader.py`` picks the reader and builds the model with these.
This module imports none of them.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import LlamaConfig
from model.llama import Llama
from model.weights import block_params, quant_panels
from model.weights.quant_panels import QuantPanels


def abstract_llama(cfg: LlamaConfig, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph definition and an abstract state (``jax.ShapeDtypeStruct`` leaves of
    ``dtype`` inside ``nnx.Param`` variables that keep their ``logical_axes``); allocates no weights."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def random_llama(cfg: LlamaConfig, seed: int = 0, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """A randomly initialised model (normal(0, 0.02) weights of ``dtype``), for tests and speed benchmarks."""
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(seed), dtype=dtype))


def random_block_llama(
    cfg: LlamaConfig, seed: int = 0, dtype: Any = jnp.float32, fmt: str = "q8_0"
) -> tuple[nnx.GraphDef, nnx.State]:
    """A random model whose matmul weights are held as blocks of ``fmt`` (``QuantPanels``:
    uniformly random codes, one float16 scale for every block, chosen so the weights' spread is
    about ``random_llama``'s 0.02), its norms ones and any other weight normal(0, 0.02) of
    ``dtype``; made on the default device. For timing block weights at a large model's shapes
    (Llama 3 8B: 7e9 weights), where quantizing random floats on the host would take minutes;
    values do not change the speed. The blocks are the ones ``block_params.quantize_params``
    would make (``abstract_panels``); a weight whose widths are not whole 32-blocks stays float.

    Raises:
        ValueError: ``fmt`` is not one of ``model.weights.quant_panels.BLOCK_FORMATS`` (the
            record formats are not made at random here).
    """
    if fmt not in quant_panels.BLOCK_FORMATS:
        raise ValueError(f"unknown block format {fmt!r}: expected one of {', '.join(quant_panels.BLOCK_FORMATS)}")
    _, state = abstract_llama(cfg, dtype)
    key = jax.random.key(seed)
    counter = itertools.count()
    spread = {"q8_0": 73.9, "q4_0": 4.6, "q4_1": 4.6}  # std of the codes: uniform over 256 or 16 values

    def fill(path: str, leaf: jax.ShapeDtypeStruct) -> Any:
        k = jax.random.fold_in(key, next(counter))
        try:
            abstract = block_params.abstract_panels(path, tuple(leaf.shape), fmt)
        except ValueError:
            if fmt not in spread:
                raise
            abstract = None
        if abstract is None:
            if path.endswith("norm"):
                return jnp.ones(leaf.shape, leaf.dtype)
            return (0.02 * jax.random.normal(k, leaf.shape)).astype(leaf.dtype)
        codes = jax.random.bits(k, abstract.codes.shape, jnp.uint8)
        if abstract.codes.dtype == np.int8:
            codes = jax.lax.bitcast_convert_type(codes, jnp.int8)
        assert abstract.scales is not None  # a block format's
        scale = jnp.full(abstract.scales.shape, 0.02 / spread[fmt], jnp.float16)
        mins = None if abstract.mins is None else jnp.full(abstract.mins.shape, -7.5 * 0.02 / spread[fmt], jnp.float16)
        return QuantPanels(codes, scale, mins, abstract.out_shape, fmt)

    pure = block_params.walk_params(nnx.to_pure_dict(state), fill)
    return llama_from_params(cfg, pure, dtype)


def llama_from_params(
    cfg: LlamaConfig, params: dict[str, Any], dtype: Any = jnp.float32
) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph definition and a state holding ``params`` (the pure dict a format reader returns:
    ``{"embed": [V, D], "final_norm": [D], "layers": {...}, "lm_head": [D, V] (untied only)}``).

    The leaves stay what they are (host numpy arrays, or ``jax.Array`` already on devices);
    ``dtype`` is the dtype the abstract state declares, not a cast. Names and shapes are the
    readers' to check (each raises on a missing or misshapen array).

    Raises:
        ValueError: ``params`` has an array that ``Llama(cfg)`` lacks (``nnx.replace_by_pure_dict``).
    """
    graphdef, state = abstract_llama(cfg, dtype)
    nnx.replace_by_pure_dict(state, params)
    return graphdef, state
