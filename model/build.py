"""Build the ``model.llama.Llama`` module's graph and state: abstract (no weights), random, or
from a param tree that a format reader returned.

The format readers (``model/gguf_weights.py``, ``model/hf_weights.py``, ``model/checkpoint.py``)
return pure param dicts; ``model/loader.py`` picks the reader and builds the model with these.
This module imports none of them.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from model.config import LlamaConfig
from model.llama import Llama


def abstract_llama(cfg: LlamaConfig, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph definition and an abstract state (``jax.ShapeDtypeStruct`` leaves of
    ``dtype`` inside ``nnx.Param`` variables that keep their ``logical_axes``); allocates no weights."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def random_llama(cfg: LlamaConfig, seed: int = 0, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """A randomly initialised model (normal(0, 0.02) weights of ``dtype``), for tests and speed benchmarks."""
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(seed), dtype=dtype))


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
