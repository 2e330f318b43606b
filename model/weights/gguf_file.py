"""Open a GGUF file and read its metadata as plain Python values.

The GGUF format (ggml-org/ggml ``docs/gguf.md``) stores key/value metadata and
tensors. Parsing is done by the ``gguf`` package (``gguf.GGUFReader``); this
module only turns its fields into ``int``/``float``/``str``/``list`` values and
gives clear errors for missing keys.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import gguf


class GGUFMetadataError(ValueError):
    """A GGUF file lacks a required metadata key or has an unsupported value."""


@cache
def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file (cached per path, so the model and the tokenizer share one reader).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        GGUFMetadataError: the file is not a readable GGUF file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as exc:  # gguf raises ValueError/struct.error on bad magic or truncation
        raise GGUFMetadataError(f"{path} is not a readable GGUF file: {exc}") from exc


def field_value(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """Return the metadata value ``key`` as a Python scalar, string or list.

    Args:
        reader: an open GGUF reader.
        key: a GGUF metadata key, e.g. ``"llama.block_count"``.
        default: returned when the key is absent; if not given, a missing key raises.

    Raises:
        GGUFMetadataError: the key is absent and no default was given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise GGUFMetadataError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def architecture(reader: gguf.GGUFReader) -> str:
    """The ``general.architecture`` string of the file (``"llama"`` for Llama-family models)."""
    return str(field_value(reader, "general.architecture"))
