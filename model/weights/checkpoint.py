"""Converted checkpoints: convert a model once, then restore its weights straight into any layout.

A checkpoint is a directory::

    config.json                 {"format": "meshserve-checkpoint", "format_version": 1 or 2,
                                 "architecture": "llama", "dtype": ..., "source": ...,
                                 "blocks": {"layers/wqkv": "q4_1", ...} (version 2 only),
                                 ...every LlamaConfig field...}
    params/                     an orbax StandardCheckpointer save of the param tree (a pure dict
                                of arrays, as model/weights/gguf_weights.py returns it), one zarr array
                                directory per parameter, chunked so a device reads its shard only
    tokenizer.json              the tokenizers backend
    meshserve_tokenizer.json    special/BOS/EOS ids, chat template (Tokenizer.save)

A matmul weight held as 32-weight blocks (``model.weights.quant_panels.QuantPanels``: a GGUF's Q8_0,
Q4_0 or Q4_1 tensors as stored, or int8 from ``model.weights.block_params.quantize_params``) is saved
as its arrays, ``<path>/codes``, ``<path>/scales`` and, for Q4_1, ``<path>/mins``, never
dequantized; ``config.json``'s ``blocks`` names each such parameter's format (its shapes follow
from the config: ``model.weights.block_params.abstract_panels``). Such a checkpoint has format version
2; one without blocks is written as version 1, which earlier versions of meshserve read.

``save_checkpoint`` writes it into a temporary sibling directory and renames it into place last,
so an interrupted conversion never leaves a directory that looks complete.
``restore_checkpoint`` restores onto abstract targets (``jax.ShapeDtypeStruct`` with a
``NamedSharding``): every device reads only its own shard from disk, so no process builds the
full weights on one device first, and the stored dtype is cast to the requested one on the way.

Before reading any data it checks what can be checked cheaply and fails with a
``CheckpointError`` naming the problem: a missing file, an array missing from (or unexpected in)
the saved tree, a shape that does not fit ``config.json``, a missing array directory or chunk
file, an unsupported architecture or format version. A chunk that is present but damaged is
reported when the read fails.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from model.config import LlamaConfig, RopeScaling
from model.families import FAMILIES
from model.text.tokenizer import TOKENIZER_META_FILE, Tokenizer
from model.weights import block_params, quant_panels
from model.weights.build import abstract_llama
from model.weights.quant_panels import QuantPanels

FORMAT = "meshserve-checkpoint"
FORMAT_VERSION = 2  # the newest written and read; 1: no blocks
READ_VERSIONS = (1, 2)
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
# Largest stored chunk: big matrices are split so a device restoring a shard of one decodes
# only the chunks it needs, not the whole array.
CHUNK_BYTES = 32 * 1024 * 1024
_META_KEYS = ("format", "format_version", "architecture", "dtype", "source", "blocks")
BLOCK_ARRAYS = ("codes", "scales", "mins")  # a QuantPanels' arrays as saved (mins: Q4_1 only)


class CheckpointError(ValueError):
    """A checkpoint directory is incomplete, corrupt, or not one this version can restore."""


# ---- config.json ------------------------------------------------------------------------------
def config_to_dict(cfg: LlamaConfig) -> dict[str, Any]:
    """``cfg`` as JSON-ready fields (``rope_scaling`` as an object or null)."""
    return dataclasses.asdict(cfg)


def config_from_dict(fields: dict[str, Any], where: str = CONFIG_FILE) -> LlamaConfig:
    """The inverse of :func:`config_to_dict`.

    Raises:
        CheckpointError: a field is missing, unknown or of the wrong type (named).
    """
    known = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointError(f"{where}: unknown field(s) {unknown}; known: {sorted(known)}")
    values = dict(fields)
    scaling = values.get("rope_scaling")
    try:
        if scaling is not None:
            values["rope_scaling"] = RopeScaling(**scaling)
        return LlamaConfig(**values)
    except TypeError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from exc


def is_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory whose ``config.json`` declares this checkpoint format."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        return False
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def read_checkpoint_config(path: str | Path) -> tuple[LlamaConfig, dict[str, Any]]:
    """The model config and the format fields (``dtype``, ``source``, ...) of a checkpoint.

    Raises:
        CheckpointError: ``config.json`` is missing or malformed, is not this format, has a newer
            format version, or names an architecture that is not a family of ``model.families``.
    """
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: not a meshserve checkpoint, or an incomplete one")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{file}: 'format' is not {FORMAT!r}; not a meshserve checkpoint")
    version = data.get("format_version")
    if version not in READ_VERSIONS:
        raise CheckpointError(
            f"{file}: format_version {version!r} is not supported (this meshserve reads "
            f"{', '.join(map(str, READ_VERSIONS))})"
        )
    blocks = data.get("blocks", {})
    formats = ", ".join(quant_panels.FORMATS)
    if not isinstance(blocks, dict):
        raise CheckpointError(f"{file}: 'blocks' must map parameters to one of {formats}, got {blocks!r}")
    for name, fmt in blocks.items():
        if fmt not in quant_panels.FORMATS:
            raise CheckpointError(f"{file}: 'blocks' gives {name!r} the format {fmt!r}; known: {formats}")
    if blocks and version == 1:
        raise CheckpointError(f"{file}: format_version 1 holds no blocks, but 'blocks' names {sorted(blocks)}")
    arch = data.get("architecture")
    if arch not in FAMILIES:
        raise CheckpointError(f"{file}: architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}")
    meta = {k: data[k] for k in _META_KEYS if k in data}
    fields = {k: v for k, v in data.items() if k not in _META_KEYS} | {"architecture": arch}
    return config_from_dict(fields, str(file)), meta


# ---- saving -----------------------------------------------------------------------------------
def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"layers/wq": leaf, ...} of a nested dict; a ``QuantPanels`` is its arrays,
    {"layers/wqkv/codes": ..., "layers/wqkv/scales": ..., ...}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, QuantPanels):
            value = _block_arrays(value)
        if isinstance(value, dict):
            out |= _flat(value, name + "/")
        else:
            out[name] = value
    return out


def _block_arrays(w: QuantPanels) -> dict[str, Any]:
    return {k: getattr(w, k) for k in BLOCK_ARRAYS if getattr(w, k) is not None}


def expected_shapes(cfg: LlamaConfig, blocks: dict[str, str] | None = None) -> dict[str, tuple[int, ...]]:
    """Every array of ``Llama(cfg)``'s params by path ("layers/wqkv") and its shape; a
    parameter named in ``blocks`` (path -> block format) is its block arrays
    ("layers/wqkv/codes", ...).

    Raises:
        CheckpointError: ``blocks`` names a parameter that cannot be held as blocks.
    """
    return {name: shape for name, (shape, _) in _expected(cfg, blocks).items()}


def _expected(cfg: LlamaConfig, blocks: dict[str, str] | None) -> dict[str, tuple[tuple[int, ...], np.dtype | None]]:
    """``expected_shapes`` with each array's dtype: a block array's own (int8 or uint8 codes,
    float16 scales and mins), None for a float parameter (any float dtype)."""
    _, state = abstract_llama(cfg)
    floats = {name: tuple(leaf.shape) for name, leaf in _flat(nnx.to_pure_dict(state)).items()}
    out: dict[str, tuple[tuple[int, ...], np.dtype | None]] = {}
    for name, shape in floats.items():
        if blocks and name in blocks:
            try:
                panels = block_params.abstract_panels(name, shape, blocks[name])
            except ValueError as exc:
                raise CheckpointError(f"'blocks': {exc}") from None
            out |= {f"{name}/{k}": (tuple(a.shape), np.dtype(a.dtype)) for k, a in _block_arrays(panels).items()}
        else:
            out[name] = (shape, None)
    unknown = sorted(set(blocks or ()) - set(floats))
    if unknown:
        raise CheckpointError(f"'blocks' names parameter(s) {unknown} the model does not have")
    return out


def _check_tree(cfg: LlamaConfig, flat: dict[str, Any], what: str, blocks: dict[str, str] | None = None) -> None:
    typed = _expected(cfg, blocks)
    expected = {name: shape for name, (shape, _) in typed.items()}
    missing = sorted(set(expected) - set(flat))
    if missing:
        undeclared = sorted({n.rsplit("/", 1)[0] for n in flat if n.rsplit("/", 1)[0] in missing})
        if undeclared:
            raise CheckpointError(
                f"{what}: holds {undeclared} as blocks (codes, scales) that config.json's 'blocks' does not declare"
            )
        raise CheckpointError(f"{what}: array(s) {missing} are missing")
    unexpected = sorted(set(flat) - set(expected))
    if unexpected:
        raise CheckpointError(f"{what}: unexpected array(s) {unexpected}")
    for name, (shape, dtype) in typed.items():
        if tuple(flat[name].shape) != shape:
            raise CheckpointError(f"{what}: array {name!r} has shape {tuple(flat[name].shape)}, expected {shape}")
        got = np.dtype(flat[name].dtype)
        if (dtype is not None and got != dtype) or (dtype is None and not jnp.issubdtype(got, jnp.floating)):
            raise CheckpointError(f"{what}: array {name!r} has dtype {got}, expected {dtype or 'a float dtype'}")


def _tokenizer(source: Tokenizer | str | Path) -> Tokenizer:
    if isinstance(source, Tokenizer):
        return source
    path = Path(source)
    if path.is_dir():
        return Tokenizer.from_checkpoint(path) if is_checkpoint(path) else Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(path)


def save_checkpoint(
    out_dir: str | Path,
    cfg: LlamaConfig,
    params: dict[str, Any],
    tokenizer_source: Tokenizer | str | Path,
    dtype: str = "float32",
    source: str | None = None,
) -> Path:
    """Write a checkpoint of ``params`` (stored as ``dtype``) with its config and tokenizer.

    Args:
        out_dir: the checkpoint directory to create; must not exist, or be empty.
        cfg: the model config.
        params: the pure dict of parameter arrays (numpy or jax), laid out as ``model.llama``'s state.
        tokenizer_source: a :class:`Tokenizer`, or the GGUF file / Hugging Face directory /
            checkpoint to build it from.
        dtype: storage dtype of the float arrays, "float32" or "bfloat16"; weights held as
            blocks (``QuantPanels``) are saved as they are.
        source: where the weights came from, recorded in ``config.json``.

    Returns:
        ``out_dir`` as a Path.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty.
        CheckpointError: ``params`` does not match ``cfg`` (a missing, unexpected or misshapen array).
    """
    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty directory")
    np_dtype = np.dtype(jnp.dtype(dtype))
    blocks = block_params.block_formats(params)
    flat = _flat(params)
    _check_tree(cfg, flat, "params", blocks)
    tree = _unflat(
        {
            name: np.asarray(a) if name.rsplit("/", 1)[0] in blocks else np.asarray(a).astype(np_dtype, copy=False)
            for name, a in flat.items()
        }
    )
    tokenizer = _tokenizer(tokenizer_source)

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), tree)
        with ocp.StandardCheckpointer(use_ocdbt=False) as ckptr:
            ckptr.save(tmp / PARAMS_DIR, tree, save_args=save_args)
            ckptr.wait_until_finished()
        tokenizer.save(tmp)
        config = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION if blocks else 1,
            "dtype": np_dtype.name,
            "source": source,
            **({"blocks": blocks} if blocks else {}),
            **config_to_dict(cfg),
        }
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---- restoring --------------------------------------------------------------------------------
def _check_files(root: Path, cfg: LlamaConfig, blocks: dict[str, str]) -> dict[str, Any]:
    """Check the files a restore needs; returns the saved tree's metadata by path ("layers/wq").

    Raises:
        CheckpointError: naming the missing file, array or chunk, or the misshapen array.
    """
    for name in ("tokenizer.json", TOKENIZER_META_FILE):
        if not (root / name).is_file():
            raise CheckpointError(f"checkpoint {root} is incomplete: {name} is missing")
    params = root / PARAMS_DIR
    if not (params / "_METADATA").is_file():
        raise CheckpointError(f"checkpoint {root} is incomplete: {PARAMS_DIR}/_METADATA is missing")
    if not (params / "manifest.ocdbt").exists():
        # One zarr directory per array, named by orbax as the tree path joined with ".". (An
        # OCDBT checkpoint, which save_checkpoint does not write, keeps them in one database;
        # damage there shows when reading.)
        for name in expected_shapes(cfg, blocks):
            _check_array_files(root, name, name.replace("/", "."))
    try:
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.metadata(params).item_metadata.tree
    except Exception as exc:
        raise CheckpointError(f"checkpoint {root} is corrupt: cannot read its array metadata: {exc}") from exc
    flat = _flat(dict(tree))
    _check_tree(cfg, flat, f"checkpoint {root}", blocks)
    return flat


def _check_array_files(root: Path, name: str, stored: str) -> None:
    """The zarr directory ``params/<stored>`` of array ``name`` has its ``.zarray`` and every chunk file."""
    array_dir = root / PARAMS_DIR / stored
    zarray = array_dir / ".zarray"
    if not zarray.is_file() and (array_dir.parent / f"{stored}.codes" / ".zarray").is_file():
        raise CheckpointError(
            f"checkpoint {root}: holds {name!r} as blocks ({PARAMS_DIR}/{stored}.codes, ...) that config.json's "
            "'blocks' does not declare"
        )
    if not zarray.is_file():
        raise CheckpointError(f"checkpoint {root} is truncated: array {name!r} ({PARAMS_DIR}/{stored}) is missing")
    try:
        spec = json.loads(zarray.read_text())
        grid = [math.ceil(n / c) for n, c in zip(spec["shape"], spec["chunks"], strict=True)]
        sep = spec.get("dimension_separator", ".")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {root} is corrupt: {PARAMS_DIR}/{stored}/.zarray: {exc!r}") from exc
    for index in np.ndindex(*grid):
        chunk = sep.join(map(str, index)) if index else "0"
        if not (array_dir / chunk).is_file():
            raise CheckpointError(
                f"checkpoint {root} is truncated: array {name!r} lacks chunk file {PARAMS_DIR}/{stored}/{chunk}"
            )


def restore_checkpoint(path: str | Path, shardings: Any, dtype: Any = None) -> dict[str, Any]:
    """Restore a checkpoint's params directly into ``shardings``.

    Args:
        path: the checkpoint directory.
        shardings: a tree of ``jax.sharding.NamedSharding`` with the param tree's structure: a
            pure dict, or the ``nnx.State`` that ``sharding.rules.param_shardings`` returns; a
            parameter held as blocks has a ``QuantPanels`` of shardings (of ``abstract_params``).
        dtype: the dtype to restore the float arrays as (cast while reading); None keeps the
            stored dtype. Block arrays keep theirs.

    Returns:
        The pure param dict of ``jax.Array`` laid out with ``shardings`` (``QuantPanels`` for
        the parameters held as blocks); put it into a model state with
        ``nnx.replace_by_pure_dict``.

    Raises:
        CheckpointError: the checkpoint is incomplete, corrupt, of another architecture or format
            version, or does not match ``shardings``' structure.
    """
    root = Path(path)
    cfg, meta = read_checkpoint_config(root)
    blocks = meta.get("blocks", {})
    if isinstance(shardings, nnx.State):
        shardings = nnx.to_pure_dict(shardings)
    stored = _check_files(root, cfg, blocks)
    flat_sh = _flat(shardings)
    if set(flat_sh) != set(stored):
        raise CheckpointError(
            f"checkpoint {root}: the target shardings' arrays {sorted(flat_sh)} differ from the stored {sorted(stored)}"
        )

    def target(name: str) -> jax.ShapeDtypeStruct:
        m = stored[name]
        cast = dtype if name.rsplit("/", 1)[0] not in blocks else None
        return jax.ShapeDtypeStruct(tuple(m.shape), jnp.dtype(cast or m.dtype), sharding=flat_sh[name])

    abstract = _unflat({name: target(name) for name in flat_sh})
    try:
        with ocp.StandardCheckpointer() as ckptr:
            restored = ckptr.restore(root / PARAMS_DIR, abstract)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {root} is truncated or corrupt: reading its arrays failed: {exc}") from exc
    return _with_blocks(restored, abstract_params(cfg, blocks))


def abstract_params(cfg: LlamaConfig, blocks: dict[str, str], dtype: Any = jnp.float32) -> dict[str, Any]:
    """The pure param dict of ``Llama(cfg)`` as ``jax.ShapeDtypeStruct``, the parameters named in
    ``blocks`` (path -> format) as ``QuantPanels`` of them (``block_params.abstract_panels``)."""
    _, state = abstract_llama(cfg, dtype)

    def one(path: str, leaf: Any) -> Any:
        if path in blocks:
            return block_params.abstract_panels(path, tuple(leaf.shape), blocks[path])
        return jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)

    return block_params.walk_params(nnx.to_pure_dict(state), one)


def _with_blocks(restored: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """``restored`` (block arrays as dicts) with a ``QuantPanels`` wherever ``like`` has one."""
    out: dict[str, Any] = {}
    for key, value in like.items():
        if isinstance(value, QuantPanels):
            got = restored[key]
            out[key] = dataclasses.replace(value, codes=got["codes"], scales=got.get("scales"), mins=got.get("mins"))
        elif isinstance(value, dict):
            out[key] = _with_blocks(restored[key], value)
        else:
            out[key] = restored[key]
    return out


def _unflat(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def checkpoint_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer saved beside a checkpoint's params.

    Raises:
        CheckpointError: its files are missing or malformed.
    """
    try:
        return Tokenizer.from_checkpoint(path)
    except (FileNotFoundError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: {exc}") from exc
