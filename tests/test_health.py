"""C20: health tells the truth. Each test starts its own small server on the tiny random model
(``tiny_gguf``: health is about the server, not the model; 2 slots x 256 tokens, stall timeout
2 s, watchdog every 0.2 s) and breaks its engine loop through the loop's ``step_hook``
fault-injection hook: (a) a step raises, (b) a step blocks forever. Until the fault, the hook
paces the loop (``PACE_S`` per step), so a 200-token stream lasts about 10 s as it did on the
real model: the tiny model alone would finish it in a fraction of a second, before the test
arms its fault."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import free_port, get, post, scrape, value

from service.engine.config import EngineConfig
from service.engine.scheduler import StepPlan
from service.server import app
from service.server.app import ServerThread
from service.server.client import Client, make_request
from service.server.config import ServerConfig
from service.server.gateway import Gateway
from service.server.grpc_api import SERVICE_NAME

STALL_S = 2.0
INTERVAL_S = 0.2
SLACK_S = 0.5  # polling, RPC latency and a busy 2-core CPU
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = "Count from 1 to 100 separated by spaces:"  # 39 ids of the tiny tokenizer: + 200 fit 256
PACE_S = 0.05  # a step's pause before the fault (far under STALL_S)


def small_config(model: Path, **overrides: object) -> ServerConfig:
    values: dict = dict(
        model=str(model),
        port=0,
        engine=EngineConfig(num_slots=2, max_seq_len=256),
        max_queue=8,
        stall_timeout_s=STALL_S,
        watchdog_interval_s=INTERVAL_S,
        metrics_port=0,
    )
    values.update(overrides)
    return ServerConfig(**values)


def check(client: Client, service: str = "") -> int | None:
    """One health Check with a short deadline: the status, or None if the call failed."""
    try:
        return client.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0).status
    except grpc.RpcError:
        return None


def first_time(client: Client, status: int, timeout_s: float) -> float | None:
    """Poll Check every 50 ms; the monotonic time ``status`` was first seen, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check(client) == status:
            return time.monotonic()
        time.sleep(0.05)
    return None


class Stream:
    """A Generate call running on its own thread: its ids, final status code and end time."""

    def __init__(self, client: Client, prompt: str = LONG, max_tokens: int = 200):
        self.ids: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at: float | None = None
        self.first_chunk = threading.Event()
        self._call = client.stream(make_request(prompt=prompt, temperature=0.0, max_tokens=max_tokens), 120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for resp in self._call:
                self.ids.extend(resp.token_ids)
                self.first_chunk.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        self.ended_at = time.monotonic()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"


def unary_status(client: Client, timeout_s: float = 10.0) -> tuple[grpc.StatusCode, str, float]:
    """A short Generate: (status code, details, seconds it took)."""
    t0 = time.monotonic()
    try:
        client.generate(make_request(prompt="Hello", temperature=0.0, max_tokens=4), timeout_s=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", time.monotonic() - t0
    return grpc.StatusCode.OK, "", time.monotonic() - t0


@pytest.fixture()
def release() -> Iterator[threading.Event]:
    """Set at teardown so a blocked engine step can return and the server can stop."""
    event = threading.Event()
    yield event
    event.set()


def wait_listening(port: int, timeout_s: float = 60.0) -> None:
    """Block until 127.0.0.1:``port`` accepts TCP connections. A gRPC channel that tries to
    connect before the port is bound backs off for 1 s, 1.6 s, 2.6 s, ...; with a warm
    compilation cache the whole start-up can fit in that back-off, so connect only after this."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.01)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s")


def test_c20_not_serving_during_warmup_then_a_raising_loop_turns_not_serving(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A slow model load (as from a network disk): with a warm compilation cache the start-up
    # can take under a second, too short to observe the NOT_SERVING window reliably.
    original_load = app.load

    def slow_load(gateway: Gateway, job: object) -> int:
        time.sleep(2.0)
        return original_load(gateway, job)  # type: ignore[arg-type]

    monkeypatch.setattr(app, "load", slow_load)
    port = free_port()
    srv = ServerThread(small_config(tiny_gguf, port=port))
    starter = threading.Thread(target=srv.start, daemon=True)
    starter.start()
    wait_listening(port)
    client = Client(f"127.0.0.1:{port}")
    try:
        # Before warm-up is done: NOT_SERVING, and Generate is UNAVAILABLE (not a hang).
        seen: list[int | None] = []
        early: tuple[grpc.StatusCode, str, float] | None = None
        deadline = time.monotonic() + 300
        while starter.is_alive() and time.monotonic() < deadline:
            status = check(client)
            seen.append(status)
            if status == NOT_SERVING and early is None:
                early = unary_status(client)
            time.sleep(0.1)
        starter.join(1)
        assert srv.running is not None, "the server did not start"
        # NOT_SERVING until SERVING, which may be seen in the moment between the server turning
        # SERVING and srv.start returning on the starter thread.
        first_serving = seen.index(SERVING) if SERVING in seen else len(seen)
        assert NOT_SERVING in seen[:first_serving], seen
        assert all(s == SERVING for s in seen[first_serving:]), seen
        assert early is not None
        assert early[0] == grpc.StatusCode.UNAVAILABLE and early[2] < 2.0, early
        assert check(client) == SERVING
        assert check(client, SERVICE_NAME) == SERVING
        assert srv.running.metrics_port is None and srv.running.metrics_httpd is None  # metrics_port=0: off

        service = srv.running.gateway
        registry = service.metrics.registry
        assert registry.get_sample_value("meshserve_serving") == 1

        # Watch for the service name from now on.
        watched: list[tuple[float, int]] = []
        watch = client.health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=120)

        def follow() -> None:
            try:
                for resp in watch:
                    watched.append((time.monotonic(), resp.status))
            except grpc.RpcError:
                pass

        threading.Thread(target=follow, daemon=True).start()

        # (a) A step raises while a stream runs.
        armed = threading.Event()
        raised_at: list[float] = []

        def hook(plan: StepPlan) -> None:
            if armed.is_set():
                raised_at.append(time.monotonic())
                raise RuntimeError("injected engine failure")
            time.sleep(PACE_S)

        service.pools[0].loop.step_hook = hook
        stream = Stream(client)
        assert stream.first_chunk.wait(60)
        armed.set()
        stream.join(10)
        assert raised_at
        died = raised_at[0]
        assert stream.code == grpc.StatusCode.UNAVAILABLE, (stream.code, stream.details)
        assert "injected engine failure" in stream.details
        assert stream.ended_at is not None and stream.ended_at - died < 2.0
        assert len(stream.ids) >= 1

        not_serving_at = first_time(client, NOT_SERVING, timeout_s=10)
        assert not_serving_at is not None, "health never turned NOT_SERVING"
        assert not_serving_at - died <= 2 * INTERVAL_S + SLACK_S
        assert check(client, SERVICE_NAME) == NOT_SERVING

        code, details, took = unary_status(client)
        assert code == grpc.StatusCode.UNAVAILABLE and took < 1.0, (code, details, took)
        assert "died" in details
        time.sleep(2 * INTERVAL_S)
        assert check(client) == NOT_SERVING  # it stays down
        assert [s for _, s in watched][:1] == [SERVING] and watched[-1][1] == NOT_SERVING, watched
        assert registry.get_sample_value("meshserve_serving") == 0
        error = registry.get_sample_value("meshserve_requests_total", {"pool": "default", "finish_reason": "error"})
        assert error == 1
        watch.cancel()
    finally:
        client.close()
        starter.join(300)
        srv.stop()


def test_c20_a_stalled_step_turns_not_serving_and_fails_its_requests(tiny_gguf: Path, release: threading.Event) -> None:
    metrics_port, http_port = free_port(), free_port()
    srv = ServerThread(small_config(tiny_gguf, metrics_port=metrics_port, http_port=http_port)).start()
    client = Client(srv.address)
    try:
        assert srv.running.metrics_port == metrics_port
        assert get(http_port, "/health") == (200, '{"status":"SERVING"}')
        loop = srv.running.gateway.pools[0].loop
        scheduler = loop.scheduler
        armed = threading.Event()
        blocked_at: list[float] = []

        def hook(plan: StepPlan) -> None:
            if armed.is_set() and not blocked_at:
                blocked_at.append(time.monotonic())
                release.wait()  # "forever": until the test ends
            elif not armed.is_set():
                time.sleep(PACE_S)

        loop.step_hook = hook
        running = [Stream(client), Stream(client)]  # both slots
        for s in running:
            assert s.first_chunk.wait(60)
        queued = Stream(client)  # waits for a slot
        deadline = time.monotonic() + 10
        while scheduler.queue_depth < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.queue_depth == 1
        armed.set()
        deadline = time.monotonic() + 10
        while not blocked_at and time.monotonic() < deadline:
            time.sleep(0.01)
        assert blocked_at, "the hook never blocked"
        stuck = blocked_at[0]
        late = Stream(client)  # accepted (the stall is not detected yet) but never reaches the loop

        # Not before the stall timeout...
        time.sleep(max(0.0, stuck + STALL_S / 2 - time.monotonic()))
        assert check(client) == SERVING
        # ... but within about two watchdog intervals after it.
        not_serving_at = first_time(client, NOT_SERVING, timeout_s=STALL_S + 10)
        assert not_serving_at is not None, "health never turned NOT_SERVING"
        assert not_serving_at - stuck <= STALL_S + 2 * INTERVAL_S + SLACK_S, not_serving_at - stuck
        assert check(client, SERVICE_NAME) == NOT_SERVING

        # Every request of the pool (in slots, queued, not yet picked up) fails with UNAVAILABLE.
        for s in [*running, queued, late]:
            s.join(10)
            assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
            assert "stalled" in s.details
            assert s.ended_at is not None and s.ended_at - stuck <= STALL_S + 2 * INTERVAL_S + SLACK_S
        assert queued.ids == [] and late.ids == []

        code, details, took = unary_status(client)
        assert code == grpc.StatusCode.UNAVAILABLE and took < 1.0, (code, details, took)
        assert "stalled" in details
        # The HTTP API says the same: /health 503, a completion 503 at once (not a hang).
        assert get(http_port, "/health") == (503, '{"status":"NOT_SERVING"}')
        t0 = time.monotonic()
        status, text = post(http_port, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}, timeout_s=10)
        assert status == 503 and "stalled" in text and time.monotonic() - t0 < 1.0, (status, text)
        samples = scrape(metrics_port)
        assert samples[("meshserve_serving", frozenset())] == 0
        assert value(samples, "meshserve_requests_total", pool="default", finish_reason="error") == 4

        # The step returns: the loop drops the failed requests and serves again.
        release.set()
        assert first_time(client, SERVING, timeout_s=10) is not None
        deadline = time.monotonic() + 10
        while (scheduler.active_slots or scheduler.queue_depth) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.active_slots == 0 and scheduler.queue_depth == 0
        code, details, _ = unary_status(client, timeout_s=60)
        assert code == grpc.StatusCode.OK, (code, details)
        assert get(http_port, "/health") == (200, '{"status":"SERVING"}')
    finally:
        release.set()
        client.close()
        srv.stop()
