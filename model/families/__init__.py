"""The model families meshserve serves, one module each over the shared decoder
(``model.llama``), and how a file names them: a GGUF's ``general.architecture``, a Hugging Face
``config.json``'s ``architectures``. Everything else finds a family here."""

from __future__ import annotations

from collections.abc import Sequence

from model.families.family import Family, UnsupportedModelError
from model.families.gemma3 import GEMMA3
from model.families.llama import LLAMA
from model.families.qwen2 import QWEN2
from model.families.qwen3 import QWEN3

__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "for_gguf", "for_hf"]

FAMILIES: dict[str, Family] = {f.name: f for f in (LLAMA, QWEN2, QWEN3, GEMMA3)}


def for_hf(architectures: Sequence[str]) -> Family:
    """The family of a ``config.json`` whose ``architectures`` is ``architectures``.

    Raises:
        UnsupportedModelError: none of them is a served family's (one line, listing those).
    """
    for family in FAMILIES.values():
        if any(a in family.hf_architectures for a in architectures):
            return family
    served = "; ".join(f.describe() for f in FAMILIES.values())
    raise UnsupportedModelError(
        f"config.json: architectures={list(architectures)!r} is not supported; supported: {served}"
    )


def for_gguf(architecture: str) -> Family:
    """The family of a GGUF file whose ``general.architecture`` is ``architecture``.

    Raises:
        UnsupportedModelError: not a family whose GGUF files load (one line, listing those).
    """
    family = FAMILIES.get(architecture)
    if family is not None and family.gguf:
        return family
    served = ", ".join(f.name for f in FAMILIES.values() if f.gguf)
    later = [f.name for f in FAMILIES.values() if not f.gguf]
    tail = f" ({', '.join(later)}: Hugging Face directories only, so far)" if later else ""
    raise UnsupportedModelError(f"unsupported GGUF architecture {architecture!r}; supported: {served}{tail}")
