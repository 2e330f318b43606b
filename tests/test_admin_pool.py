"""The Admin service on a paged pool (tiny model): the layout predictions count the pool as
served, and a switch to a layout whose data replicas would each hold less than a request may
now is refused before anything is built."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import admin_pb2_grpc as apb_grpc
from service.engine import EngineConfig
from service.server import ServerConfig, ServerThread

TOKEN = "pool-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]


@pytest.fixture(scope="module")
def small_pool(tiny_gguf: Path):  # type: ignore[no-untyped-def]
    """One pool on 1x2, 128 positions in all, requests of up to 128 tokens."""
    cfg = ServerConfig(
        model=str(tiny_gguf), port=0, pools=["p=1x2"], admin_token=TOKEN, admin_port=0,
        engine=EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32, kv_cache_tokens=128),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.running.admin_port}")
    yield srv, apb_grpc.AdminStub(channel)
    channel.close()
    srv.stop()


def test_layout_info_predicts_the_pool_each_device_holds(small_pool) -> None:  # type: ignore[no-untyped-def]
    srv, admin = small_pool
    engine = srv.running.service.pools[0].loop.engine
    info = admin.GetLayout(apb.GetLayoutRequest(pool="p"), metadata=AUTH)
    assert info.kv_cache_bytes_per_device == engine.pool_bytes_per_device > 0


def test_a_switch_that_would_split_the_pool_below_the_request_limit_is_refused(small_pool) -> None:  # type: ignore[no-untyped-def]
    srv, admin = small_pool
    assert srv.running.service.max_request_tokens == 128
    with pytest.raises(grpc.RpcError) as err:
        admin.SetLayout(apb.SetLayoutRequest(pool="p", layout="2x1"), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds 64 of the pool's 128 tokens" in err.value.details() and "--kv-cache-tokens" in err.value.details()
    assert srv.running.service.pools[0].loop.engine.layout.name == "1x2"  # nothing changed
