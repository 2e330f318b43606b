"""Layouts: named mesh shapes and sharding choices, loaded from ``configs/layouts/*.yaml``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

LAYOUT_DIR = Path(__file__).resolve().parent.parent / "configs" / "layouts"
ATTENTION_MODES = ("auto", "heads", "replicated")


class LayoutError(ValueError):
    """A layout is malformed, unknown, or cannot be built on the devices present."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """A device mesh shape plus how attention is split over it.

    Attributes:
        name: preset name (the file stem in ``configs/layouts``).
        description: one line for ``meshserve layouts``.
        data: size of the ``data`` mesh axis (the engine's rows and the KV pool's pages are split
            over it: one replica each).
        model: size of the ``model`` mesh axis (tensor parallelism, Megatron-style:
            Shoeybi et al. 2019, §3).
        attention: ``"heads"`` splits Q/K/V/O and the KV cache over attention heads on
            ``model`` (needs ``model`` to divide both head counts); ``"replicated"`` keeps
            attention weights and the KV cache whole on every ``model`` device (only the MLP and
            the vocabulary are split); ``"auto"`` picks ``heads`` when the head counts allow it,
            else ``replicated`` (see ``sharding/plan.py``).
    """

    name: str
    description: str = ""
    data: int = 1
    model: int = 1
    attention: str = "auto"

    def __post_init__(self) -> None:
        if self.data < 1 or self.model < 1:
            raise LayoutError(f"layout {self.name!r}: data and model must be >= 1, got {self.data}x{self.model}")
        if self.attention not in ATTENTION_MODES:
            raise LayoutError(
                f"layout {self.name!r}: attention must be one of {ATTENTION_MODES}, got {self.attention!r}"
            )

    @property
    def num_devices(self) -> int:
        return self.data * self.model


def load_layout(name_or_path: str) -> Layout:
    """Load a preset by name (``configs/layouts/NAME.yaml``), a YAML file path, or the shorthand
    ``"DxM"`` (data D x model M, attention auto; e.g. ``"1x4"``, ``"2x4"``).

    Raises:
        LayoutError: unknown name (the message lists the presets) or bad fields.
    """
    shorthand = re.fullmatch(r"(\d+)x(\d+)", name_or_path)
    if shorthand:
        data, model = map(int, shorthand.groups())
        return Layout(name=name_or_path, description=f"data {data} x model {model}", data=data, model=model)
    path = Path(name_or_path)
    if not path.suffix:
        path = LAYOUT_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise LayoutError(
            f"unknown layout {name_or_path!r}; presets: {', '.join(preset_names())} (or 'DxM', e.g. '1x4')"
        )
    fields = yaml.safe_load(path.read_text()) or {}
    fields.setdefault("name", path.stem)
    known = {f.name for f in dataclasses.fields(Layout)}
    unknown = set(fields) - known
    if unknown:
        raise LayoutError(f"layout file {path}: unknown fields {sorted(unknown)}")
    return Layout(**fields)


def preset_names() -> list[str]:
    """Names of the layout presets shipped in ``configs/layouts``."""
    return sorted(p.stem for p in LAYOUT_DIR.glob("*.yaml"))
