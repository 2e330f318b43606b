"""Build the Llama module's graph and a host copy of its parameters from a GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax.numpy as jnp
from flax import nnx

from model.config import LlamaConfig
from model.gguf_weights import load_gguf_params
from model.llama import Llama


def abstract_llama(cfg: LlamaConfig, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's graph definition and an abstract state (ShapeDtypeStruct leaves inside
    ``nnx.Param`` variables that keep their ``logical_axes``); allocates no weights."""
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    return nnx.split(model)


def random_llama(cfg: LlamaConfig, seed: int = 0, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """A randomly initialised model (normal(0, 0.02) weights), for tests and speed benchmarks."""
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(seed), dtype=dtype))


def load_gguf_model(path: str | Path, dtype: Any = jnp.float32) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """Read config and weights of a Llama GGUF into (config, graphdef, host state).

    The state's leaves are host numpy arrays of ``dtype``; place them with
    ``jax.device_put(state, sharding.rules.param_shardings(...))``.

    Raises:
        FileNotFoundError, GGUFMetadataError, WeightError: see ``model.gguf_weights``.
    """
    cfg = LlamaConfig.from_gguf(path)
    graphdef, state = abstract_llama(cfg, dtype)
    nnx.replace_by_pure_dict(state, load_gguf_params(path, cfg, jnp.dtype(dtype)))
    return cfg, graphdef, state
