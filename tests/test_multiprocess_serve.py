"""``meshserve serve`` as a job of two processes of 4 CPU devices each (one 8-device mesh, layout
2x4, the tiny model): process 0 serves gRPC, process 1 follows (``--coordinator``,
``--num-processes``, ``--process-id``). Concurrent streams, greedy and seeded, give the ids of a
one-process server (8 CPU devices, this process) on the same layout, before and after a live
switch to 1x8 (Admin ``SetLayout``), and a stream running through the switch keeps its ids;
SIGTERM to process 0 lets a running stream finish and ends both processes with 0. A follower
killed or hung mid-stream (the job serving a converted checkpoint, restored by each process)
ends the stream with UNAVAILABLE and turns health NOT_SERVING within the documented time
(docs/multiprocess.md), and process 0 still stops on SIGTERM. A job speculating with a draft
model serves the same ids. Every process is killed with its
process group when the test ends."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from helpers import free_port, job_process_env

from benchmarks.multiprocess_channel import stop
from protos.meshserve.v1 import admin_pb2 as apb
from protos.meshserve.v1 import admin_pb2_grpc as apb_grpc
from service.engine.config import EngineConfig
from service.server.app import ServerThread
from service.server.client import Client, make_request
from service.server.config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent
LAYOUT, SWITCHED = "2x4", "1x8"
TOKEN = "job-admin-token"
AUTH = [("authorization", f"Bearer {TOKEN}")]
SLOTS, MAX_LEN, POOL = 4, 128, 512
PROCESS_TIMEOUT_S = 5.0  # serve --process-timeout: a hung follower is lost after this
WATCHDOG_S = 0.5  # serve --watchdog-interval
# Sent at once (C03-style: more streams than slots, prompts with distinct suffixes): greedy,
# seeded, seeded with top-k. The tiny model's logits are so peaked that its sampled ids equal its
# greedy ones; the penalties make them vary.
REQUESTS = (
    dict(prompt="hello world", temperature=0.0, max_tokens=24, repetition_penalty=3.0),
    dict(prompt="the quick brown fox", temperature=1.0, seed=7, max_tokens=24, frequency_penalty=1.5),
    dict(prompt="abc", temperature=1.0, top_k=20, seed=11, max_tokens=20, repetition_penalty=3.0),
    *(dict(prompt=f"count 1 2 3 #{k}", temperature=0.0, max_tokens=16, repetition_penalty=2.0) for k in range(5)),
)


class Job:
    """Two ``python -m service.server.cli serve`` processes of one job, and a client to process 0."""

    def __init__(self, model: Path, folder: Path, grace_s: float = 30.0, flags: tuple[str, ...] = ()):
        self.port, self.admin_port = free_port(), free_port()
        coordinator = f"127.0.0.1:{free_port()}"
        env = job_process_env()
        self.logs = [folder / f"process{i}.log" for i in range(2)]
        self.procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
        for i in range(2):
            cmd = [sys.executable, "-m", "service.server.cli", "serve", "--model", str(model), "--layout", LAYOUT,
                   "--port", str(self.port), "--metrics-port", "0", "--num-slots", str(SLOTS),
                   "--max-seq-len", str(MAX_LEN), "--kv-cache-tokens", str(POOL), "--grace-period", str(grace_s),
                   "--watchdog-interval", str(WATCHDOG_S), "--process-timeout", str(PROCESS_TIMEOUT_S),
                   "--admin-token", TOKEN, "--admin-port", str(self.admin_port),
                   "--coordinator", coordinator, "--num-processes", "2", "--process-id", str(i), *flags]  # fmt: skip
            with self.logs[i].open("wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        self.client = Client(f"127.0.0.1:{self.port}")

    def log(self, i: int) -> str:
        return "\n".join(s for s in self.logs[i].read_text(errors="replace").splitlines() if "[Gloo]" not in s)[-4000:]

    def health(self) -> int:
        return self.client.health.Check(health_pb2.HealthCheckRequest(), timeout=5).status

    def wait_serving(self, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, f"process {i} exited with {p.returncode}:\n{self.log(i)}"
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"not SERVING after {timeout_s} s:\n{self.log(0)}\n---\n{self.log(1)}")

    def wait_exit(self, i: int, timeout_s: float) -> int:
        try:
            return self.procs[i].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"process {i} still runs {timeout_s} s on:\n{self.log(i)}") from None

    def close(self) -> None:
        self.client.close()
        stop(self.procs)


@pytest.fixture()
def job(tiny_gguf: Path, tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    started: list[Job] = []

    def start(model: Path = tiny_gguf, flags: tuple[str, ...] = ()) -> Job:
        j = Job(model, tmp_path / f"job{len(started)}", flags=flags)
        started.append(j)
        j.wait_serving()
        return j

    for i in range(2):
        (tmp_path / f"job{i}").mkdir()
    yield start
    for j in started:
        j.close()


def concurrent_ids(client: Client) -> list[list[int]]:
    """``REQUESTS``, all at once; each one's ids (the chunks' ids in the order they came)."""
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        results = pool.map(lambda r: client.generate(make_request(**r), timeout_s=120), REQUESTS)
        return [r.token_ids for r in results]


LONG = dict(prompt="hello world", temperature=0.0, max_tokens=100, repetition_penalty=3.0)


class Stream:
    """A long greedy Generate (``LONG``) on its own thread: ids, final status code and when it
    ended; ``started`` is set after its fourth id."""

    def __init__(self, client: Client):
        self.ids: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.ended_at = 0.0
        self.started = threading.Event()
        self._call = client.stream(make_request(**LONG), 120)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for resp in self._call:
                self.ids.extend(resp.token_ids)
                if len(self.ids) >= 4:
                    self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code, self.details = exc.code(), exc.details() or ""
        self.ended_at = time.monotonic()
        self.started.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"


def one_process_ids(model: Path) -> tuple[list[list[int]], list[int]]:
    """``REQUESTS``' ids and ``LONG``'s on one process (8 devices) on ``LAYOUT``."""
    ecfg = EngineConfig(num_slots=SLOTS, max_seq_len=MAX_LEN, kv_cache_tokens=POOL)
    cfg = ServerConfig(model=str(model), port=0, metrics_port=0, layout=LAYOUT, engine=ecfg)
    srv = ServerThread(cfg).start()
    try:
        client = Client(srv.address)
        try:
            return concurrent_ids(client), client.generate(make_request(**LONG), timeout_s=120).token_ids
        finally:
            client.close()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def one_process(tiny_gguf: Path) -> tuple[list[list[int]], list[int]]:
    """``one_process_ids`` of the tiny model, once for the module's tests."""
    return one_process_ids(tiny_gguf)


def test_two_processes_serve_one_process_ids_and_sigterm_drains_both(job, one_process) -> None:  # type: ignore[no-untyped-def]
    j = job()
    info = j.client.model_info()
    assert info.layout == LAYOUT and info.kv_cache_tokens == POOL
    got = concurrent_ids(j.client)
    want, want_long = one_process
    assert all(len(set(ids)) > 1 for ids in want[:3]), want  # the penalties make the first three vary
    assert got == want

    # A live switch across both processes, with a stream running through it.
    through = Stream(j.client)
    assert through.started.wait(60)
    with grpc.insecure_channel(f"127.0.0.1:{j.admin_port}") as channel:
        switched = apb_grpc.AdminStub(channel).SetLayout(
            apb.SetLayoutRequest(layout=SWITCHED), metadata=AUTH, timeout=300
        )
    assert through.code is None  # still running: the loop switched between two of its steps
    assert switched.name == SWITCHED and j.client.model_info().layout == SWITCHED
    through.join(90)
    assert through.code == grpc.StatusCode.OK, (through.code, through.details)
    assert through.ids == want_long
    assert concurrent_ids(j.client) == want  # layouts serve the same ids

    stream = Stream(j.client)
    assert stream.started.wait(60)
    j.procs[0].send_signal(signal.SIGTERM)
    stream.join(90)
    assert stream.code == grpc.StatusCode.OK and len(stream.ids) == 100, (stream.code, stream.details)
    assert j.wait_exit(0, 60) == 0
    assert j.wait_exit(1, 30) == 0, j.log(1)
    assert "process 0 ended the job after" in j.log(1)


def test_a_job_speculating_with_a_draft_model_serves_the_ids_of_one_process_without(
    job, tiny_gguf: Path, one_process
) -> None:  # type: ignore[no-untyped-def]
    """``--speculative draft:MODEL`` over two processes (the tiny model drafting for itself):
    the draft runner's calls are mirrored to the follower's draft runner, drafts are kept, and
    the ids equal a one-process server's without speculation, before and after a live switch
    (the draft model stays on the layout it started on)."""
    j = job(flags=("--speculative", f"draft:{tiny_gguf}", "--speculative-tokens", "3"))
    want, _ = one_process
    assert concurrent_ids(j.client) == want
    plain: dict[str, Any] = dict(
        prompt="count 1 2 3", temperature=0.0, max_tokens=24
    )  # no penalty: the draft's argmax is kept
    last = list(j.client.stream(make_request(**plain), timeout_s=120))[-1]
    assert last.usage.accepted_draft_tokens > 0
    with grpc.insecure_channel(f"127.0.0.1:{j.admin_port}") as channel:
        apb_grpc.AdminStub(channel).SetLayout(apb.SetLayoutRequest(layout=SWITCHED), metadata=AUTH, timeout=300)
    assert concurrent_ids(j.client) == want
    j.procs[0].send_signal(signal.SIGTERM)
    assert j.wait_exit(0, 60) == 0
    assert j.wait_exit(1, 30) == 0, j.log(1)


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_follower_lost_mid_stream_ends_the_stream_unavailable(
    job, tiny_gguf: Path, tmp_path: Path, fault: str
) -> None:  # type: ignore[no-untyped-def]
    """``kill -9`` of process 1 (its connection closes: seen at once) or ``kill -STOP`` (it hangs:
    seen when no heartbeat came for ``--process-timeout``)."""
    # Served from a converted checkpoint: each process restores it (orbax) into the job's shardings.
    from service.server.cli import main

    checkpoint = tmp_path / "tiny-checkpoint"
    assert main(["convert", str(tiny_gguf), str(checkpoint)]) == 0
    j = job(checkpoint)
    assert j.client.model_info().model_path == str(checkpoint)
    stream = Stream(j.client)
    assert stream.started.wait(60)
    j.procs[1].send_signal(signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    lost = time.monotonic()
    stream.join(60)
    assert stream.code == grpc.StatusCode.UNAVAILABLE, (stream.code, stream.details, len(stream.ids))
    # The documented bound: --process-timeout (a hang) + the watchdog's interval, with slack.
    assert stream.ended_at - lost < PROCESS_TIMEOUT_S + 2 * WATCHDOG_S + 2.0
    if fault == "hung":
        assert "sent no heartbeat" in stream.details
    deadline = time.monotonic() + 2 * WATCHDOG_S + 2.0
    while j.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline, "still SERVING with a follower gone"
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as refused:
        j.client.generate(make_request(prompt="hi", max_tokens=2), timeout_s=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    j.procs[0].send_signal(signal.SIGTERM)
    assert j.wait_exit(0, 30) == 1  # the job broke: a process manager sees a failure
    assert "the job broke: process 1" in j.log(0)


def test_a_config_the_job_cannot_run_is_refused_before_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Several pools or a layout without every process's devices, over several
    processes: a clear error on process 0 (checked before the channel opens; its followers then
    see process 0 go and exit). The same layout rule refuses a live switch (Admin)."""
    import jax

    from service.engine.distributed import job_layout_problem
    from service.server.config import ConfigError
    from service.server.startup import check_job
    from sharding.layouts import load_layout

    assert job_layout_problem(load_layout("single")) is None  # one process: any layout
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # as in a job of 2 x 4 devices
    monkeypatch.setattr(jax, "device_count", lambda: 8)
    assert job_layout_problem(load_layout("2x4")) is None
    assert "uses 1 devices; a job over 2 processes serves on all of its 8" in str(
        job_layout_problem(load_layout("single"))
    )
    with pytest.raises(ConfigError, match="uses 4 devices"):
        check_job(ServerConfig(layout="1x4"))
    with pytest.raises(ConfigError, match="uses 2 devices"):
        check_job(ServerConfig(pools=["p=1x2"]))
    check_job(ServerConfig(layout="8x1"))
    with pytest.raises(ConfigError, match="one pool"):
        check_job(dataclasses.replace(ServerConfig(), pools=["a=single", "b=single"]))


def test_serve_distributed_with_nothing_to_join_is_one_clear_error() -> None:
    """``--distributed`` where JAX detects no cluster and no ``JAX_COORDINATOR_ADDRESS`` is set:
    exit 1 with one line, no traceback, no hang."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "SLURM_", "OMPI_"))}
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "service.server.cli", "serve", "--distributed", "--port", "0", "--metrics-port", "0"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "meshserve serve: error: could not join the job:" in done.stderr
    assert "Traceback" not in done.stderr
