"""The engine loop overlaps host and device work: step N+1 is dispatched before step N's ids
are read, each step makes one device-to-host copy, the results equal an unpipelined run's and
the dense reference's, and nothing compiles after warm-up."""

from __future__ import annotations

import threading

import numpy as np
from reference import CFG, make, reference, run, tiny_loop

from service.engine import output
from service.engine.loop import EngineLoop

PROMPTS = [np.random.default_rng(0).integers(0, CFG.vocab_size, n).tolist() for n in (5, 11)]


def traced(loop: EngineLoop, events: list[str]) -> None:
    """Record "dispatch" for each ``Runner.step`` call and "host" for each host copy."""
    step, host = loop.runner.step, output.StepOutput.host

    def traced_step(batch, prev=None):  # type: ignore[no-untyped-def]
        events.append("dispatch")
        return step(batch, prev)

    def traced_host(self):  # type: ignore[no-untyped-def]
        events.append("host")
        return host(self)

    loop.runner.step = traced_step  # type: ignore[method-assign]
    output.StepOutput.host = traced_host  # type: ignore[method-assign]


def test_pipelined_loop_matches_the_unpipelined_one_and_overlaps(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(output.StepOutput, "host", output.StepOutput.host)  # restored after the test
    # Unpipelined: each plan dispatched, then its ids read before the next plan.
    plain = tiny_loop(num_slots=2)
    plain.runner.warmup()
    plain_events: list[str] = []
    traced(plain, plain_events)
    requests = [make(p, 12) for p in PROMPTS]
    for r in requests:
        plain.scheduler.add(r)
    while any(r.finish_reason is None for r in requests):
        plan = plain.scheduler.schedule()
        if not plan.empty:
            plain.step(plan)
        plain._finish_inflight()
    unpipelined = [(r.output_ids, r.finish_reason) for r in requests]
    assert "dispatch,dispatch" not in ",".join(plain_events)
    # Pipelined: the loop thread, as it serves.
    piped = tiny_loop(num_slots=2)
    piped.start()
    assert piped.ready.wait(300)
    events: list[str] = []
    traced(piped, events)
    try:
        got = run(piped, [make(p, 12) for p in PROMPTS])
    finally:
        piped.stop()
    assert got == unpipelined == [reference(p, 12) for p in PROMPTS]
    # A step is dispatched while the previous one's ids are still on the device, and each step
    # costs exactly one host copy.
    assert ",".join(events).count("dispatch,host") >= 5
    assert events.count("host") == events.count("dispatch")
    first_host = events.index("host")
    assert events[:first_host].count("dispatch") == 2  # step 1 dispatched before step 0 was read


def test_nothing_compiles_after_warmup() -> None:
    """After warm-up the serving loop reuses the warm programs: its steps pass the previous
    step's device output, and the warm-up's "no previous step" stand-in has the same argument
    signature (a numpy stand-in once made the loop's first steps compile again; a program is
    now called as compiled, so a changed signature would fail the step instead)."""
    loop = tiny_loop(num_slots=2)
    done = threading.Event()
    finished = [0]

    def emit(chunk) -> None:  # type: ignore[no-untyped-def]
        if chunk.finish_reason is not None:
            finished[0] += 1
            if finished[0] == 2:
                done.set()

    loop.start()
    try:
        assert loop.ready.wait(300)  # the loop thread ran runner.warmup()
        compiled = dict(loop.runner._programs)
        assert compiled
        for n in (5, 9):
            r = make(PROMPTS[1][:n], 10)
            r.emit = emit
            loop.submit(r)
        assert done.wait(300)
    finally:
        loop.stop()
    assert loop.runner._programs.keys() == compiled.keys()
    assert all(loop.runner._programs[key] is program for key, program in compiled.items())
    assert finished[0] == 2 and loop.error is None
