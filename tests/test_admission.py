"""Admission on the tiny session server (2 slots, queue of 4): a full queue is refused with
RESOURCE_EXHAUSTED before the chat template is rendered or the prompt tokenized; stop strings
beyond their bounds are INVALID_ARGUMENT; rejections are counted under the pool they were for."""

from __future__ import annotations

import grpc
import pytest
from helpers import full_queue, scrape, status_of, value, wait_for

from service.server.client import Client, make_request


@pytest.fixture()
def client(tiny_server):  # type: ignore[no-untyped-def]
    c = Client(tiny_server.address)
    yield c
    c.close()


def test_a_full_queue_is_refused_before_any_tokenizing(tiny_server, client: Client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    service = tiny_server.running.gateway
    loop = service.pools[0].loop
    tok = service.tokenizer
    encoded: list[str] = []
    rendered: list[object] = []
    real_encode, real_render = tok.encode, tok.apply_chat_template
    monkeypatch.setattr(tok, "encode", lambda text: encoded.append(text) or real_encode(text))
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **k: rendered.append(a) or real_render(*a, **k))
    port = tiny_server.running.metrics_port
    with full_queue(loop, client):
        assert loop.scheduler.max_queue == 4
        before = value(scrape(port), "meshserve_requests_rejected_total", pool="default", code="resource_exhausted")
        n_encoded, n_rendered = len(encoded), len(rendered)
        for req in (make_request(chat=[("user", "hello " * 20)], max_tokens=2), make_request(prompt="c" * 100)):
            code, details = status_of(client, req, 30)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details == "queue full: 4 requests waiting (max 4)"
        assert (len(encoded), len(rendered)) == (n_encoded, n_rendered)  # refused without the work
        after = value(scrape(port), "meshserve_requests_rejected_total", pool="default", code="resource_exhausted")
        assert after == before + 2
    assert (len(encoded), len(rendered)) == (n_encoded, n_rendered)
    # With room again, a request is tokenized and served.
    assert status_of(client, make_request(chat=[("user", "hi")], max_tokens=2), 60) == (grpc.StatusCode.OK, "")
    assert len(rendered) == n_rendered + 1 and len(encoded) == n_encoded + 1


@pytest.mark.parametrize(
    ("stop", "details"),
    [
        (["x"] * 10_000, "stop: at most 16 stop strings, got 10000"),
        (["y" * 300], "stop[0]: at most 256 characters per stop string, got 300"),
    ],
)
def test_stop_strings_beyond_their_bounds_are_invalid_argument(tiny_server, client: Client, stop, details) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.metrics_port
    before = value(scrape(port), "meshserve_requests_rejected_total", pool="default", code="invalid_argument")
    assert status_of(client, make_request(prompt="hi", max_tokens=2, stop=stop), 30) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        details,
    )
    after = value(scrape(port), "meshserve_requests_rejected_total", pool="default", code="invalid_argument")
    assert after == before + 1
    ok = make_request(prompt="hi", max_tokens=2, stop=[f"{i:03d}" for i in range(16)])
    assert status_of(client, ok, 60) == (grpc.StatusCode.OK, "")


def test_a_rejection_before_a_pool_is_chosen_has_an_empty_pool_label(tiny_server, client: Client) -> None:  # type: ignore[no-untyped-def]
    port = tiny_server.running.metrics_port
    before = value(scrape(port), "meshserve_requests_rejected_total", pool="", code="invalid_argument")
    code, details = status_of(client, make_request(prompt="hi", layout="no-such-pool"), 30)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("layout: unknown layout or pool")
    assert value(scrape(port), "meshserve_requests_rejected_total", pool="", code="invalid_argument") == before + 1


def test_a_cancelled_stream_frees_its_slot_and_counts_as_cancelled(tiny_server, client: Client) -> None:  # type: ignore[no-untyped-def]
    """Through service.server.wire's wrapper around Generate: the servicer's cleanup runs on cancel."""
    import time

    loop = tiny_server.running.gateway.pools[0].loop
    port = tiny_server.running.metrics_port
    before = value(scrape(port), "meshserve_requests_total", pool="default", finish_reason="cancelled")
    loop.step_hook = lambda plan: time.sleep(0.05)  # about 20 steps a second: the stream outlives the cancel
    try:
        call = client.stream(make_request(prompt="count", max_tokens=100), timeout_s=60)
        next(call)
        assert loop.scheduler.active_slots == 1
        call.cancel()
        assert wait_for(lambda: loop.scheduler.active_slots == 0, 10)
    finally:
        loop.step_hook = None
    assert wait_for(
        lambda: value(scrape(port), "meshserve_requests_total", pool="default", finish_reason="cancelled") == before + 1
    )


def test_admission_tells_the_server_before_a_request_is_submitted(tiny_server, client: Client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``on_admit`` runs on the event loop before the first sequence is submitted, and only for a
    request that passed every check: serve_forever then drains on a stop signal instead of
    ending the process (a request can be admitted just before SERVING), and also prompts are
    tokenized on a worker thread, not the event loop's."""
    import threading

    service = tiny_server.running.gateway
    calls: list[tuple[str, int]] = []
    threads: list[str] = []
    tok = service.tokenizer
    real_encode = tok.encode
    monkeypatch.setattr(
        tok, "encode", lambda text: threads.append(threading.current_thread().name) or real_encode(text)
    )
    monkeypatch.setattr(
        service, "on_admit", lambda: calls.append((threading.current_thread().name, len(service.pools[0].loop._inbox)))
    )
    assert status_of(client, make_request(prompt="hi", max_tokens=0))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert calls == []  # refused: not admitted
    assert client.generate(make_request(prompt="hi", max_tokens=2), timeout_s=60).finish_reason
    loop_thread = tiny_server._thread.name
    assert calls == [(loop_thread, 0)]  # on the event loop, before anything was queued
    assert threads and loop_thread not in threads
