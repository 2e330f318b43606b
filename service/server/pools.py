"""Engine pools: one engine loop per disjoint set of devices, each with its own layout.

A server runs one pool by default (named "default", owning every device, so a live switch may
grow it to all of them). ``--pool NAME=LAYOUT[:N]`` (repeatable) instead runs several pools on
consecutive, disjoint device ranges: pool NAME owns N devices (default: as many as LAYOUT
uses) and starts on LAYOUT. The first pool is the default for requests that name none.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax

from service.engine.loop import EngineLoop
from sharding.layouts import Layout, LayoutError, load_layout


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """What ``--pool NAME=LAYOUT[:N]`` asks for."""

    name: str
    layout: Layout
    num_devices: int


def parse_pool(spec: str) -> PoolSpec:
    """Parse ``NAME=LAYOUT[:N]``.

    Raises:
        LayoutError: malformed spec, unknown layout, or N smaller than the layout's device count.
    """
    m = re.fullmatch(r"([A-Za-z0-9_.-]+)=([^:]+)(?::(\d+))?", spec)
    if not m:
        raise LayoutError(f"pool {spec!r}: expected NAME=LAYOUT[:DEVICES], e.g. fast=1x4 or bulk=throughput:4")
    name, layout_name, count = m.groups()
    layout = load_layout(layout_name)
    n = int(count) if count else layout.num_devices
    if n < layout.num_devices:
        raise LayoutError(f"pool {name!r}: layout {layout.name!r} needs {layout.num_devices} devices, pool has {n}")
    return PoolSpec(name=name, layout=layout, num_devices=n)


def assign_devices(specs: list[PoolSpec], devices: list[Any]) -> list[list[Any]]:
    """Consecutive disjoint device ranges, one per pool spec.

    Raises:
        LayoutError: the pools need more devices than are present, or two pools share a name.
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise LayoutError(f"pool names must be unique, got {names}")
    need = sum(s.num_devices for s in specs)
    if need > len(devices):
        raise LayoutError(f"pools {names} need {need} devices, only {len(devices)} are present")
    out, start = [], 0
    for s in specs:
        out.append(devices[start : start + s.num_devices])
        start += s.num_devices
    return out


@dataclasses.dataclass
class Pool:
    """A named engine loop on its own devices."""

    name: str
    devices: list[jax.Device]
    loop: EngineLoop
    is_default: bool = False

    @property
    def layout(self) -> Layout:
        return self.loop.runner.layout

    @property
    def device_ids(self) -> list[int]:
        return [d.id for d in self.devices]
