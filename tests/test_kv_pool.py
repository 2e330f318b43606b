"""The paged pool's size (service/engine/kv_pool.py): asked in tokens or bytes, or from the devices'
memory; and how a ``Runner`` and the serve flags carry it."""

from __future__ import annotations

import argparse

import jax
import pytest
from reference import CFG, GRAPHDEF, PARAMS

from service.engine import kv_pool
from service.engine.config import EngineConfig
from service.engine.runner import Runner
from service.server.arg_types import byte_size
from sharding.layouts import Layout

SIZES = dict(num_slots=4, max_seq_len=100, page_size=16, per_token=1000, num_devices=1)


def test_tokens_asked_for_round_up_to_pages() -> None:
    got = kv_pool.pool_tokens(kv_cache_tokens=70, kv_cache_memory=0, device_free=None, host_available=None, **SIZES)
    assert got == 80


def test_memory_asked_for_holds_whole_pages() -> None:
    got = kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=50_000, device_free=None, host_available=None, **SIZES)
    assert got == 48  # 50 positions of 1,000 bytes, in pages of 16
    with pytest.raises(ValueError, match="holds no page of 16 positions"):
        kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=15_999, device_free=None, host_available=None, **SIZES)


def test_an_accelerator_fills_its_free_memory() -> None:
    got = kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=0, device_free=10**6, host_available=None, **SIZES)
    assert got == 992  # 1,000 positions, whole pages; not slots x max_seq_len (400)
    with pytest.raises(ValueError, match="less than one page"):
        kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=0, device_free=-5, host_available=None, **SIZES)


def test_a_cpu_takes_slots_times_length_within_half_the_host() -> None:
    plenty = kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=0, device_free=None, host_available=10**9, **SIZES)
    assert plenty == 400
    # 8 devices of 1,000 bytes a position in half of 4 MB: 250 positions, 240 in whole pages.
    sizes = {**SIZES, "num_devices": 8}
    tight = kv_pool.pool_tokens(
        kv_cache_tokens=0, kv_cache_memory=0, device_free=None, host_available=4 * 10**6, **sizes
    )
    assert tight == 240


def test_device_memory_is_read_where_devices_report_it() -> None:
    class Accelerator:
        def memory_stats(self) -> dict[str, int]:
            return {"bytes_limit": 1000, "bytes_in_use": 100}

    class Cpu:
        def memory_stats(self) -> None:
            return None

    assert kv_pool.device_free_bytes([Accelerator(), Accelerator()]) == 800  # type: ignore[list-item]
    assert kv_pool.device_free_bytes([Cpu()]) is None  # type: ignore[list-item]
    if jax.devices()[0].platform == "cpu":
        assert kv_pool.device_free_bytes(jax.devices()[:1]) is None
    assert kv_pool.host_available_bytes() is None or kv_pool.host_available_bytes() > 0


def test_a_switch_must_fit_beside_the_runner_serving_now(monkeypatch: pytest.MonkeyPatch) -> None:
    class Accelerator:
        def __init__(self, in_use: int) -> None:
            self.in_use = in_use

        def memory_stats(self) -> dict[str, int]:
            return {"bytes_limit": 10 * 2**30, "bytes_in_use": self.in_use}

    roomy, full = Accelerator(2 * 2**30), Accelerator(9 * 2**30)
    assert kv_pool.switch_problem([roomy, roomy], 8 * 2**30) is None  # type: ignore[list-item]
    problem = kv_pool.switch_problem([roomy, full], 2 * 2**30)  # type: ignore[list-item]
    assert problem is not None
    assert "needs 2.00 GiB per device" in problem and "1.00 GiB free" in problem and "--kv-cache-memory" in problem

    cpu = jax.devices()[:2]
    if cpu[0].platform == "cpu":  # CPU devices share the host's memory: the need of all of them counts
        monkeypatch.setattr(kv_pool, "host_available_bytes", lambda: 3 * 2**30)
        assert kv_pool.switch_problem(cpu, 2**30) is None
        problem = kv_pool.switch_problem(cpu, 2 * 2**30)
        assert problem is not None and "needs 4.00 GiB of host memory (2 CPU device(s)" in problem
        assert "3.00 GiB available" in problem
        monkeypatch.setattr(kv_pool, "host_available_bytes", lambda: None)  # unreadable: not checked
        assert kv_pool.switch_problem(cpu, 2**50) is None


def test_a_runner_sizes_its_pool_from_bytes_and_keeps_the_size_for_a_relayout() -> None:
    per_token = kv_pool.bytes_per_token(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, "float32")
    assert per_token == 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, page_size=4, kv_cache_memory=100 * per_token)
    runner = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), ecfg)
    assert runner.num_pages == 25 and runner.ecfg.kv_cache_tokens == 100 and runner.ecfg.kv_cache_memory == 0
    assert runner.cache.k.shape[1] == 25 and runner.pool_bytes_per_device == 100 * per_token
    assert runner.relayout(Layout("1x1"), jax.devices()[:1]).num_pages == 25


def test_asking_in_tokens_and_bytes_at_once_is_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_tokens=64, kv_cache_memory=10**6)
    with pytest.raises(ValueError, match="kv_cache_memory must be >= 0"):
        EngineConfig(kv_cache_memory=-1)


@pytest.mark.parametrize(
    ("text", "value"), [("4GiB", 4 * 2**30), ("512 MiB", 512 * 2**20), ("1000000", 10**6), ("1.5kb", 1500)]
)
def test_byte_sizes(text: str, value: int) -> None:
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["4TB", "0", "-3", "1.5", "lots"])
def test_bad_byte_sizes(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_data_replicas_each_hold_whole_pages_of_their_share() -> None:
    """Sizes in tokens are the whole pool's, rounded up to a page in each replica's pool; sizes in
    bytes (and free memory) are a device's, which holds only its replica's positions."""
    sizes = {**SIZES, "replicas": 3}
    none = dict(device_free=None, host_available=None)
    assert kv_pool.pool_tokens(kv_cache_tokens=70, kv_cache_memory=0, **none, **sizes) == 96  # 2 pages x 3
    assert kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=50_000, **none, **sizes) == 144  # 48 each
    assert kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=0, **none, **sizes) == 432  # 400 up to 3 x 9 pages
    got = kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=0, device_free=10**6, host_available=None, **sizes)
    assert got == 3 * 992
    # 3 devices (one per replica) of 1,000 bytes a position in half of 600 kB: 100 positions
    # each, 96 in whole pages, 288 in all (less than the 432 of slots x max_seq_len).
    tight = {**sizes, "num_devices": 3}
    host = 6 * 10**5
    assert (
        kv_pool.pool_tokens(kv_cache_tokens=0, kv_cache_memory=0, device_free=None, host_available=host, **tight) == 288
    )


def test_a_runner_with_two_replicas_splits_its_pool_and_a_relayout_keeps_the_tokens() -> None:
    per_token = kv_pool.bytes_per_token(CFG.num_layers, CFG.num_kv_heads, CFG.head_dim, "float32")
    ecfg = EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16, page_size=4, kv_cache_memory=100 * per_token)
    runner = Runner(CFG, GRAPHDEF, PARAMS, Layout("2x1", data=2), ecfg, jax.devices()[:2])
    assert runner.replicas == 2 and runner.num_pages == 50 and runner.pages_per_replica == 25
    assert runner.ecfg.kv_cache_tokens == 200 and runner.pool_bytes_per_device == 100 * per_token
    assert {s.data.shape[1] for s in runner.cache.k.addressable_shards} == {25}
    assert runner.max_request_tokens == 64
    one = runner.relayout(Layout("1x1"), jax.devices()[:1])
    assert one.num_pages == 50 and one.pool_bytes_per_device == 200 * per_token
