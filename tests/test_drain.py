"""The drain (``RunningServer.shutdown``) never cuts a stream: a request is in flight until its
response's last byte is handed to its connection, so every stream that ends within the grace
period ends with its last chunk and ``finish_reason`` (HTTP: then ``[DONE]``), and one that the
grace period ends gets an explicit error (gRPC UNAVAILABLE; an SSE error event before ``[DONE]``).

Servers of their own on the tiny model (their drain stops them); the engine is slowed with the
loop's ``step_hook`` so that the drain overlaps the streams' tails."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import GrpcStream, free_port, wait_for

from service.engine.config import EngineConfig
from service.engine.request import RequestState
from service.server.app import ServerThread
from service.server.client import Client, make_request
from service.server.config import ServerConfig
from service.server.http_api import create_app

PROMPT = "the drain"  # real tokens: greedy decoding of the tiny model never emits EOS (tests/tiny_gguf.py)


def greedy(max_tokens: int) -> Any:
    return make_request(prompt=PROMPT, temperature=0.0, max_tokens=max_tokens)


@pytest.fixture()
def tiny_drained(tiny_gguf: Path) -> Iterator[ServerThread]:
    """A tiny-model server with the HTTP API; the test drains it (``stop`` is idempotent)."""
    cfg = ServerConfig(
        model=str(tiny_gguf), port=0, metrics_port=0, http_port=free_port(),
        engine=EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    yield srv
    srv.stop()


class SseStream:
    """A streamed completion over raw HTTP on its own thread: each event's data, in order."""

    def __init__(self, port: int, max_tokens: int):
        self.events: list[str] = []
        self.status: int | None = None
        self.first = threading.Event()
        self.ended_at: float | None = None
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        self._thread = threading.Thread(target=self._run, args=(port, body), daemon=True)
        self._thread.start()

    def _run(self, port: int, body: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.status = resp.status
            for line in resp:  # http.client undoes the chunked encoding
                if line.startswith(b"data: "):
                    self.events.append(line[len(b"data: ") :].decode().strip())
                    self.first.set()
        except (OSError, http.client.HTTPException) as exc:  # a cut connection ends the list
            self.events.append(f"<cut: {exc!r}>")
        finally:
            conn.close()
            self.ended_at = time.monotonic()
            self.first.set()

    def join(self, timeout_s: float) -> list[str]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the HTTP stream did not end"
        return self.events


def drain_in_background(srv: ServerThread, grace_s: float) -> tuple[threading.Thread, list[float]]:
    """``srv.stop(grace_s)`` on a thread; the list gets the time it returned."""
    done: list[float] = []

    def run() -> None:
        srv.stop(grace_s)
        done.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_streams_running_at_the_drain_end_with_their_last_chunk_on_http_and_grpc(
    tiny_drained: ServerThread,
) -> None:
    srv = tiny_drained
    assert srv.running is not None
    port, loop = srv.running.http_port, srv.running.gateway.pools[0].loop
    assert port is not None
    client = Client(srv.address)
    expected = list(client.generate(greedy(40)).token_ids)
    assert len(expected) == 40
    loop.step_hook = lambda plan: time.sleep(0.03)  # 40 tokens: over a second, the drain overlaps them
    sse, rpc = SseStream(port, 40), GrpcStream(client, greedy(40))
    assert sse.first.wait(30) and rpc.first.wait(30)
    thread, drained_at = drain_in_background(srv, grace_s=30.0)

    events = sse.join(60)
    rpc.join(60)
    client.close()
    thread.join(60)
    assert not thread.is_alive()
    assert sse.status == 200 and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(chunks) == 40  # one event per token, none lost at the end
    assert rpc.code == grpc.StatusCode.OK, rpc.details
    assert rpc.ids == expected and rpc.finish_reason != 0
    assert sse.ended_at is not None and drained_at and drained_at[0] >= sse.ended_at


def test_streams_that_outlive_the_grace_period_end_with_an_explicit_error(tiny_drained: ServerThread) -> None:
    srv = tiny_drained
    assert srv.running is not None and srv.running.http_port is not None
    srv.running.gateway.pools[0].loop.step_hook = lambda plan: time.sleep(0.1)  # 100 tokens: 10 s
    client = Client(srv.address)
    sse, rpc = SseStream(srv.running.http_port, 100), GrpcStream(client, greedy(100))
    assert sse.first.wait(30) and rpc.first.wait(30)
    signalled = time.monotonic()
    thread, _ = drain_in_background(srv, grace_s=0.5)

    events = sse.join(30)
    rpc.join(30)
    client.close()
    thread.join(30)
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert "shutting down" in error["error"]["message"] and error["error"]["code"] == "unavailable"
    assert 1 <= len(events) - 2 < 100
    assert rpc.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in rpc.details
    assert 1 <= len(rpc.ids) < 100
    assert sse.ended_at is not None and sse.ended_at - signalled < 0.5 + 3


def test_a_request_is_in_flight_until_its_last_byte_is_handed_to_the_connection(tiny_drained: ServerThread) -> None:
    """The HTTP app driven directly, its connection's last write held: the engine has finished
    the request, yet it stays in flight (the drain waits) until that write is done."""
    srv = tiny_drained
    assert srv.running is not None
    gateway = srv.running.gateway
    app = create_app(gateway)
    last_write, release, sent = threading.Event(), asyncio.Event(), []
    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True})

    async def receive() -> dict[str, Any]:
        if not sent:
            sent.append({"type": "http.request", "body": body.encode(), "more_body": False})
            return sent[-1]
        await asyncio.Event().wait()  # the client never goes away
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            last_write.set()
            await release.wait()  # a connection slow to take the last bytes

    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    aloop = srv._loop
    call = asyncio.run_coroutine_threadsafe(app(scope, receive, send), aloop)
    assert last_write.wait(30)
    held = [r for requests in gateway.inflight.values() for r in requests]
    assert len(held) == 1 and held[0].state is RequestState.FINISHED  # the engine is done with it
    left = asyncio.run_coroutine_threadsafe(srv.running._inflight_after(0.3), aloop).result(10)
    assert left == 1  # a drain would wait for the last byte
    aloop.call_soon_threadsafe(release.set)
    call.result(10)
    assert wait_for(lambda: not any(gateway.inflight.values()), 5)
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert data.rstrip().endswith(b"data: [DONE]")
