"""The engine's settings (``EngineConfig``): every field's validation names the field, the
"auto" modes resolve on the runner's devices (``Runner.ecfg``), and a runner's lifetime: one
replaced by a relayout is freed as soon as it is dropped (no reference cycle)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import pytest
from reference import CFG, CHUNK, GRAPHDEF, PARAMS, T

from service.engine.config import (
    ATTENTION_MODES,
    DTYPES,
    LAYER_LOOPS,
    MATMUL_MODES,
    WEIGHT_MODES,
    EngineConfig,
    resolve_kv_dtype,
)
from service.engine.runner import Runner
from sharding.layouts import Layout


def test_the_defaults_are_valid() -> None:
    e = EngineConfig()
    assert (e.attention, e.matmul, e.layer_loop, e.weights, e.kv_dtype, e.dtype) == (
        "auto", "auto", "auto", "auto", "auto", "float32",
    )  # fmt: skip
    assert ATTENTION_MODES == MATMUL_MODES == ("auto", "xla")
    assert LAYER_LOOPS == ("auto", "scan", "unrolled") and DTYPES == ("float32", "bfloat16")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("attention", "native", "attention must be one of auto, xla, got 'native'"),
        ("matmul", "bf16x3", "matmul must be one of auto, xla, got 'bf16x3'"),  # removed with the AMX kernel
        ("matmul", "fast", "matmul must be one of auto, xla, got 'fast'"),
        ("layer_loop", "loop", "layer_loop must be one of auto, scan, unrolled, got 'loop'"),
        ("dtype", "float64", "dtype must be one of float32, bfloat16, got 'float64'"),
        ("kv_dtype", "float16", "kv_dtype must be 'auto' or one of float32, bfloat16, int8, got 'float16'"),
        ("weights", "q8", "weights must be one of auto, stored, int8, float32, bfloat16, got 'q8'"),
        ("page_size", 12, "page_size must be a power of two >= 1, got 12"),
        ("page_size", 0, "page_size must be a power of two >= 1, got 0"),
        ("num_slots", 0, "num_slots must be >= 1, got 0"),
        ("max_seq_len", 1, "max_seq_len must be >= 2, got 1"),
        ("chunk_size", 0, "chunk_size must be >= 1, got 0"),
        ("kv_cache_tokens", -1, "kv_cache_tokens must be >= 0"),
        ("kv_cache_memory", -1, "kv_cache_memory must be >= 0 bytes"),
        ("max_num_batched_tokens", 0, "max_num_batched_tokens must be >= 1, got 0"),
    ],
)
def test_a_bad_field_is_refused_by_name(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig(**{field: value})  # type: ignore[arg-type]
    assert str(e.value).startswith(message), str(e.value)


def test_every_listed_mode_is_accepted() -> None:
    for a in ATTENTION_MODES:
        for m in MATMUL_MODES:
            for loop in LAYER_LOOPS:
                assert dataclasses.astuple(EngineConfig(attention=a, matmul=m, layer_loop=loop))
    for w in WEIGHT_MODES:
        EngineConfig(weights=w)
    for page_size in (1, 2, 16, 128):
        assert EngineConfig(page_size=page_size).page_size == page_size


def test_the_pool_is_given_in_tokens_or_bytes_not_both() -> None:
    with pytest.raises(ValueError, match="give kv_cache_tokens or kv_cache_memory, not both"):
        EngineConfig(kv_cache_tokens=1024, kv_cache_memory=1 << 20)
    e = EngineConfig(num_slots=2, max_seq_len=100, page_size=16, kv_cache_tokens=40)
    assert e.num_pages == 3 and e.max_request_tokens == 48  # 40 tokens: 3 whole pages, less than max_seq_len
    e = EngineConfig(num_slots=2, max_seq_len=100, page_size=16)
    assert e.num_pages == 13 and e.max_request_tokens == 100  # before a runner sizes it: slots x max_seq_len


@pytest.mark.parametrize("name", ["decode_attention", "layers", "kv_cache", "paged"])
def test_the_removed_fields_are_gone(name: str) -> None:
    """The per-slot engine's fields: ``decode_attention`` is now ``attention``, ``layers`` is
    ``layer_loop``, and there is one (paged) cache."""
    with pytest.raises(TypeError, match=name):
        EngineConfig(**{name: "auto"})  # type: ignore[arg-type]


def test_weights_in_a_float_dtype_set_the_dtype() -> None:
    assert EngineConfig(weights="bfloat16").dtype == "bfloat16"
    assert EngineConfig(weights="float32", dtype="bfloat16").dtype == "float32"
    assert EngineConfig(weights="stored", dtype="bfloat16").dtype == "bfloat16"
    assert resolve_kv_dtype("auto", "bfloat16") == "bfloat16" and resolve_kv_dtype("float32", "bfloat16") == "float32"


def tiny_runner(devices: list[jax.Device] | None = None, layout: str = "1x1", **fields: object) -> Runner:
    """A runner of ``reference.py``'s tiny model (``T`` positions, chunks of ``CHUNK``)."""
    ecfg = EngineConfig(
        num_slots=2,
        max_seq_len=T,
        chunk_size=CHUNK,
        page_size=4,
        kv_cache_tokens=2 * T,
        **fields,  # type: ignore[arg-type]
    )
    data, model = (int(n) for n in layout.split("x"))
    return Runner(CFG, GRAPHDEF, PARAMS, Layout(layout, data=data, model=model), ecfg, devices or jax.devices()[:1])


def test_a_runner_resolves_auto_on_its_devices() -> None:
    """On CPU devices "auto" is the scan; the KV cache takes the parameters' dtype; the pool's size
    is kept in tokens; explicit modes are kept."""
    runner = tiny_runner()
    assert runner.ecfg.layer_loop == runner.kernels.layer_loop == "scan"
    assert runner.ecfg.kv_dtype == "float32" and runner.cache.k.dtype == runner.kv_dtype
    assert runner.ecfg.kv_cache_tokens == 2 * T and runner.ecfg.kv_cache_memory == 0
    unrolled = tiny_runner(layer_loop="unrolled", kv_dtype="bfloat16", attention="xla")
    assert unrolled.ecfg.layer_loop == "unrolled" and unrolled.ecfg.attention == "xla"
    # A bfloat16 cache's pages hold its bits (model.attention.pages.storage_dtype).
    assert unrolled.ecfg.kv_dtype == "bfloat16" and unrolled.cache.k.dtype == jax.numpy.uint16


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled"])
def test_a_relayout_runner_and_its_predecessor_are_freed_without_a_garbage_collection(layer_loop: str) -> None:
    """No reference cycle holds a runner that has compiled and run a step: its weights and KV pool
    go when the last reference does, as after a live layout switch (``relayout`` then
    ``adopt_state``). The jitted steps once closed over their engine, and a test run's engines
    piled up to 17 GB."""
    old = tiny_runner(layer_loop=layer_loop)
    old.step(old.idle_batch(old.warm_programs()[0])).host()
    new = old.relayout(Layout("1x2", model=2), jax.devices()[:2])
    new.adopt_state(old)
    new.step(new.idle_batch(new.warm_programs()[0])).host()
    refs = weakref.ref(old), weakref.ref(new)
    gc.collect()
    gc.disable()
    try:
        del old
        assert refs[0]() is None, gc.get_referrers(refs[0]())
        del new
        assert refs[1]() is None
    finally:
        gc.enable()
