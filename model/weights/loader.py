"""One way to load a model: ``load_model`` tells a GGUF file, a Hugging Face directory and a
checkpoint written by ``meshserve convert`` apart (``model_format``) and loads any of them.

The format readers are ``model/weights/gguf_weights.py`` (GGUF), ``model/weights/hf_weights.py`` (Hugging Face
``config.json`` + ``*.safetensors``) and ``model/weights/checkpoint.py`` (converted checkpoints); the
model is built from what they return by ``model/weights/build.py``. This module imports the readers, and
none of them imports it.

A GGUF file or Hugging Face directory is read into host memory (numpy) and placed afterwards: by
``load_model`` when given ``shardings``, else by the caller (``service.engine.runner.Runner``
places host weights itself, ``place_params``). A checkpoint is restored by orbax straight into the target shardings, each
device reading only its own shard, so no host copy of the full weights is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util

from model.config import LlamaConfig
from model.text.tokenizer import Tokenizer
from model.weights import block_params
from model.weights.build import abstract_llama, llama_from_params, random_llama
from model.weights.gguf_weights import load_gguf_params

__all__ = [
    "FORMATS",
    "LoadedModel",
    "ShardingsFn",
    "abstract_llama",
    "checkpoint_blocks",
    "held_formats",
    "load_gguf_model",
    "load_hf_model",
    "load_model",
    "load_tokenizer",
    "model_format",
    "num_tensors",
    "random_llama",
    "read_model_config",
    "restores_as_saved",
]

FORMATS = ("gguf", "hf", "checkpoint")
QUANTIZE = (None, "int8")  # load_model's quantize
# (config, abstract state of Llama(config)) -> a tree of jax.sharding.Sharding with the state's
# structure, e.g. ``sharding.rules.param_shardings(state, mesh, plan.rules)``.
ShardingsFn = Callable[[LlamaConfig, nnx.State], Any]


@dataclasses.dataclass
class LoadedModel:
    """What ``load_model`` returns.

    Attributes:
        path: the model file or directory.
        kind: "gguf", "hf" or "checkpoint" (``model_format``).
        cfg: the model's hyperparameters.
        graphdef: ``nnx.split``'s graph definition of ``Llama(cfg)``.
        state: the parameters as an ``nnx.State``: host numpy arrays for a GGUF file or Hugging
            Face directory loaded without ``shardings``, else ``jax.Array`` in the shardings.
        dtype: the parameters' dtype name ("float32", "bfloat16", ...).
        tokenizer: the model's tokenizer, or None when not asked for.
        quantized: the parameters ``load_model(quantize=...)`` quantized ("layers/wqkv", ...);
            empty when it quantized none (blocks already held are not counted).
    """

    path: Path
    kind: str
    cfg: LlamaConfig
    graphdef: nnx.GraphDef
    state: nnx.State
    dtype: str
    tokenizer: Tokenizer | None = None
    quantized: tuple[str, ...] = ()


GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes


def model_format(path: str | Path) -> str:
    """Which reader ``path`` needs: "gguf" (a file), "checkpoint" (a directory written by
    ``meshserve convert``) or "hf" (a Hugging Face model directory with ``config.json``).

    Reads only a file's first bytes (the GGUF magic) and a directory's listing; orbax is imported
    only for a directory.

    Raises:
        FileNotFoundError: the path does not exist, or is a directory without ``config.json``.
        ValueError: a file that does not start with the GGUF magic bytes.
    """
    p = Path(path)
    if p.is_file():
        with p.open("rb") as f:
            if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
                raise ValueError(f"{p} is not a GGUF file (it does not start with the bytes {GGUF_MAGIC!r})")
        return "gguf"
    if not p.is_dir():
        raise FileNotFoundError(f"model not found: {p}")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"{p} is a directory without config.json: neither a meshserve checkpoint nor a Hugging Face "
            "model directory (no config.json)"
        )
    from model.weights.checkpoint import is_checkpoint  # imports orbax

    return "checkpoint" if is_checkpoint(p) else "hf"


def read_model_config(path: str | Path) -> LlamaConfig:
    """The config of a GGUF file, converted checkpoint or Hugging Face directory (reads no weights).

    Raises:
        FileNotFoundError: see ``model_format``. GGUFMetadataError, CheckpointError,
            HFConfigError (all ValueError): the config is unreadable or not a supported Llama.
    """
    kind = model_format(path)
    if kind == "gguf":
        return LlamaConfig.from_gguf(path)
    if kind == "checkpoint":
        from model.weights.checkpoint import read_checkpoint_config

        return read_checkpoint_config(path)[0]
    from model.weights.hf_weights import config_from_hf, read_hf_config

    return config_from_hf(read_hf_config(path))


def num_tensors(path: str | Path, cfg: LlamaConfig | None = None) -> int:
    """How many times ``load_model(path, progress=...)`` calls ``progress`` (tensors read from a
    GGUF file or Hugging Face directory; 0 for a checkpoint, restored in one piece). ``cfg``: the
    model's config if already read."""
    kind = model_format(path)
    if kind == "checkpoint":
        return 0
    cfg = cfg or read_model_config(path)
    if kind == "gguf":
        from model.weights.gguf_weights import num_tensors as gguf_count

        return gguf_count(cfg)
    from model.weights.hf_weights import num_tensors as hf_count

    return hf_count(cfg)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a GGUF file, Hugging Face directory (``tokenizer.json``) or checkpoint.

    Raises:
        FileNotFoundError: see ``model_format``. ValueError (CheckpointError for a checkpoint):
            the tokenizer files are missing or malformed.
    """
    kind = model_format(path)
    if kind == "gguf":
        return Tokenizer.from_gguf(path)
    if kind == "hf":
        return Tokenizer.from_hf_dir(path)
    from model.weights.checkpoint import checkpoint_tokenizer

    return checkpoint_tokenizer(path)


def load_model(
    path: str | Path,
    dtype: Any = None,
    shardings: ShardingsFn | None = None,
    tokenizer: bool = False,
    progress: Callable[[str], None] | None = None,
    stored: bool = False,
    quantize: str | None = None,
) -> LoadedModel:
    """Load a GGUF file, Hugging Face Llama directory or converted checkpoint (told apart by
    ``model_format``): its config, parameters and, when asked, its tokenizer.

    Args:
        path: the model file or directory.
        dtype: the parameters' dtype (a name such as "bfloat16", or a numpy/JAX dtype); None
            keeps the stored one (a GGUF's tensors are dequantized to float32; a Hugging Face
            directory's first weight's dtype; a checkpoint's ``config.json`` ``dtype``).
        shardings: a function of (config, abstract state) returning the target shardings (a tree
            with the state's structure, e.g. of ``sharding.rules.param_shardings``). A checkpoint
            is restored straight into them; GGUF/HF weights are read on the host, then placed with
            ``jax.device_put``. None: GGUF/HF weights stay host numpy arrays, and a checkpoint is
            restored onto the first device (``jax.devices()[0]``).
        tokenizer: also load the tokenizer (``LoadedModel.tokenizer``; else None).
        progress: called with each tensor's name after it is read (GGUF/HF only: a progress bar's
            hook; ``num_tensors`` tells how many calls to expect).
        stored: a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K and Q6_K matmul weights stay in their blocks
            (``model.weights.gguf_weights.load_gguf_params(stored=True)``: ``QuantPanels`` values), and
            so do a checkpoint's blocks (``model.weights.checkpoint``; without ``stored`` they are
            dequantized after the restore, on the host); ``dtype`` then applies to the rest.
            Ignored for a Hugging Face directory.
        quantize: None, or "int8": the float matmul weights quantized to Q8_0 blocks
            (``model.weights.block_params.quantize_params``) on the host after reading; blocks already
            held stay as they are (it implies ``stored``).

    Returns:
        A ``LoadedModel``; put ``graphdef`` and ``state`` together with ``nnx.merge``.

    Raises:
        FileNotFoundError: the path does not exist or holds no model.
        GGUFMetadataError, WeightError: an unreadable or unsupported GGUF (``model.weights.gguf_weights``).
        HFConfigError, WeightError: an unreadable or unsupported Hugging Face directory.
        CheckpointError: an incomplete, corrupt or unsupported checkpoint, or ``shardings`` that
            do not match it. All of these are ValueError.
        ValueError: ``quantize`` is not None or "int8".
    """
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    stored = stored or quantize is not None
    quantized: tuple[str, ...] = ()
    p = Path(path)
    kind = model_format(p)
    if restores_as_saved(p, stored, quantize):
        cfg, graphdef, state, name = _restore(p, dtype, shardings)
    else:
        if kind == "checkpoint":  # restored on one device, then changed on the host
            cfg, params, name = _restore_to_host(p, dtype, stored)
        elif kind == "gguf":
            cfg, params, name = _read_gguf(p, dtype, progress, stored)
        else:
            cfg, params, name = _read_hf(p, dtype, progress)
        if quantize == "int8":
            held = block_params.block_formats(params)
            params = block_params.quantize_params(params)
            quantized = tuple(sorted(set(block_params.block_formats(params)) - set(held)))
        graphdef, state = llama_from_params(cfg, params, name)
        if shardings is not None:
            state = jax.device_put(state, shardings(cfg, state))
    return LoadedModel(
        path=p,
        kind=kind,
        cfg=cfg,
        graphdef=graphdef,
        state=state,
        dtype=name,
        tokenizer=load_tokenizer(p) if tokenizer else None,
        quantized=quantized,
    )


def _read_gguf(
    p: Path, dtype: Any, progress: Callable[[str], None] | None, stored: bool = False
) -> tuple[LlamaConfig, dict[str, Any], str]:
    cfg = LlamaConfig.from_gguf(p)
    name = jnp.dtype(dtype if dtype is not None else jnp.float32).name
    return cfg, load_gguf_params(p, cfg, np.dtype(name), progress, stored=stored), name


def _read_hf(p: Path, dtype: Any, progress: Callable[[str], None] | None) -> tuple[LlamaConfig, dict[str, Any], str]:
    from model.weights.hf_weights import load_hf_llama

    cfg, params = load_hf_llama(p, None if dtype is None else np.dtype(jnp.dtype(dtype)), progress)
    return cfg, params, np.dtype(params["embed"].dtype).name


def restores_as_saved(path: str | Path, stored: bool, quantize: str | None) -> bool:
    """Whether ``load_model(path, stored=stored, quantize=quantize)`` restores a checkpoint as
    saved, straight into the target shardings (no host copy): a checkpoint, nothing to quantize,
    and its blocks (if any) kept. False for the other formats, read on the host."""
    if model_format(path) != "checkpoint" or quantize is not None:
        return False
    return stored or not checkpoint_blocks(path)


def checkpoint_blocks(p: str | Path) -> dict[str, str]:
    """A checkpoint's parameters held as blocks ("layers/wqkv" -> "q4_1"; empty for a float one)."""
    from model.weights.checkpoint import read_checkpoint_config  # imports orbax

    return read_checkpoint_config(p)[1].get("blocks", {})


def held_formats(path: str | Path, stored: bool, quantize: str | None = None) -> dict[str, str]:
    """The parameters ``load_model(path, stored=stored, quantize=quantize)`` holds as blocks, by
    name -> format ({"wqkv": "q4_1", "embed": "q8_0", ...}, the names of
    ``service.server.stored_formats``), told from the file's tensor types or the checkpoint's
    ``config.json`` alone (reads no weights).

    With ``stored``: a GGUF's matmul weights ``model.weights.gguf_weights.stored_matmuls`` keeps, or a
    checkpoint's blocks; a Hugging Face directory holds none. With ``quantize`` "int8" (which
    implies ``stored``): also every other matmul weight whose widths are whole 32-blocks, as
    Q8_0 (``block_params.quantize_params``).

    Raises:
        FileNotFoundError, ValueError: see ``model_format`` and ``read_model_config``.
    """
    if quantize not in QUANTIZE:
        raise ValueError(f"quantize must be one of {QUANTIZE}, got {quantize!r}")
    kind = model_format(path)
    cfg = read_model_config(path)
    held: dict[str, str] = {}
    if stored or quantize is not None:
        if kind == "gguf":
            from model.weights.gguf_weights import stored_matmuls

            held = stored_matmuls(path, cfg)
        elif kind == "checkpoint":
            held = {name.rsplit("/", 1)[-1]: fmt for name, fmt in checkpoint_blocks(path).items()}
    if quantize == "int8":
        _, state = abstract_llama(cfg)
        for name, leaf in traverse_util.flatten_dict(nnx.to_pure_dict(state), sep="/").items():
            key = name.rsplit("/", 1)[-1]
            if key not in held and _blockable(name, tuple(leaf.shape)):
                held[key] = "q8_0"
    return held


def _blockable(path: str, shape: tuple[int, ...]) -> bool:
    """Whether ``block_params.quantize_params`` makes parameter ``path`` of float ``shape`` Q8_0
    blocks: a matmul weight whose inputs and outputs are whole 32-blocks."""
    try:
        block_params.abstract_panels(path, shape, "q8_0")
    except ValueError:
        return False
    return True


def _restore_to_host(p: Path, dtype: Any, stored: bool) -> tuple[LlamaConfig, dict[str, Any], str]:
    """A checkpoint's params as host numpy, its blocks kept (``stored``) or dequantized."""
    from model.weights.checkpoint import expected_shapes

    cfg, _, state, name = _restore(p, dtype, None)
    params = jax.device_get(nnx.to_pure_dict(state))
    if not stored:
        params = block_params.dequantize_params(params, expected_shapes(cfg), np.dtype(name))
    return cfg, params, name


def _restore(p: Path, dtype: Any, shardings: ShardingsFn | None) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State, str]:
    from model.weights.checkpoint import abstract_params, read_checkpoint_config, restore_checkpoint  # imports orbax

    cfg, meta = read_checkpoint_config(p)
    name = jnp.dtype(dtype if dtype is not None else meta.get("dtype", "float32")).name
    graphdef, state = abstract_llama(cfg, name)
    if meta.get("blocks"):
        nnx.replace_by_pure_dict(state, abstract_params(cfg, meta["blocks"], name))
    if shardings is not None:
        target = shardings(cfg, state)
    else:
        one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda _: one, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, restore_checkpoint(p, target, name))
    return cfg, graphdef, state, name


def load_hf_model(path: str | Path, dtype: Any = None) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """A Hugging Face Llama directory as (config, graphdef, host state), as ``load_model`` reads it.

    The state's leaves are host numpy arrays of ``dtype`` (None: as stored, e.g. bfloat16); the
    engine casts them to its own dtype when it places them.

    Raises:
        HFConfigError, WeightError: see ``model.weights.hf_weights``.
    """
    cfg, params, name = _read_hf(Path(path), dtype, None)
    return (cfg, *llama_from_params(cfg, params, name))


def load_gguf_model(path: str | Path, dtype: Any = jnp.float32) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """A Llama GGUF as (config, graphdef, host state), as ``load_model`` reads it.

    The state's leaves are host numpy arrays of ``dtype``; place them with
    ``jax.device_put(state, sharding.rules.param_shardings(...))``.

    Raises:
        FileNotFoundError, GGUFMetadataError, WeightError: see ``model.weights.gguf_weights``.
    """
    cfg, params, name = _read_gguf(Path(path), dtype, None)
    return (cfg, *llama_from_params(cfg, params, name))
