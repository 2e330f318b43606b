"""The engine loop overlaps host and device work: step N+1 is dispatched before step N's ids
are read, each step makes one device-to-host copy, and the results equal an unpipelined run."""

from __future__ import annotations

import threading

import numpy as np

from model.config import LlamaConfig
from model.weights.loader import random_llama
from service import engine as engine_module
from service.engine import Engine, EngineConfig
from service.loop import EngineLoop
from service.engine.request import Chunk, Request, SamplingOptions
from service.scheduler import Scheduler
from service.engine.text_stream import TextStream
from sharding.layouts import Layout

CFG = LlamaConfig.tiny()


class Pieces:
    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


def run(prompts: list[list[int]], max_tokens: int, pipelined: bool) -> tuple[list[list[int]], list[str]]:
    graphdef, params = random_llama(CFG, seed=3)
    engine = Engine(CFG, graphdef, params, Layout("1x1"), EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16))
    loop = EngineLoop(engine, Scheduler(num_slots=2, max_queue=8, chunk_size=16))
    events: list[str] = []
    original_host = engine_module.StepOutput.host
    original_dispatch = loop.dispatch

    def host(self):  # type: ignore[no-untyped-def]
        events.append("host")
        return original_host(self)

    def dispatch(plan):  # type: ignore[no-untyped-def]
        events.append("dispatch")
        return original_dispatch(plan)

    engine_module.StepOutput.host = host  # type: ignore[method-assign]
    loop.dispatch = dispatch  # type: ignore[method-assign]
    done = threading.Event()
    outputs: list[list[int]] = [[] for _ in prompts]
    finished = [0]

    def emit_for(i: int):  # type: ignore[no-untyped-def]
        def emit(chunk: Chunk) -> None:
            outputs[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                finished[0] += 1
                if finished[0] == len(prompts):
                    done.set()

        return emit

    try:
        requests = [
            Request(
                request_id=str(i),
                prompt_ids=p,
                max_tokens=max_tokens,
                sampling=SamplingOptions(temperature=0.0),
                text=TextStream(Pieces()),
                emit=emit_for(i),
                eos_ids=frozenset(),
            )
            for i, p in enumerate(prompts)
        ]
        if pipelined:
            loop.start()
            assert loop.ready.wait(120)
            events.clear()
            for r in requests:
                loop.submit(r)
            assert done.wait(120)
            loop.stop()
        else:
            engine.warmup()
            events.clear()
            for r in requests:
                loop.scheduler.waiting.append(r)
            while not done.is_set():
                loop.step(loop.scheduler.schedule())
    finally:
        engine_module.StepOutput.host = original_host  # type: ignore[method-assign]
    return outputs, events


def test_pipelined_loop_matches_the_unpipelined_one_and_overlaps() -> None:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CFG.vocab_size, n).tolist() for n in (5, 11)]
    plain, plain_events = run(prompts, 12, pipelined=False)
    piped, piped_events = run(prompts, 12, pipelined=True)
    assert piped == plain and all(len(o) == 12 for o in piped)
    # Unpipelined: every dispatch is followed by its own host copy.
    assert "dispatch,dispatch" not in ",".join(plain_events)
    # Pipelined: a step is dispatched while the previous one's ids are still on the device,
    # and each step costs exactly one host copy.
    assert "dispatch,dispatch" not in ",".join(piped_events[:1])
    assert ",".join(piped_events).count("dispatch,host") >= 5
    assert piped_events.count("host") == piped_events.count("dispatch")
    first_host = piped_events.index("host")
    assert piped_events[:first_host].count("dispatch") == 2  # step 1 dispatched before step 0 was read


def test_nothing_compiles_after_warmup() -> None:
    """After ``Engine.warmup`` the serving loop reuses the warm programs: its decode steps pass
    the previous step's device outputs, and the warm-up's "no previous step" stand-ins have the
    same argument signature (a numpy stand-in once made the loop's first steps compile again,
    5.7 s for SmolLM2 in unrolled mode)."""
    graphdef, params = random_llama(CFG, seed=4)
    engine = Engine(CFG, graphdef, params, Layout("1x1"), EngineConfig(num_slots=2, max_seq_len=64, chunk_size=16))
    loop = EngineLoop(engine, Scheduler(num_slots=2, max_queue=8, chunk_size=16))
    done = threading.Event()
    finished = [0]

    def emit(chunk: Chunk) -> None:
        if chunk.finish_reason is not None:
            finished[0] += 1
            if finished[0] == 2:
                done.set()

    loop.start()
    try:
        assert loop.ready.wait(120)  # the loop thread ran engine.warmup()
        compiled = programs(engine)
        assert compiled and all(n == 1 for n in compiled.values())
        rng = np.random.default_rng(1)
        for i, n in enumerate((5, 9)):
            loop.submit(
                Request(
                    request_id=str(i),
                    prompt_ids=rng.integers(0, CFG.vocab_size, n).tolist(),
                    max_tokens=10,
                    sampling=SamplingOptions(temperature=0.0),
                    text=TextStream(Pieces()),
                    emit=emit,
                    eos_ids=frozenset(),
                )
            )
        assert done.wait(120)
    finally:
        loop.stop()
    assert programs(engine) == compiled


def programs(engine: Engine) -> dict[tuple[str, int], int]:
    """How many compiled variants each jitted step holds, keyed by (step, window)."""
    out = {("decode", k): f._cache_size() for k, f in engine._decode_fns.items()}
    out.update({("prefill", k): f._cache_size() for k, f in engine._prefill_fns.items()})
    return out
