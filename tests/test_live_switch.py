"""Engine pools on disjoint devices, and the Admin service switching a pool's layout live.

One server on 8 CPU devices: pool "fast" owns devices 0-3 (starts on 1x4: TP 4, attention
replicated) and pool "bulk" owns devices 4-7 (4x1: data parallel).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import admin_pb2_grpc as apb_grpc
from service.engine.config import EngineConfig
from service.server.app import ServerThread
from service.server.client import Client, make_request
from service.server.config import ServerConfig

pytestmark = pytest.mark.slow  # a real server on the default model

TOKEN = "test-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]
PROMPTS = ["Once upon a time", "The capital of Germany is", "def fibonacci(n):", "Here is a list of fruits:"]


@pytest.fixture(scope="module")
def pool_server(smollm2_gguf: Path):  # type: ignore[no-untyped-def]
    cfg = ServerConfig(
        model=str(smollm2_gguf),
        port=0,
        engine=EngineConfig(num_slots=4, max_seq_len=256, chunk_size=64),
        pools=["fast=1x4", "bulk=4x1"],
        admin_token=TOKEN,
        admin_port=0,
        metrics_port=0,
    )
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def clients(pool_server):  # type: ignore[no-untyped-def]
    c = Client(pool_server.address)
    channel = grpc.insecure_channel(f"127.0.0.1:{pool_server.running.admin_port}")
    yield c, apb_grpc.AdminStub(channel)
    c.close()
    channel.close()


def greedy(prompt: str, max_tokens: int, layout: str = "") -> object:
    return make_request(prompt=prompt, temperature=0.0, max_tokens=max_tokens, layout=layout)


def test_admin_needs_the_token(clients) -> None:  # type: ignore[no-untyped-def]
    _, admin = clients
    for metadata in ([], [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as err:
            admin.GetLayout(apb.GetLayoutRequest(), metadata=metadata)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_list_and_get_layouts(clients, pool_server) -> None:  # type: ignore[no-untyped-def]
    _, admin = clients
    listed = admin.ListLayouts(apb.ListLayoutsRequest(), metadata=AUTH)
    # Every preset; those that cannot serve this model with 4 slots say why ("throughput" is
    # data 8: 8 does not divide 4 slots) and predict no bytes.
    presets = {p.name: p for p in listed.presets}
    assert set(presets) == {"latency", "hybrid", "tp3", "single", "throughput"}
    assert [n for n, p in presets.items() if p.unusable] == ["throughput"]
    assert "must divide the number of slots (4)" in presets["throughput"].unusable
    assert presets["throughput"].weight_bytes_per_device == presets["throughput"].kv_cache_bytes_per_device == 0
    assert all(p.weight_bytes_per_device > 0 for n, p in presets.items() if n != "throughput")
    pools = {p.name: p for p in listed.pools}
    assert list(pools["fast"].device_ids) == [0, 1, 2, 3] and pools["fast"].is_default
    assert list(pools["bulk"].device_ids) == [4, 5, 6, 7]
    fast = admin.GetLayout(apb.GetLayoutRequest(pool="fast"), metadata=AUTH)
    assert (fast.name, fast.data, fast.model, fast.attention) == ("1x4", 1, 4, "replicated")
    assert fast.all_reduces_per_layer == 1
    bulk = admin.GetLayout(apb.GetLayoutRequest(pool="bulk"), metadata=AUTH)
    assert (bulk.data, bulk.model, bulk.all_reduces_per_layer) == (4, 1, 0)
    # The paged pool's bytes on each device, as the engines placed them (bulk: a quarter each).
    engines = {p.name: p.loop.runner for p in pool_server.running.gateway.pools}
    assert fast.kv_cache_bytes_per_device == engines["fast"].pool_bytes_per_device
    assert (
        bulk.kv_cache_bytes_per_device == engines["bulk"].pool_bytes_per_device == fast.kv_cache_bytes_per_device // 4
    )


def test_unknown_layout_in_a_request_lists_the_valid_names(clients) -> None:  # type: ignore[no-untyped-def]
    client, _ = clients
    with pytest.raises(grpc.RpcError) as err:
        client.generate(greedy("Hello", 4, layout="nope"), timeout_s=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for name in ("fast", "bulk", "1x4", "4x1"):
        assert name in err.value.details()


def test_set_layout_rejects_what_cannot_work(clients) -> None:  # type: ignore[no-untyped-def]
    _, admin = clients
    for layout, needle in (
        ("2x4", "needs 8 devices"),
        ("tp2-heads.yaml", "unknown layout"),
        ("nope", "unknown layout"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            admin.SetLayout(apb.SetLayoutRequest(pool="fast", layout=layout), metadata=AUTH)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in err.value.details()


def test_two_pools_serve_concurrently_with_their_single_pool_tokens(clients) -> None:  # type: ignore[no-untyped-def]
    client, _ = clients
    solo = {(p, pool): client.generate(greedy(p, 12, pool)).token_ids for p in PROMPTS[:2] for pool in ("fast", "bulk")}
    for p in PROMPTS[:2]:
        assert solo[(p, "fast")] == solo[(p, "bulk")]  # the same model on two meshes
    with ThreadPoolExecutor(4) as ex:
        futures = {key: ex.submit(lambda k: client.generate(greedy(k[0], 12, k[1])).token_ids, key) for key in solo}
        together = {key: f.result() for key, f in futures.items()}
    assert together == solo


def test_switch_round_trip(clients) -> None:  # type: ignore[no-untyped-def]
    """tp3 (attention split over heads) and back; also fills the compilation cache for the
    mid-stream test below."""
    client, admin = clients
    before = client.generate(greedy(PROMPTS[0], 10)).token_ids
    info = admin.SetLayout(apb.SetLayoutRequest(pool="fast", layout="tp3"), metadata=AUTH)
    assert (info.name, info.model, info.attention, list(info.device_ids)) == ("tp3", 3, "heads", [0, 1, 2])
    assert client.generate(greedy(PROMPTS[0], 10, "fast")).token_ids == before
    info = admin.SetLayout(apb.SetLayoutRequest(pool="fast", layout="1x4"), metadata=AUTH)
    assert (info.name, info.attention) == ("1x4", "replicated")
    assert client.generate(greedy(PROMPTS[0], 10)).token_ids == before


def test_set_layout_mid_stream_keeps_every_stream_exact(clients, pool_server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    client, admin = clients
    # Every stream must outlast the switch (compile and warm-up of tp3), however slow the machine:
    # the loop keeps decoding while SetLayout builds the new engine, but after ``hold_after``
    # steps it waits (``step_hook``) until the new engine is handed to the loop, so the streams
    # cannot end before the switch (free-running, a 60-token stream once ended 22 ms before the
    # swap under load; 160 tokens were needed).
    n = 40
    hold_after = 12
    # The references run together, one per slot (greedy ids do not depend on the batch: C14).
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        reference = dict(zip(PROMPTS, ex.map(lambda p: client.generate(greedy(p, n)).token_ids, PROMPTS), strict=True))

    arrivals: dict[str, list[float]] = {p: [] for p in PROMPTS}
    results: dict[str, list[int]] = {}
    started = threading.Barrier(len(PROMPTS) + 1)

    def stream(prompt: str) -> None:
        ids: list[int] = []
        first = True
        for resp in client.stream(greedy(prompt, n), timeout_s=600):
            ids.extend(resp.token_ids)
            arrivals[prompt].append(time.monotonic())
            if first:
                first = False
                started.wait()
        results[prompt] = ids

    loop = pool_server.running.gateway.pools[0].loop
    handed_over = threading.Event()  # SetLayout has built and warmed tp3 and gives it to the loop
    switch_runner = loop.switch_runner

    def hand_over(new_engine, timeout_s: float = 600.0) -> None:  # type: ignore[no-untyped-def]
        handed_over.set()
        switch_runner(new_engine, timeout_s)

    monkeypatch.setattr(loop, "switch_runner", hand_over)
    steps_during_build = 0

    def hold(plan: object) -> None:  # on the loop thread, at the top of every step
        nonlocal steps_during_build
        if not handed_over.is_set():
            steps_during_build += 1
            if steps_during_build > hold_after:
                handed_over.wait(600)

    threads = [threading.Thread(target=stream, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    started.wait()  # every stream has its first token
    assert loop.scheduler.active_slots == len(PROMPTS)
    # When the loop swaps engines (SetLayout returns later: it compiles and warms up first).
    swapped: list[float] = []

    def watch_swap() -> None:
        while not swapped and any(t.is_alive() for t in threads):
            if loop.runner.layout.name == "tp3":
                swapped.append(time.monotonic())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch_swap, daemon=True)
    watcher.start()
    loop.step_hook = hold
    try:
        admin.SetLayout(apb.SetLayoutRequest(pool="fast", layout="tp3"), metadata=AUTH)
    finally:
        handed_over.set()  # never leave the loop held
        loop.step_hook = None
    for t in threads:
        t.join(600)
    watcher.join(5)
    assert steps_during_build >= 1, "no step ran while SetLayout built the new engine"
    assert swapped, "the streams ended before the switch: not a mid-stream test"
    switched_at = swapped[0]
    assert loop.runner.layout.name == "tp3"
    for p in PROMPTS:
        assert results[p] == reference[p]
        assert arrivals[p][-1] > switched_at, "the stream ended before the switch: not a mid-stream test"
        # The hold leaves every stream well over 10 tokens to decode on tp3 (n - 1 - hold_after,
        # less the few steps one stream may lead another by and the hand-off).
        assert sum(t > switched_at for t in arrivals[p]) >= 10, "too few tokens after the switch"
    admin.SetLayout(apb.SetLayoutRequest(pool="fast", layout="1x4"), metadata=AUTH)


def test_switches_under_load_keep_the_process_and_every_stream(smollm2_gguf: Path) -> None:
    """single -> latency -> hybrid -> single on all 8 devices while 4 clients stream greedy
    requests back to back: every switch completes, every stream ends OK with its reference ids.
    The new layout's programs used to be warmed by running them beside the old layout's steps:
    an all-reduce of latency's warm-up waited on a device busy with single's steps, and after
    40 s XLA:CPU aborted the whole process (exit 134); now a switch compiles them without running
    them, and moves the weights through the host (a reshard is a program of collectives)."""
    cfg = ServerConfig(
        model=str(smollm2_gguf), port=0, metrics_port=0, admin_token=TOKEN, admin_port=0,
        engine=EngineConfig(num_slots=4, max_seq_len=256, chunk_size=64),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    assert srv.running is not None
    client = Client(srv.address)
    channel = grpc.insecure_channel(f"127.0.0.1:{srv.running.admin_port}")
    admin = apb_grpc.AdminStub(channel)
    n = 24
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            reference = dict(
                zip(PROMPTS, ex.map(lambda p: client.generate(greedy(p, n)).token_ids, PROMPTS), strict=True)
            )
        stop = threading.Event()
        finished: list[str] = []
        failures: list[object] = []

        def stream(prompt: str) -> None:
            while not stop.is_set():
                try:
                    ids = [t for resp in client.stream(greedy(prompt, n), timeout_s=600) for t in resp.token_ids]
                except grpc.RpcError as exc:
                    failures.append((prompt, exc.code(), exc.details()))
                    return
                if ids != reference[prompt]:
                    failures.append((prompt, ids))
                finished.append(prompt)

        threads = [threading.Thread(target=stream, args=(p,), daemon=True) for p in PROMPTS]
        for t in threads:
            t.start()
        for layout in ("latency", "hybrid", "single"):
            before = len(finished)
            info = admin.SetLayout(apb.SetLayoutRequest(layout=layout), metadata=AUTH, timeout=900)
            assert info.name == layout
            deadline = time.monotonic() + 300
            while len(finished) < before + len(PROMPTS) and not failures and time.monotonic() < deadline:
                time.sleep(0.05)  # streams run on the new layout before the next switch
            assert not failures, failures[:3]
            assert len(finished) >= before + len(PROMPTS)
        stop.set()
        for t in threads:
            t.join(300)
        assert not failures, failures[:3]
    finally:
        client.close()
        channel.close()
        srv.stop()
