"""The Admin service on a paged pool (tiny model): the layout predictions count the pool as
served; a switch to a layout whose data replicas would each hold less than a request may now,
or that would not fit in memory beside the engine serving now, is refused before anything is
built; a build that fails leaves the pool serving on its layout."""

from __future__ import annotations

from pathlib import Path

import grpc
import jax
import pytest
from helpers import free_port

from model.native import cpu_matmul
from model.weights.packed_weights import packed_head_bytes
from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import admin_pb2_grpc as apb_grpc
from service.engine import kv_pool
from service.engine.config import EngineConfig
from service.server.app import ServerThread
from service.server.client import Client, make_request
from service.server.config import ServerConfig
from sharding.layouts import Layout

NATIVE = jax.devices()[0].platform == "cpu"
TOKEN = "pool-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def small_pool(tiny_gguf: Path):  # type: ignore[no-untyped-def]
    """One pool on 1x2, 128 positions in all, so requests of up to 128 tokens (not --max-seq-len's 256)."""
    cfg = ServerConfig(
        model=str(tiny_gguf), port=0, pools=["p=1x2"], admin_token=TOKEN, admin_port=0, metrics_port=free_port(),
        engine=EngineConfig(num_slots=2, max_seq_len=256, chunk_size=32, kv_cache_tokens=128),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.running.admin_port}")
    yield srv, apb_grpc.AdminStub(channel)
    channel.close()
    srv.stop()


def test_model_info_reports_the_limit_requests_are_held_to(small_pool) -> None:  # type: ignore[no-untyped-def]
    """A pool smaller than --max-seq-len lowers the limit: GetModelInfo says so, as /v1/models
    does (it said 256 while a 200-token prompt was refused against 128)."""
    srv, _ = small_pool
    client = Client(srv.address)
    info = client.model_info()
    assert srv.running.gateway.cfg.engine.max_seq_len == 256
    assert info.max_seq_len == srv.running.gateway.max_request_tokens == 128
    assert info.kv_cache_tokens == 128
    client.close()


def test_layout_info_predicts_the_pool_each_device_holds(small_pool) -> None:  # type: ignore[no-untyped-def]
    srv, admin = small_pool
    engine = srv.running.gateway.pools[0].loop.runner
    info = admin.GetLayout(apb.GetLayoutRequest(pool="p"), metadata=AUTH)
    assert info.kv_cache_bytes_per_device == engine.pool_bytes_per_device > 0


def test_a_switch_that_would_split_the_pool_below_the_request_limit_is_refused(small_pool) -> None:  # type: ignore[no-untyped-def]
    srv, admin = small_pool
    assert srv.running.gateway.max_request_tokens == 128
    with pytest.raises(grpc.RpcError) as err:
        admin.SetLayout(apb.SetLayoutRequest(pool="p", layout="2x1"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds 64 of the pool's 128 tokens" in err.value.details() and "--kv-cache-tokens" in err.value.details()
    assert srv.running.gateway.pools[0].loop.runner.layout.name == "1x2"  # nothing changed


def test_a_switch_that_would_not_fit_in_memory_is_refused(small_pool, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    srv, admin = small_pool
    predicted = admin.ListLayouts(apb.ListLayoutsRequest(), metadata=AUTH)
    one = next(p for p in predicted.presets if p.data == 1 and p.model == 1 and not p.unusable)
    need = one.weight_bytes_per_device + one.kv_cache_bytes_per_device
    monkeypatch.setattr(kv_pool, "host_available_bytes", lambda: need - 1)  # one CPU device's need, less a byte
    with pytest.raises(grpc.RpcError) as err:
        admin.SetLayout(apb.SetLayoutRequest(pool="p", layout="1x1"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "'1x1'" in err.value.details() and "of host memory (1 CPU device(s)" in err.value.details()
    assert srv.running.gateway.pools[0].loop.runner.layout.name == "1x2"  # nothing changed


def test_the_memory_a_switch_needs_is_what_the_new_runner_holds(small_pool, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A switch builds the new runner beside the serving one: it must fit the layout's predicted
    weights and KV pool per device, and on one CPU device, where float32 weights are packed into
    panels in place of the arrays, a tied model's packed head beside its table: exactly what the
    1x1 runner holds."""
    srv, admin = small_pool
    gateway = srv.running.gateway
    runner = gateway.pools[0].loop.runner
    predicted = admin.ListLayouts(apb.ListLayoutsRequest(), metadata=AUTH)
    one_layout = next(p for p in predicted.presets if p.data == 1 and p.model == 1 and not p.unusable)
    one = runner.relayout(Layout("1x1"), list(runner.mesh.devices.flat[:1]))
    head = packed_head_bytes(gateway.facts.cfg, gateway.facts.formats, one.kernels.panels)
    assert one.kernels.panels == (NATIVE and cpu_matmul.available())
    assert head == 0  # the tiny model's 264-id vocabulary is no whole number of panels: its head stays a table
    assert sum(one.weight_bytes_per_device().values()) == one_layout.weight_bytes_per_device + head
    need = one_layout.weight_bytes_per_device + one_layout.kv_cache_bytes_per_device + head
    monkeypatch.setattr(kv_pool, "host_available_bytes", lambda: need - 1)
    with pytest.raises(grpc.RpcError) as err:
        admin.SetLayout(apb.SetLayoutRequest(pool="p", layout="1x1"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"needs {need / 2**30:.2f} GiB of host memory" in err.value.details()
    assert runner.layout.name == "1x2"  # nothing changed


def test_a_failed_build_leaves_the_pool_serving(small_pool, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    srv, admin = small_pool
    service = srv.running.gateway
    client = Client(srv.address)
    greedy = make_request(prompt="Hello", max_tokens=6, temperature=0.0)
    before = client.generate(greedy).token_ids

    def out_of_memory(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes.")

    monkeypatch.setattr(service, "restore", out_of_memory)
    with pytest.raises(grpc.RpcError) as err:
        admin.SetLayout(apb.SetLayoutRequest(pool="p", layout="1x1"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "building the new engine failed" in err.value.details() and "keeps serving on '1x2'" in err.value.details()

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise ValueError("something else")

    monkeypatch.setattr(service, "restore", broken)
    with pytest.raises(grpc.RpcError) as err:
        admin.SetLayout(apb.SetLayoutRequest(pool="p", layout="1x1"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "ValueError: something else" in err.value.details()
    assert service.pools[0].loop.runner.layout.name == "1x2"
    assert client.generate(greedy).token_ids == before and len(before) == 6
    client.close()
