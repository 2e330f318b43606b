"""The engine over two jax.distributed processes of 4 CPU devices each (one 8-device mesh):
process 0 drives ``service.engine.loop.make_loop`` over a ``Runner`` that mirrors its calls
(``Runner.channel``), process 1 ``follow``s (tests/mp_engine_worker.py); their greedy ids (with penalties, so they vary) and seeded ones
must be the ids this process (8 CPU devices, no jax.distributed) gives for the same requests on
the same layout: 1x8 and 8x1 here, one after the other in one job (2x4 is served through
``meshserve serve`` in tests/test_multiprocess_serve.py). Every worker has a hard timeout and is
killed with its process group when the other fails or time runs out."""

from __future__ import annotations

import dataclasses
import json
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import free_port, job_process_env
from mp_engine_worker import EXIT_NO_DISTRIBUTED, build_engine, run_requests
from reference import tiny_loop

from benchmarks.multiprocess_channel import stop
from service.engine.batch import RaggedBatch, RowInstall
from service.engine.distributed import DRAFT, DraftChannel, StepChannel, follow
from service.engine.loop import make_loop
from service.engine.output import StepOutput
from service.engine.request import SamplingOptions
from service.engine.runner import PREVIOUS, STOP

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "mp_engine_worker.py"
TIMEOUT_S = 240  # each worker's own alarm; the test waits a little longer
LAYOUTS = ("1x8", "8x1")


def two_processes(layouts: tuple[str, ...], folder: Path, speculative: str = "off") -> tuple[dict, dict]:  # type: ignore[type-arg]
    """Run the two workers on ``layouts`` in turn (``speculative``: the engine's); (process 0's
    result, process 1's)."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = job_process_env()
    out = folder / "ids.json"
    procs: list[subprocess.Popen] = []  # type: ignore[type-arg]
    try:
        for i in range(2):
            cmd = [sys.executable, str(WORKER), "--process-id", str(i), "--coordinator", coordinator,
                   "--layouts", ",".join(layouts), "--out", str(out), "--timeout", str(TIMEOUT_S),
                   "--speculative", speculative]  # fmt: skip
            with open(folder / f"out{i}.txt", "w") as o, open(folder / f"err{i}.txt", "w") as e:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e, start_new_session=True))
        end = time.monotonic() + TIMEOUT_S + 15
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            if any(p.returncode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
    finally:
        stop(procs)
    assert all(p.poll() is not None for p in procs)  # no orphans
    errs = [(folder / f"err{i}.txt").read_text(errors="replace")[-3000:] for i in range(2)]
    assert EXIT_NO_DISTRIBUTED not in codes, f"jax.distributed.initialize failed: {errs}"  # a failure, never a skip
    assert codes == [0, 0], f"workers ended {codes} (None: timed out); stderr 0:\n{errs[0]}\nstderr 1:\n{errs[1]}"
    lines = [(folder / f"out{i}.txt").read_text().splitlines() for i in range(2)]
    return json.loads(out.read_text()), json.loads([s for s in lines[1] if s.startswith("{")][-1])


def one_process(layout: str) -> list[list[int]]:
    """The same requests on the same layout over this process's 8 devices."""
    loop = make_loop(build_engine(layout), max_queue=8)
    loop.start()
    try:
        assert loop.ready.wait(300) and loop.error is None, loop.error
        return run_requests(loop)
    finally:
        loop.stop()


def test_two_processes_give_the_ids_of_one(tmp_path: Path) -> None:
    leader, follower = two_processes(LAYOUTS, tmp_path)
    for layout in LAYOUTS:
        assert follower["followed_steps"][layout] > 0, layout
        want = one_process(layout)
        assert len(set(want[0])) > 1  # the penalties make the ids vary
        assert len(set(want[3])) > 1  # sampled: the ids vary
        assert leader["ids"][layout] == want, layout


def test_two_processes_speculating_give_the_ids_of_one_without(tmp_path: Path) -> None:
    """n-gram speculation over two processes: the drafted batches are mirrored like any other,
    drafts are kept, and the ids are those one process makes without speculating."""
    leader, follower = two_processes(("1x8",), tmp_path, speculative="ngram")
    assert follower["followed_steps"]["1x8"] > 0
    assert leader["drafts_accepted"]["1x8"] > 0
    assert leader["ids"]["1x8"] == one_process("1x8")


def test_two_processes_speculating_with_a_draft_model_give_the_ids_of_one_without(tmp_path: Path) -> None:
    """A draft model over two processes: its runner's calls are mirrored on the same channel,
    tagged, to the follower's draft runner; drafts are kept and the ids are those one process
    makes without speculating."""
    leader, follower = two_processes(("1x8",), tmp_path, speculative="draft")
    assert follower["followed_steps"]["1x8"] > 0 and leader["draft_steps"] > 0
    assert leader["drafts_accepted"]["1x8"] > 0
    assert leader["ids"]["1x8"] == one_process("1x8")


# ---- the mirror's protocol, in one process (no JAX work) -------------------------------------


class FakeChannel:
    def __init__(self, inbox: list | None = None) -> None:  # type: ignore[type-arg]
        self.sent: list = []  # type: ignore[type-arg]
        self.inbox = list(inbox or [])

    def send(self, message: object) -> None:
        self.sent.append(pickle.loads(pickle.dumps(message)))  # what a follower would get

    def recv(self) -> object:
        return self.inbox.pop(0)


class FakeRunner:
    """A follower's runner: records calls; each step returns a new output that names its step."""

    def __init__(self) -> None:
        self.calls: list = []  # type: ignore[type-arg]

    def dispatch(self, batch: object, prev: object = None) -> StepOutput:
        self.calls.append(("step", batch, prev))
        return StepOutput(packed=jnp.zeros(1), logits=len(self.calls))  # type: ignore[arg-type]

    def compile_ahead(self, batch: object) -> None:
        self.calls.append(("compile_ahead", batch))

    def warmup(self, full: bool = False, also: object = ()) -> float:
        self.calls.append(("warmup", full))
        return 0.0

    def relayout(self, layout: object, devices: list, params: object = None) -> FakeRunner:  # type: ignore[type-arg]
        self.calls.append(("relayout", layout, [d.id for d in devices]))
        new = FakeRunner()
        new.calls = self.calls  # one record of both runners' calls, in order
        new.name = "new"  # type: ignore[attr-defined]
        return new

    def warmup_to_replace(self, old: object) -> float:
        self.calls.append(("warmup_to_replace", getattr(self, "name", "old"), getattr(old, "name", "old")))
        return 0.0

    def adopt_state(self, old: object) -> None:
        self.calls.append(("adopt_state", getattr(self, "name", "old"), getattr(old, "name", "old")))


def test_the_runner_sends_each_call_before_making_it_and_prev_as_a_marker() -> None:
    """Process 0's runner (a real one, ``channel`` set) sends warm-up once (not its steps),
    each step with its batch (row installs included) and the previous output as a marker; a
    follower replays them, the marker becoming its own previous output."""
    runner, channel = tiny_loop(num_slots=2).runner, FakeChannel()
    runner.channel = channel  # type: ignore[assignment]
    runner.warmup()
    g = runner.geometry
    batch = g.empty_batch(g.decode_buckets[0], 0)
    install = RowInstall(1, SamplingOptions(temperature=0.0, repetition_penalty=2.0), False, (5,), ((1, 2), (3,)))
    first = runner.step(dataclasses.replace(batch, installs=(install,)))
    runner.step(batch, first)
    with pytest.raises(ValueError, match="past max_seq_len"):  # refused before the followers see it
        runner.step(dataclasses.replace(batch, max_position=runner.ecfg.max_seq_len))
    assert [m[0] for m in channel.sent] == ["warmup", "step", "step"]
    assert channel.sent[1][1][0].installs == (install,) and channel.sent[1][1][1] is None
    assert channel.sent[2][1][1] == PREVIOUS

    follower = FakeRunner()
    assert follow(follower, FakeChannel([*channel.sent, (STOP, (), {})])) == 2  # type: ignore[arg-type]
    assert [c[0] for c in follower.calls] == ["warmup", "step", "step"]
    assert follower.calls[2][2].logits == 2  # the output of its first step


def test_a_step_run_in_a_wider_program_is_sent_as_run_after_its_compile_ahead() -> None:
    """A step whose program is not compiled: process 0 sends ``compile_ahead`` with the batch
    as built, then the step as it runs it (in a larger program, its window in the batch), so
    a follower runs the same program whatever it has compiled itself."""
    runner, channel = tiny_loop(num_slots=2, max_seq_len=1024, attention="xla").runner, FakeChannel()
    runner.channel = channel  # type: ignore[assignment]
    runner.warmup()
    g = runner.geometry
    key = (g.decode_buckets[0], g.prefill_buckets[1], g.window_buckets[-2])
    assert key not in runner._programs
    runner.step(runner.idle_batch(key)).host()
    assert [m[0] for m in channel.sent] == ["warmup", "compile_ahead", "step"]
    built, sent = channel.sent[1][1][0], channel.sent[2][1][0]
    assert runner._program_of(built) == key
    assert runner._program_of(sent) in runner.warm_programs() and sent.window_pages == g.window_buckets[-1]

    follower = FakeRunner()
    assert follow(follower, FakeChannel([*channel.sent, (STOP, (), {})])) == 1  # type: ignore[arg-type]
    assert [c[0] for c in follower.calls] == ["warmup", "compile_ahead", "step"]
    assert follower.calls[2][1].window_pages == sent.window_pages
    runner.abandon_compiles()


def test_a_live_switch_is_mirrored_and_the_follower_steps_the_new_runner_after_it() -> None:
    import jax

    old, channel = tiny_loop(num_slots=2).runner, FakeChannel()
    old.channel = channel  # type: ignore[assignment]
    g = old.geometry
    old.step(g.empty_batch(g.decode_buckets[0], 0))
    new = old.relayout(old.layout, jax.devices()[:1])
    assert new.channel is channel
    with pytest.raises(ValueError, match="restored ones"):
        old.relayout(old.layout, jax.devices()[:1], params={})
    new.warmup_to_replace(old)
    new.adopt_state(old)
    new.step(g.empty_batch(g.decode_buckets[0], 0))
    names = [m[0] for m in channel.sent]
    assert names == ["step", "relayout", "warmup_to_replace", "adopt_state", "step"]
    assert channel.sent[1][1] == (old.layout, [jax.devices()[0].id])

    follower = FakeRunner()
    assert follow(follower, FakeChannel([*channel.sent, (STOP, (), {})])) == 2  # type: ignore[arg-type]
    assert [c[0] for c in follower.calls] == ["step", "relayout", "warmup_to_replace", "adopt_state", "step"]
    assert follower.calls[2][1:] == ("new", "old") and follower.calls[3][1:] == ("new", "old")
    assert follower.calls[4][2] is None  # the first step after a switch reads no previous output
    with pytest.raises(ValueError, match="no relayout"):
        follow(FakeRunner(), FakeChannel([("adopt_state", (), {})]))  # type: ignore[arg-type]


def test_a_draft_runners_calls_are_tagged_and_replayed_on_the_followers_draft_runner() -> None:
    """Process 0's draft model runner mirrors over ``DraftChannel``: its calls travel tagged,
    in order with the target's, and a follower makes them on its own draft runner, each
    runner's ``PREVIOUS`` its own last output (a draft step chained on the draft step before it,
    not on the target's step between)."""
    target, draft = tiny_loop(num_slots=2).runner, tiny_loop(num_slots=2).runner
    channel = FakeChannel()
    target.channel, draft.channel = channel, DraftChannel(channel)  # type: ignore[assignment,arg-type]
    g = target.geometry
    batch = g.empty_batch(g.decode_buckets[0], 0)
    d1 = draft.step(batch)
    t1 = target.step(batch)
    draft.step(batch, d1)
    target.step(batch, t1)
    assert [m[0] for m in channel.sent] == [DRAFT, "step", DRAFT, "step"]
    assert [m[1][0][0] for m in channel.sent[::2]] == ["step", "step"]

    follower, follower_draft = FakeRunner(), FakeRunner()
    inbox = [*channel.sent, (STOP, (), {})]
    assert follow(follower, FakeChannel(inbox), follower_draft) == 2  # type: ignore[arg-type]
    assert [c[0] for c in follower.calls] == ["step", "step"] == [c[0] for c in follower_draft.calls]
    assert follower.calls[1][2].logits == 1 and follower_draft.calls[1][2].logits == 1  # each its own first output
    with pytest.raises(ValueError, match="without a draft model"):
        follow(FakeRunner(), FakeChannel(inbox))  # type: ignore[arg-type]


def test_a_follower_refuses_a_call_that_is_not_mirrored() -> None:
    with pytest.raises(ValueError, match="not one of"):
        follow(FakeRunner(), FakeChannel([("replacement_programs", (), {})]))  # type: ignore[arg-type]


def test_the_step_channel_carries_a_ragged_batch_over_tcp() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    leader, follower = StepChannel([a], 0), StepChannel([b], 1)
    batch = RaggedBatch(*(np.arange(n, dtype=np.int32) for n in (8, 8, 8, 8, 8, 2, 2)),  # type: ignore[arg-type]
                        page_tables=np.ones((2, 3), np.int32), num_real=3, max_position=2, decode_tokens=4)  # fmt: skip
    try:
        leader.send(("step", (batch, PREVIOUS), {}))
        name, (got, prev), _ = follower.recv()
        assert name == "step" and prev == PREVIOUS and got.num_real == 3
        assert all(np.array_equal(getattr(got, f), getattr(batch, f)) for f in ("tokens", "page_tables"))
        leader.close()
        with pytest.raises(ConnectionError):
            follower.recv()
    finally:
        leader.close()
        follower.close()
