"""Graceful shutdown, for real: ``python -m service.server.cli serve`` in a subprocess gets SIGTERM
mid-stream (2 slots x 256 tokens to keep start-up short). The server serves SmolLM2 from its
converted checkpoint (``smollm2_checkpoint``, shared with test_checkpoint.py): it restores in
about a second where the GGUF dequantizes for 6-13 s, and the model decodes at the real
model's pace, which the streams below rely on to be still running at SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import GrpcStream, free_port

from service.server.client import Client, make_request

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
LONG = "Count from 1 to 100 separated by spaces:"


class Served:
    """A ``meshserve serve`` subprocess and a client to it."""

    def __init__(self, model: Path, grace_s: float, log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        self._log = log_path.open("wb")
        cmd = [sys.executable, "-m", "service.server.cli", "serve", "--model", str(model), "--port", str(self.port),
               "--metrics-port", "0", "--num-slots", "2", "--max-seq-len", "256",
               "--grace-period", str(grace_s)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = Client(f"127.0.0.1:{self.port}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_serving(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the server exited with {self.proc.returncode}:\n{self.log()}"
            try:
                status = self.client.health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"not SERVING after {timeout_s} s:\n{self.log()}")

    def close(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture()
def serve(smollm2_checkpoint: Path, tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    started: list[Served] = []

    def start(grace_s: float) -> Served:
        s = Served(smollm2_checkpoint, grace_s, tmp_path / f"serve-{len(started)}.log")
        started.append(s)
        s.wait_serving()
        return s

    yield start
    for s in started:
        s.close()


def new_call_status(client: Client) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    try:
        client.generate(make_request(prompt="Hello", temperature=0.0, max_tokens=4), timeout_s=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", time.monotonic() - t0
    return grpc.StatusCode.OK, "", time.monotonic() - t0


def test_sigterm_lets_a_running_stream_finish_and_exits_0(serve) -> None:  # type: ignore[no-untyped-def]
    grace_s = 30.0
    s = serve(grace_s)
    solo = s.client.generate(make_request(prompt=LONG, temperature=0.0, max_tokens=40), timeout_s=120)
    stream = GrpcStream(s.client, make_request(prompt=LONG, temperature=0.0, max_tokens=40))
    assert stream.first.wait(60)
    s.proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()

    # While the stream drains: NOT_SERVING, and new calls are refused with UNAVAILABLE.
    status = s.client.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    code, details, took = new_call_status(s.client)
    refused = time.monotonic()
    assert code == grpc.StatusCode.UNAVAILABLE and took < 2.0, (code, details, took)
    assert "shutting down" in details

    stream.join(60)
    assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details, s.log())
    assert stream.finish_reason != 0
    assert stream.ids == solo.token_ids  # completed normally, nothing lost or added
    assert stream.ended_at is not None and stream.ended_at > refused  # the refusal came mid-stream

    rc = s.proc.wait(grace_s + 10)
    exited = time.monotonic()
    assert rc == 0, s.log()
    assert exited - signalled < grace_s + 5
    assert stream.ended_at is not None and exited - stream.ended_at < 5.0  # no idle wait for the full grace
    code, _, _ = new_call_status(s.client)
    assert code == grpc.StatusCode.UNAVAILABLE  # connection refused once it is gone
    log = s.log()
    assert "draining" in log


def test_sigterm_with_a_tiny_grace_period_cancels_a_long_stream_with_unavailable(serve) -> None:  # type: ignore[no-untyped-def]
    grace_s = 1.0
    s = serve(grace_s)
    stream = GrpcStream(s.client, make_request(prompt=LONG, temperature=0.0, max_tokens=200))
    assert stream.first.wait(60)
    os.kill(s.proc.pid, signal.SIGTERM)
    signalled = time.monotonic()
    stream.join(grace_s + 10)
    assert stream.code == grpc.StatusCode.UNAVAILABLE, (stream.code, stream.details, s.log())
    assert "shutting down" in stream.details
    assert stream.ended_at is not None and stream.ended_at - signalled < grace_s + 3
    assert 1 <= len(stream.ids) < 200
    rc = s.proc.wait(grace_s + 10)
    assert rc == 0, s.log()
    assert time.monotonic() - signalled < grace_s + 5


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_ends_the_process_at_once(smollm2_gguf: Path, tmp_path: Path, sig: int) -> None:
    """Before SERVING (the GGUF dequantizes for seconds, then the steps compile) a stop signal
    was held until warm-up finished, then drained: an orchestrator's grace period could run out
    into SIGKILL. Now the process ends by the signal as soon as it is sent."""
    s = Served(smollm2_gguf, 10.0, tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 120
        while "NOT_SERVING until warm-up is done" not in s.log():  # bound and loading
            assert s.proc.poll() is None and time.monotonic() < deadline, s.log()
            time.sleep(0.05)
        s.proc.send_signal(sig)
        signalled = time.monotonic()
        rc = s.proc.wait(30)
        assert time.monotonic() - signalled < 5.0, s.log()
        assert rc == -sig, s.log()
        log = s.log()
        assert f"{signal.Signals(sig).name} before the server was SERVING" in log and "SERVING on" not in log
    finally:
        s.close()
