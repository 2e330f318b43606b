"""EngineConfig's "auto" layer form (scan on CPU devices, unrolled on accelerators), and an
engine's lifetime."""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest

from model.config import LlamaConfig
from model.kv_cache import BlockedKVCache, KVCache
from model.weights.loader import random_llama
from service.engine import Engine, EngineConfig, resolve_layers
from service.engine.request import SamplingOptions
from sharding.layouts import Layout


@pytest.mark.parametrize(
    ("layers", "platform", "expected"),
    [
        ("auto", "cpu", "scan"),
        ("auto", "gpu", "unrolled"),
        ("auto", "tpu", "unrolled"),
        ("scan", "gpu", "scan"),
        ("unrolled", "cpu", "unrolled"),
    ],
)
def test_resolve_layers(layers: str, platform: str, expected: str) -> None:
    assert resolve_layers(layers, platform) == expected


def test_unknown_layer_form_is_refused() -> None:
    with pytest.raises(ValueError, match="layers must be one of auto, unrolled, scan, got 'loop'"):
        resolve_layers("loop", "cpu")
    with pytest.raises(ValueError, match="got 'loop'"):
        EngineConfig(layers="loop")


@pytest.mark.parametrize(
    ("kv_cache", "layers", "paged"),
    [("auto", "auto", True), ("auto", "scan", True), ("auto", "unrolled", False), ("slots", "auto", False),
     ("paged", "scan", True), ("slots", "unrolled", False)],
)  # fmt: skip
def test_kv_cache_resolves_from_the_layer_form(kv_cache: str, layers: str, paged: bool) -> None:
    assert EngineConfig(kv_cache=kv_cache, layers=layers).paged is paged


def test_a_paged_cache_with_the_unrolled_form_is_refused() -> None:
    """The paged step runs the scan form only: asking for both is an error, not a silent scan."""
    with pytest.raises(ValueError, match="kv_cache='paged' runs the scan form"):
        EngineConfig(kv_cache="paged", layers="unrolled")


def test_engine_resolves_auto_on_its_devices() -> None:
    """The default config ("auto") builds the scanned form on a CPU device (stacked weights, the
    one-array ``KVCache``) and the unrolled one on an accelerator (``BlockedKVCache``); the
    engine's ``ecfg`` says which."""
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=0)
    engine = Engine(cfg, graphdef, params, Layout("1x1"), EngineConfig(num_slots=2, max_seq_len=32, chunk_size=16))
    assert EngineConfig().layers == "auto"
    if jax.devices()[0].platform == "cpu":
        assert engine.ecfg.layers == "scan"
        assert isinstance(engine.cache, KVCache) and engine.cache.k.shape[0] == cfg.num_layers
    else:
        assert engine.ecfg.layers == "unrolled"
        assert isinstance(engine.cache, BlockedKVCache)


@pytest.mark.parametrize("layers", ["scan", "unrolled"])
def test_an_engine_is_freed_when_dropped_without_a_garbage_collection(layers: str) -> None:
    """No reference cycle holds an engine that has compiled and run its steps: its weights and KV
    cache go when the last reference does (after a live layout switch, say). Its jitted steps
    once closed over the engine itself, and a test run's engines piled up to 17 GB."""
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=0)
    ecfg = EngineConfig(num_slots=2, max_seq_len=32, chunk_size=16, layers=layers)
    engine = Engine(cfg, graphdef, params, Layout("1x1"), ecfg)
    engine.set_sampling(0, SamplingOptions(temperature=0.0))
    engine.prefill(0, [1, 2, 3], 0).host()
    engine.decode(np.zeros(2, np.int32), np.array([3, 32], np.int32)).host()
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None
    finally:
        gc.enable()
