"""Helpers shared by the test modules (``tests/`` is on ``sys.path`` under pytest):
``from helpers import free_port, held_port, status_of, full_queue, scrape, value, wait_for, cpu_flags,
penalized, get, post``."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.server.client import make_request

Samples = dict[tuple[str, frozenset], float]


PORT_BLOCK = 2500  # ports per pytest-xdist worker, from 10000 up: below the kernel's ephemeral range
_next_port = itertools.count(random.randrange(PORT_BLOCK))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago, for a server the test starts.

    Not one the kernel hands out itself (bind to port 0): those come from the ephemeral range,
    which every outgoing connection draws from too, so a client elsewhere could take the port
    before the server binds it (tests/test_drain.py once failed so). These come from a block of
    ``PORT_BLOCK`` ports below that range, one block per xdist worker, each port in turn, so
    neither another worker nor this one's earlier servers hold it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 10000 + (int(worker) if worker.isdigit() else 0) % 8 * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = base + next(_next_port) % PORT_BLOCK
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port in [{base}, {base + PORT_BLOCK})")


def job_process_env(local_devices: int = 4) -> dict[str, str]:
    """The environment of one process of a two-process jax.distributed test job: CPU JAX with
    ``local_devices`` devices, the repository importable."""
    root = str(Path(__file__).resolve().parent.parent)
    return dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={local_devices}",
        PYTHONPATH=os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])]),
    )


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 held while the block runs: bound (SO_REUSEADDR, no SO_REUSEPORT, as
    gRPC binds) and listening, as another server would hold it."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def status_of(client, req, timeout_s: float = 180.0) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    """Run a Generate request to the end; its final status code and details."""
    try:
        client.generate(req, timeout_s=timeout_s)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


@contextlib.contextmanager
def full_queue(loop, client) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """An engine loop whose waiting queue is full while the block runs.

    The loop is held in its next step (``loop.step_hook``) with one gRPC request of ``client``
    in it and ``loop.scheduler.max_queue`` more waiting beyond the free slots. When the block ends the loop is let go
    and the hook removed; after a block that did not raise, every one of those requests must have
    ended OK.
    """
    entered, release = threading.Event(), threading.Event()

    def hold(plan: object) -> None:  # the engine loop waits here: nothing leaves the queue
        entered.set()
        release.wait(60)

    # The held step has the first request in a slot; the other free slots take requests too
    # (those do not count as waiting), so as many more are sent.
    waiting = loop.scheduler.max_queue + loop.scheduler.num_slots - 1
    loop.step_hook = hold
    try:
        with ThreadPoolExecutor(1 + waiting) as pool:
            try:
                first = pool.submit(status_of, client, make_request(prompt="a", max_tokens=2), 120)
                assert entered.wait(30)
                rest = [
                    pool.submit(status_of, client, make_request(prompt="b", max_tokens=2), 120) for _ in range(waiting)
                ]
                assert wait_for(lambda: loop.queue_full() is not None, 30)
                yield
            finally:
                release.set()  # before the pool's exit waits for the requests
            assert first.result() == (grpc.StatusCode.OK, "")
            assert [f.result() for f in rest] == [(grpc.StatusCode.OK, "")] * waiting
    finally:
        loop.step_hook = None


def post(port: int, path: str, body: Any, timeout_s: float = 120.0) -> tuple[int, str]:
    """POST ``body`` (JSON, or bytes as they are) to 127.0.0.1:``port`` with urllib; (status,
    response text), an HTTP error status included."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def get(port: int, path: str) -> tuple[int, str]:
    """GET ``path`` on 127.0.0.1:``port``; (status, response text), an HTTP error status included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> Samples:
    """Every sample of ``http://127.0.0.1:port/metrics``: {(name, labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        body = resp.read().decode()
    out: Samples = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample of ``scrape``'s result (0.0 when absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(predicate: Callable[[], object], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` every 50 ms until it is true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return bool(predicate())


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 Linux; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def penalized(
    logits: np.ndarray,
    prompt: list[int],
    generated: list[int],
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> np.ndarray:
    """Reference penalized logits [V] float32 of one row of raw ``logits`` [V]: Hugging Face's
    ``RepetitionPenaltyLogitsProcessor`` over prompt + generated ids, then OpenAI's documented
    ``mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence`` (c: the counts of the
    generated ids) in numpy float32. Skips the test when transformers (or torch) is missing."""
    torch = pytest.importorskip("torch")
    processors = pytest.importorskip("transformers.generation.logits_process")
    input_ids = torch.tensor([list(prompt) + list(generated)])
    scores = torch.tensor(np.asarray(logits, np.float32)[None])
    mu = processors.RepetitionPenaltyLogitsProcessor(penalty=repetition)(input_ids, scores).numpy()[0]
    c = np.bincount(np.asarray(generated, np.int64), minlength=len(mu)).astype(np.float32)
    return mu - c * np.float32(frequency) - (c > 0).astype(np.float32) * np.float32(presence)


class GrpcStream:
    """A Generate stream read on its own thread: its ids, finish reason, final status code and
    details, when it ended; ``first`` is set at its first chunk (or its end)."""

    def __init__(self, client, request, timeout_s: float = 120.0):  # type: ignore[no-untyped-def]
        self.ids: list[int] = []
        self.finish_reason = 0
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at: float | None = None
        self.first = threading.Event()
        self._call = client.stream(request, timeout_s)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for resp in self._call:
                self.ids.extend(resp.token_ids)
                self.finish_reason = resp.finish_reason
                self.first.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"


def openai_client(srv: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
    """The official ``openai`` client on a ``ServerThread``'s HTTP port; no retries (it retries
    429 and 5xx by default)."""
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{srv.running.http_port}/v1", api_key="unused", max_retries=0, timeout=timeout,
        **kwargs,
    )  # fmt: skip
