"""Build the Llama module's graph and a host copy of its parameters from a GGUF file or a
Hugging Face directory, and tell which kind of model a path holds.

Converted checkpoints (``model/checkpoint.py``) are restored straight onto devices instead: the
caller builds the target shardings from ``abstract_llama`` and calls ``restore_checkpoint``.
"""

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


def model_format(path: str | Path) -> str:
    """Which loader ``path`` needs: "gguf" (a file), "checkpoint" (a directory written by
    ``meshserve convert``) or "hf" (a Hugging Face model directory with ``config.json``).

    Raises:
        FileNotFoundError: the path does not exist, or is a directory of neither kind.
    """
    from model.checkpoint import is_checkpoint

    p = Path(path)
    if p.is_file():
        return "gguf"
    if not p.is_dir():
        raise FileNotFoundError(f"model not found: {p}")
    if is_checkpoint(p):
        return "checkpoint"
    if (p / "config.json").is_file():
        return "hf"
    raise FileNotFoundError(
        f"{p} is neither a meshserve checkpoint nor a Hugging Face model directory (no config.json)"
    )


def read_model_config(path: str | Path) -> LlamaConfig:
    """The config of a GGUF file, converted checkpoint or Hugging Face directory (reads no weights)."""
    kind = model_format(path)
    if kind == "gguf":
        return LlamaConfig.from_gguf(path)
    if kind == "checkpoint":
        from model.checkpoint import read_checkpoint_config

        return read_checkpoint_config(path)[0]
    from model.hf_weights import config_from_hf, read_hf_config

    return config_from_hf(read_hf_config(path))


def load_hf_model(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """Read config and weights of a Hugging Face Llama directory into (config, graphdef, host state).

    The state's leaves are host numpy arrays of ``dtype`` (None: as stored, e.g. bfloat16); the
    engine casts them to its own dtype when it places them.

    Raises:
        HFConfigError, WeightError: see ``model.hf_weights``.
    """
    from model.hf_weights import load_hf_llama

    cfg, params = load_hf_llama(path, dtype)
    graphdef, state = abstract_llama(cfg, jnp.float32 if dtype is None else dtype)
    nnx.replace_by_pure_dict(state, params)
    return cfg, graphdef, state


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
