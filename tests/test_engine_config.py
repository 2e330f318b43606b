"""EngineConfig's "auto" layer form: scan on CPU devices, unrolled on accelerators."""

from __future__ import annotations

import jax
import pytest

from model.config import LlamaConfig
from model.kv_cache import BlockedKVCache, KVCache
from model.loader import random_llama
from service.engine import Engine, EngineConfig, resolve_layers
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
