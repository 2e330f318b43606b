"""The engine through its loop on the tiny random model, against the whole-sequence reference
(``reference.reference``: one dense forward per generated id, no cache): several prompts per
step, page sizes, prefix hits, preemption, penalties, seeded sampling, cancellation, both
attention backends, both matmul forms, both layer loops and layouts all give the reference's
ids."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from reference import (
    CFG,
    CHUNK,
    GRAPHDEF,
    PARAMS,
    PROMPT_A,
    PROMPT_B,
    PROMPT_C,
    N,
    make,
    reference,
    run,
    run_across_switch,
    tiny_loop,
)  # fmt: skip

from model.attention import cpu as cpu_attention
from model.native import cpu_matmul
from service.engine.batch import RaggedBatch, RowInstall
from service.engine.config import EngineConfig
from service.engine.loop import EngineLoop, make_loop
from service.engine.request import FinishReason, SamplingOptions
from service.engine.runner import Runner
from sharding.layouts import Layout

NATIVE = jax.devices()[0].platform == "cpu"


@pytest.fixture(scope="module")
def loop() -> Iterator[EngineLoop]:
    loop = tiny_loop()
    loop.start()
    assert loop.ready.wait(600)
    yield loop
    loop.stop()


@pytest.fixture(scope="module")
def refs() -> dict[str, tuple[list[int], FinishReason]]:
    return {name: reference(p, N) for name, p in (("A", PROMPT_A), ("B", PROMPT_B), ("C", PROMPT_C))}


def prompt_batch(runner: Runner, ids: list[int]) -> RaggedBatch:
    """``ids`` as row 0's first and only chunk over pages 0, 1, ... (a fresh pool's), sampling
    greedily at its last token: the flat batch the loop builds for a prompt at an idle server."""
    g = runner.geometry
    n, D = len(ids), g.mixed_decode_buckets[0]
    b = g.empty_batch(D, g.prefill_bucket(g.padded(n)))
    b.tokens[D : D + n], b.positions[D : D + n], b.rows[D : D + n] = ids, np.arange(n), 0
    b.last_index[0] = D + n - 1
    b.page_tables[0] = np.arange(g.max_pages) % runner.pages_per_replica
    greedy = RowInstall(0, SamplingOptions(temperature=0.0), False, ())
    return dataclasses.replace(b, num_real=n, max_position=n - 1, installs=(greedy,))


def test_prompts_batched_in_one_step_give_each_ones_solo_ids(loop: EngineLoop, refs: dict) -> None:
    got = run(loop, [make(PROMPT_A, N), make(PROMPT_B, N), make(PROMPT_C, N)])
    assert got == [refs["A"], refs["B"], refs["C"]]
    assert run(loop, [make(PROMPT_C, N)]) == [refs["C"]]


def test_several_prompts_really_share_steps(loop: EngineLoop) -> None:
    seen: list[int] = []
    loop.on_step = lambda plan, seconds: seen.append(len(plan.prefills))
    try:
        run(loop, [make(PROMPT_B, 2), make(PROMPT_B[:5], 2), make(PROMPT_A[:6], 2)])
    finally:
        loop.on_step = None
    assert max(seen) >= 2


def test_a_prefix_hit_gives_the_same_ids(loop: EngineLoop, refs: dict) -> None:
    blocks = loop.scheduler.pools[0]
    assert run(loop, [make(PROMPT_C, N)]) == [refs["C"]]  # cached now, whatever ran before
    before = blocks.hit_tokens
    assert run(loop, [make(PROMPT_C, N)]) == [refs["C"]]
    assert blocks.hit_tokens - before >= 32  # the 8 full pages of its 33-token prompt
    miss = make(PROMPT_C, N)
    miss.prefix_cache = False
    before = blocks.hit_tokens
    assert run(loop, [miss]) == [refs["C"]] and blocks.hit_tokens == before


def test_pages_go_back_when_requests_end_or_are_cancelled(loop: EngineLoop) -> None:
    blocks = loop.scheduler.pools[0]
    r = make(PROMPT_A, 40)
    first, release = threading.Event(), threading.Event()

    def emit(chunk: object) -> None:  # on the loop thread: holding it here holds the loop
        if not first.is_set():
            first.set()
            release.wait(60)

    r.emit = emit
    loop.submit(r)
    assert first.wait(120)
    assert blocks.num_used > 0 and loop.scheduler.active_slots == 1
    r.cancel()
    release.set()
    deadline = threading.Event()
    for _ in range(100):
        if blocks.num_used == 0 and loop.scheduler.active_slots == 0:
            break
        deadline.wait(0.05)
    assert blocks.num_used == 0 and loop.scheduler.active_slots == 0 and r.finish_reason is FinishReason.CANCELLED


def ids_of_a_and_c(loop: EngineLoop) -> list:
    """Start ``loop``, run prompts A and C to N ids each on it, stop it: their (ids, finish)."""
    loop.start()
    try:
        assert loop.ready.wait(600)
        return run(loop, [make(PROMPT_A, N), make(PROMPT_C, N)])
    finally:
        loop.stop()


def test_attention_by_xla_or_the_native_kernels_gives_the_same_ids(loop: EngineLoop, refs: dict) -> None:
    """The module's loop attends through the native CPU kernels where they are built (both
    regions: ``model.attention.cpu``); ``attention="xla"`` keeps XLA's path: both give the
    reference's ids."""
    assert loop.runner.kernels.attention.native is (NATIVE and cpu_attention.available())
    xla = tiny_loop(attention="xla")
    assert not xla.runner.kernels.attention.native
    assert ids_of_a_and_c(xla) == [refs["A"], refs["C"]]


def test_float32_matmuls_by_the_native_panels_or_xla_give_the_same_ids(loop: EngineLoop, refs: dict) -> None:
    """On one CPU device with the kernels built, the float32 layer matmuls and the LM head run
    through the native panel kernel, the weights held packed in place of the arrays (a tied
    model gains a packed head beside its table); ``matmul="xla"`` keeps the arrays and XLA's
    dots: both give the reference's ids, and one prefill step's logits agree to float32
    rounding."""
    native = cpu_matmul.available() and NATIVE
    model = loop.runner.params
    packed = {
        name
        for name in ("wqkv", "wo", "w_gate_up", "w_down")
        if isinstance(model["layers"][name].get_value(), cpu_matmul.Panels)
    }
    assert packed == ({"wqkv", "wo", "w_gate_up", "w_down"} if native else set())
    assert ("lm_head" in model) is native  # tiny is tied: the packed head is the one extra parameter
    if native:
        wqkv = model["layers"]["wqkv"].get_value()
        assert wqkv.data.shape[:2] == (CFG.num_layers, CFG.num_kv_heads * (CFG.q_per_kv + 2) * CFG.head_dim // 32)
    xla = tiny_loop(matmul="xla")
    assert not any(
        isinstance(v, cpu_matmul.Panels)
        for v in jax.tree.leaves(xla.runner.params, is_leaf=lambda x: isinstance(x, cpu_matmul.Panels))
    )
    assert ids_of_a_and_c(xla) == [refs["A"], refs["C"]]
    # One prompt's step on fresh runners of each kind (the module's loop owns its runner).
    fresh = [tiny_loop(matmul=m).runner for m in ("xla", "auto")]
    logits = [r.step(prompt_batch(r, PROMPT_A[:8])).row_logits(0) for r in fresh]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_the_unrolled_layer_loop_gives_the_same_ids(refs: dict) -> None:
    """``layer_loop="unrolled"`` (per-layer weights, the accelerators' form) serves the
    reference's ids on CPU too."""
    unrolled = tiny_loop(layer_loop="unrolled")
    assert (
        unrolled.runner.ecfg.layer_loop == "unrolled"
        and unrolled.runner.params["layers"]["wqkv"].get_value().__class__ is tuple
    )
    assert ids_of_a_and_c(unrolled) == [refs["A"], refs["C"]]


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_sizes_give_the_same_ids(page_size: int, refs: dict) -> None:
    loop = tiny_loop(page_size=page_size)
    loop.start()
    try:
        assert loop.ready.wait(600)
        assert run(loop, [make(PROMPT_A, N), make(PROMPT_C, N)]) == [refs["A"], refs["C"]]
    finally:
        loop.stop()


def test_a_pool_too_small_preempts_and_the_ids_stay_the_reference(refs: dict) -> None:
    # 3 sequences of up to 33 + 12 tokens in 72 positions: they cannot all hold their pages.
    loop = tiny_loop(num_slots=3, kv_cache_tokens=72)
    loop.start()
    try:
        assert loop.ready.wait(600)
        got = run(loop, [make(PROMPT_A, N), make(PROMPT_C, N), make(PROMPT_B, N)])
        assert loop.scheduler.preemptions >= 1
        assert got == [refs["A"], refs["C"], refs["B"]]
        # Penalties survive a recomputation: the history row is rebuilt from the streamed ids.
        kw = dict(repetition_penalty=2.0, frequency_penalty=0.5)
        before = loop.scheduler.preemptions
        got = run(loop, [make(PROMPT_A, N, **kw), make(PROMPT_C, N, **kw), make(PROMPT_B, N, **kw)])
        assert loop.scheduler.preemptions > before
        assert got == [reference(p, N, repetition=2.0, frequency=0.5) for p in (PROMPT_A, PROMPT_C, PROMPT_B)]
        # Seeded sampling too: the draw depends on the seed and the position only.
        c = dict(temperature=0.9, seed=42, top_k=50)
        (solo,) = run(loop, [make(PROMPT_C, N, **c)])
        before = loop.scheduler.preemptions
        crowded = run(loop, [make(PROMPT_A, N), make(PROMPT_B, N), make(PROMPT_C, N, **c)])[2]
        assert crowded == solo and solo[0] != refs["C"][0]
        assert loop.scheduler.pools[0].num_used == 0
    finally:
        loop.stop()


def test_penalties_and_min_tokens_match_the_reference(loop: EngineLoop) -> None:
    a = dict(repetition_penalty=3.0)
    b = dict(frequency_penalty=0.8, presence_penalty=0.3)
    got = run(loop, [make(PROMPT_A, N, **a), make(PROMPT_B, N, **b)])
    assert got == [reference(PROMPT_A, N, repetition=3.0), reference(PROMPT_B, N, presence=0.3, frequency=0.8)]
    greedy, _ = reference(PROMPT_A, 10)
    eos = frozenset({greedy[2]})
    assert run(loop, [make(PROMPT_A, 10, eos, min_tokens=5)]) == [reference(PROMPT_A, 10, eos=eos, min_tokens=5)]


def test_tensor_parallel_layout_gives_the_same_ids(refs: dict) -> None:
    loop = tiny_loop("1x2", jax.devices()[:2])
    loop.start()
    try:
        assert loop.ready.wait(600)
        assert run(loop, [make(PROMPT_A, N), make(PROMPT_B, N)]) == [refs["A"], refs["B"]]
    finally:
        loop.stop()


def test_the_step_signature_does_not_grow_with_the_pool() -> None:
    def leaves(pool_tokens: int) -> int:
        runner = tiny_loop(kv_cache_tokens=pool_tokens).runner
        batch = runner.idle_batch((4, 16, 3))
        args = (runner.params, runner.cache, runner.history, runner._sampling(), batch)
        return len(jax.tree.leaves(args))

    assert leaves(64) == leaves(4096)


def test_warm_up_compiles_what_short_sequences_need_and_everything_when_full() -> None:
    runner = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), EngineConfig(max_seq_len=2048, attention="xla"))
    g = runner.geometry
    assert g.prefill_buckets == (0, 64, 128, 256, 512, 1024) and g.window_buckets == (8, 16, 32, 64, 128)
    # 4 rows: decode-only steps of 1, 2 or 4 rows, and one decode region of 4 beside prefill chunks.
    assert g.decode_buckets == (1, 2, 4) and g.mixed_decode_buckets == (4,)
    assert runner.warm_programs() == [
        (1, 0, 8),
        (2, 0, 8),
        (4, 0, 8),
        (4, 64, 8),
        (4, 128, 8),
        (4, 256, 8),
        (4, 512, 8),
        (4, 1024, 8),
        (1, 0, 16),
        (1, 0, 32),
        (2, 0, 16),
        (2, 0, 32),
        (4, 0, 16),
        (4, 0, 32),
        (1, 0, 128),  # the largest window: a compiled program holds every batch
        (2, 0, 128),
        (4, 0, 128),
        (4, 1024, 128),
    ]
    assert len(runner.warm_programs(full=True)) == 3 * 5 + 5 * 5  # decode-only, and 4 rows beside 5 regions
    # The native kernels read pages up to each token's position: one window, so one program per
    # pair of regions, whatever the positions.
    native = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), EngineConfig(max_seq_len=2048))
    if native.kernels.attention.native:
        assert native.geometry.window_buckets == (128,)
        assert native.warm_programs() == [(1, 0, 128), (2, 0, 128)] + [
            (4, p, 128) for p in (0, 64, 128, 256, 512, 1024)
        ]
        assert len(native.warm_programs(full=True)) == 8
        native.step(native.idle_batch((4, 0, 128))).host()
        assert list(native._programs) == [(4, 0, 128)]
    many = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), EngineConfig(num_slots=64, max_seq_len=2048, attention="xla"))
    assert many.geometry.decode_buckets == (1, 2, 4, 8, 16, 32, 64)
    assert many.geometry.mixed_decode_buckets == (8, 16, 32, 64)
    assert len(many.warm_programs()) == 7 + 4 * 5 + 7 * 2 + 7 + 1
    # 2 rows, chunks of 32: no step holds more than 64 prefill tokens, whatever the budget.
    small = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), EngineConfig(num_slots=2, max_seq_len=128, chunk_size=32))
    assert small.geometry.prefill_buckets == (0, 32, 64)
    # Sequences of at most 100 tokens: no chunk is longer, so 4 rows fill at most 4 x 128 padded.
    short = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), EngineConfig(max_seq_len=100, attention="xla"))
    assert short.geometry.prefill_buckets == (0, 64, 128, 256, 512)


@pytest.mark.parametrize("max_seq_len", [14, 60])
def test_a_limit_that_is_not_whole_pages_warms_up_and_serves_to_its_end(max_seq_len: int) -> None:
    """``max_seq_len`` 60 with 16-position pages: the largest window's last page reaches past
    the limit, and warm-up ran a step there (it failed: "position 63 past max_seq_len 60"; so
    did ``serve --max-seq-len 100``)."""
    ecfg = EngineConfig(num_slots=2, max_seq_len=max_seq_len, chunk_size=8, attention="xla")
    loop = make_loop(Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), ecfg), max_queue=4)
    loop.start()
    try:
        assert loop.ready.wait(600), loop.error
        prompt = PROMPT_A[:9]
        ((ids, reason),) = run(loop, [make(prompt, max_seq_len - len(prompt))])
        assert len(ids) == max_seq_len - len(prompt) and reason == FinishReason.LENGTH
        assert (ids, reason) == reference(prompt, max_seq_len - len(prompt))
    finally:
        loop.stop()


def test_a_replacing_runner_compiles_what_the_old_one_used(caplog: pytest.LogCaptureFixture) -> None:
    """A live switch's new runner warms the short-sequence programs and every program the old
    runner compiled (a long window here), not all of them. A program first needed after
    warm-up compiles in the background, logged once, while its steps run in a larger one."""
    ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=CHUNK, page_size=4, max_num_batched_tokens=32,
                        attention="xla")  # fmt: skip
    old = Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), ecfg)
    assert not old.warmed
    old.warmup()
    assert old.warmed
    g = old.geometry
    long = (
        g.mixed_decode_buckets[0],
        g.prefill_buckets[1],
        g.window_buckets[-1],
    )  # a chunk's token at the last position
    assert long not in old._programs
    with caplog.at_level(logging.INFO, logger="service.engine.runner"):
        old.step(old.idle_batch(long)).host()  # in a larger program, while its own compiles
        future = old._compiling.get(long)
        if future is not None:
            future.result(timeout=300)
        old.step(old.idle_batch(long)).host()  # in its own
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("compiled the ragged-step")]
    assert len(compiled) == 1 and compiled[0].startswith(
        f"compiled the ragged-step program for {long[0]} decode + {long[1]} prefill tokens over {long[2]} pages "
        "off the steps' path"
    )
    assert (old.compiles.ahead, old.compiles.in_step, old.compiles.widened_steps) == (1, 0, 1)
    used = set(old._programs)
    assert len(used) == len(old.warm_programs()) + 1
    new = old.relayout(Layout("1x1"), jax.devices()[:1])
    assert new.compiles is old.compiles  # the metrics count across switches
    cache, history = new.cache, new.history
    new.warmup_to_replace(old)
    assert set(new._programs) == used and old.compiles.ahead == 1 + len(used)
    assert len(used) < len(new.warm_programs(full=True))
    # Compiled only, nothing run (a step donates the pool and the history, and replaces them):
    # the old runner keeps stepping on these devices meanwhile.
    assert new.cache is cache and new.history is history
    new.step(new.idle_batch(long)).host()
    assert not new._compiling and (new.compiles.in_step, new.compiles.widened_steps) == (0, 1)
    assert new.cache is not cache and set(new._programs) == used


def test_data_replicas_serve_the_reference_ids_from_their_own_pools(refs: dict) -> None:
    """A 2x1 layout: two replicas of 2 rows, each with its own pool of 48 positions (12 pages):
    requests spread over both, a replica short of pages preempts its own newest sequence
    only, a prefix cached in one replica is found there, and the ids are the reference's."""
    loop = tiny_loop("2x1", jax.devices()[:2], kv_cache_tokens=96)
    runner, sched = loop.runner, loop.scheduler
    assert runner.replicas == 2 and runner.pages_per_replica == 12 and [b.num_pages for b in sched.pools] == [12, 12]
    assert runner.max_request_tokens == 48
    replicas_seen: set[int] = set()
    loop.on_step = lambda plan, seconds: replicas_seen.update(runner.geometry.replica_of(t.slot) for t in plan.decode)
    loop.start()
    try:
        assert loop.ready.wait(600)
        # A and B land in replica 0 (20 + 12 and 7 + 12 tokens: 13 pages of its 12), C in replica 1.
        got = run(loop, [make(PROMPT_A, N), make(PROMPT_C, N), make(PROMPT_B, N)])
        assert got == [refs["A"], refs["C"], refs["B"]]
        assert replicas_seen == {0, 1} and sched.preemptions >= 1
        _, hits = sched.prefix_tokens()
        assert run(loop, [make(PROMPT_C, N)]) == [refs["C"]]
        assert sched.prefix_tokens()[1] - hits >= 32  # C's 8 full pages, in the replica that cached them
        assert sched.page_counts()["used"] == 0
    finally:
        loop.stop()


def test_a_switch_to_another_number_of_replicas_mid_stream_keeps_the_ids() -> None:
    """2x1 -> 1x1 with streams in flight: the pools are re-partitioned (every sequence
    recomputed over its prompt and streamed ids), and each stream's ids are the reference's."""
    loop = tiny_loop("2x1", jax.devices()[:2])
    # Built and warmed before the streams start, so that the switch lands while they run.
    new = loop.runner.relayout(Layout("1x1"), jax.devices()[:1])
    new.warmup_to_replace(loop.runner)
    loop.start()
    try:
        assert loop.ready.wait(600)
        prompts, lengths = [PROMPT_A, PROMPT_C, PROMPT_B], [40, 24, 40]
        requests = [make(p, n) for p, n in zip(prompts, lengths, strict=True)]
        ids = run_across_switch(loop, new, requests)  # 40 ids at 20 ms each: the switch lands mid-stream
        assert len(loop.scheduler.pools) == 1
        assert sum(r.preemptions for r in requests) >= 2  # recomputed at the switch
        assert ids == [reference(p, n)[0] for p, n in zip(prompts, lengths, strict=True)]
        assert loop.scheduler.page_counts()["used"] == 0
    finally:
        loop.stop()


def test_a_replacing_runner_with_fewer_replicas_warms_the_merged_regions() -> None:
    """2x1 -> 1x1: a program of the old runner (each replica's region 2 decode + 32 prefill
    tokens) maps to this runner's buckets as it is and with both replicas' tokens in one region."""
    old = tiny_loop("2x1", jax.devices()[:2], max_num_batched_tokens=64, attention="xla").runner
    new = tiny_loop(max_num_batched_tokens=64, attention="xla").runner
    assert old.geometry.prefill_buckets == (0, 16, 32) and new.geometry.prefill_buckets == (0, 16, 32, 64)
    old._programs[(2, 32, 16)] = None  # as if compiled (16 pages: the one window of 64 positions)
    assert new.replacement_programs(old) == [(4, 32, 16), (4, 64, 16)]
    assert old.replacement_programs(new) == []
