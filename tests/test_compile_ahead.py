"""No step waits for a compile after warm-up (issue "The served path", point 4): a step whose
program is not compiled runs in a larger compiled one (``Geometry.widen``) while its own
compiles on a background thread (``Runner.compile_ahead``); ``Runner.compiles`` counts both.
Checked against the dense reference (``tests/reference.py``), not against the engine."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
from reference import CFG, CHUNK, GRAPHDEF, PARAMS, PROMPT_A, PROMPT_B, make, reference, run, tiny_loop

from service.engine.batch import Geometry, RowInstall
from service.engine.config import EngineConfig
from service.engine.request import FinishReason, SamplingOptions
from service.engine.runner import Runner
from sharding.layouts import Layout

GREEDY = SamplingOptions(temperature=0.0)


def wait_for_background_compiles(runner: Runner, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while runner._compiling and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not runner._compiling


def test_widen_keeps_every_token_in_its_region_and_part() -> None:
    g = Geometry.make(8, 2, 4, 256, 16, 32, [8, 16, 32, 64])
    assert g.mixed_decode_buckets == (4,) and g.prefill_buckets == (0, 16, 32)
    b = g.empty_batch(4, 16)  # two regions of 4 decode + 16 prefill tokens
    n = 20
    # Replica 0: a decode token of row 1, a chunk of row 2; replica 1: decode tokens of rows 4 and 6.
    for i, row, pos, tok in ((0, 1, 9, 11), (4, 2, 0, 12), (5, 2, 1, 13), (n, 4, 40, 14), (n + 1, 6, 7, 15)):
        b.tokens[i], b.rows[i], b.positions[i] = tok, row, pos
    b.generated[[0, n, n + 1]] = True
    b.source[n] = 1
    b.last_index[[1, 2, 4, 6]] = [0, 5, n, n + 1]
    b = dataclasses.replace(b, num_real=5, max_position=40)

    wide = g.widen(b, 4, 32, 64)
    n2 = 36
    assert len(wide.tokens) == 2 * n2 and wide.decode_tokens == 4 and wide.window_pages == 64
    for old, new in ((0, 0), (4, 4), (5, 5), (n, n2), (n + 1, n2 + 1)):
        for name in ("tokens", "rows", "positions", "source", "generated"):
            assert getattr(wide, name)[new] == getattr(b, name)[old], (name, old)
    assert (wide.positions >= 0).sum() == 5
    assert list(wide.last_index[[1, 2, 4, 6]]) == [0, 5, n2, n2 + 1]
    assert wide.last_index[0] == 0 and wide.last_index[5] == n2  # rows sampling nothing: their region's first
    # A token mask (one per sampling slot) follows its slots: each row's mask is the same after.
    rows, _ = g.samplers(b)
    mask = np.zeros((len(rows), 8), np.int32)
    for i, row in enumerate(rows):
        mask[i] = row if row >= 0 else -1  # a row's slot holds words of its row number
    wide_rows, _ = g.samplers(dataclasses.replace(wide, token_mask=None))
    widened = g.widen(dataclasses.replace(b, token_mask=mask), 4, 32, 64).token_mask
    assert widened is not None and len(widened) == len(wide_rows) >= len(rows)
    for i, row in enumerate(wide_rows):
        assert (widened[i] == (row if row >= 0 else -1)).all(), (i, row)
    # Where the wider step has more sampling slots per replica, replica 1's move up with its region.
    g8 = Geometry.make(8, 2, 4, 256, 16, 32, [8, 16, 32, 64], verify_tokens=8)
    two = g8.empty_batch(2, 0)  # two regions of 2 decode tokens: rows 1 and 5 decode
    for i, row in ((0, 1), (2, 5)):
        two.tokens[i], two.rows[i], two.positions[i] = 3, row, 4
    two.last_index[[1, 5]] = [0, 2]
    two = dataclasses.replace(two, num_real=2, max_position=4, token_mask=np.array([[1], [-1], [5], [-1]], np.int32))
    wider = g8.widen(two, 8, 16, 8)
    assert wider.token_mask is not None and len(wider.token_mask) == 2 * 8  # 8 slots per replica, from 2
    rows_after, _ = g8.samplers(wider)
    assert [int(rows_after[i]) for i in (0, 8)] == [1, 5]
    assert [int(wider.token_mask[i, 0]) for i in (0, 8)] == [1, 5] and (wider.token_mask[[1, 9]] == -1).all()
    # Narrower than the batch, or a window short of its positions: refused.
    for regions in ((4, 0, 64), (4, 32, 8)):
        try:
            g.widen(b, *regions)
        except ValueError:
            continue
        raise AssertionError(f"widened into {regions}")


def test_a_step_in_a_wider_program_gives_the_same_logits_and_ids() -> None:
    """A prompt's chunk, then its first decode token beside another prompt's chunk: each step
    run as built and in the largest program (twice the decode region, the largest prefill
    region and window), on two runners with fresh pools."""
    ecfg = EngineConfig(num_slots=16, max_seq_len=256, chunk_size=CHUNK, page_size=4, max_num_batched_tokens=64,
                        attention="xla")  # fmt: skip
    exact, wide = (Runner(CFG, GRAPHDEF, PARAMS, Layout("1x1"), ecfg) for _ in range(2))
    g = exact.geometry
    assert g.mixed_decode_buckets == (8, 16) and g.prefill_buckets[-1] == 64 and g.window_buckets[-1] == 64
    largest = (16, 64, 64)

    first = g.empty_batch(8, 32)
    a = len(PROMPT_A)
    first.tokens[8 : 8 + a], first.positions[8 : 8 + a], first.rows[8 : 8 + a] = PROMPT_A, np.arange(a), 0
    first.last_index[0] = 8 + a - 1
    first.page_tables[0, :8], first.page_tables[1, :8] = np.arange(8), np.arange(8, 16)
    first = dataclasses.replace(first, num_real=a, max_position=a - 1, installs=(RowInstall(0, GREEDY, False, ()),))
    out_exact, out_wide = exact.step(first), wide.step(g.widen(first, *largest))
    ids_exact, ids_wide = out_exact.host().ids, out_wide.host().ids
    assert ids_exact[0] == ids_wide[0] == reference(PROMPT_A, 1)[0][0]
    np.testing.assert_allclose(out_wide.row_logits(0), out_exact.row_logits(0), rtol=0, atol=1e-5)

    second = g.empty_batch(8, 16)
    bn = len(PROMPT_B)
    second.tokens[0], second.positions[0], second.rows[0], second.generated[0] = ids_exact[0], a, 0, True
    second.tokens[8 : 8 + bn], second.positions[8 : 8 + bn], second.rows[8 : 8 + bn] = PROMPT_B, np.arange(bn), 1
    second.last_index[0], second.last_index[1] = 0, 8 + bn - 1
    second.page_tables[:] = first.page_tables
    second = dataclasses.replace(second, num_real=1 + bn, max_position=a, installs=(RowInstall(1, GREEDY, False, ()),))
    out_exact, out_wide = exact.step(second), wide.step(g.widen(second, *largest))
    assert list(out_exact.host().ids[:2]) == list(out_wide.host().ids[:2])
    assert out_exact.host().ids[0] == reference(PROMPT_A, 2)[0][1]
    assert out_exact.host().ids[1] == reference(PROMPT_B, 1)[0][0]
    for row in (0, 1):
        np.testing.assert_allclose(out_wide.row_logits(row), out_exact.row_logits(row), rtol=0, atol=1e-5)


def test_no_step_waits_for_a_compile_after_warm_up() -> None:
    """A 600-token prompt on the XLA attention backend: its chunks past the first window need
    programs warm-up did not compile (a prefill chunk at every window). They run in the
    largest compiled program while theirs compile in the background; the ids are the
    reference's, no step compiled, and the new programs are in for the next request."""
    loop = tiny_loop(max_seq_len=1024, attention="xla")
    runner = loop.runner
    g = runner.geometry
    assert g.window_buckets == (32, 64, 128, 256) and g.prefill_buckets == (0, 16, 32)
    warm = runner.warm_programs()
    assert (4, 16, 256) not in warm and (4, 32, 256) in warm and (4, 0, 256) in warm
    loop.start()
    try:
        assert loop.ready.wait(600), loop.error
        prompt = (PROMPT_A * 40)[:600]
        assert run(loop, [make(prompt, 3)]) == [reference(prompt, 3)]
        counts = runner.compiles
        assert counts.in_step == 0 and counts.widened_steps > 0
        wait_for_background_compiles(runner)
        assert counts.ahead > 0
        assert (4, 16, 256) in runner._programs  # the late chunks' own program, compiled meanwhile
        widened = counts.widened_steps
        ((ids, reason),) = run(loop, [make(prompt[:590], 3)])  # no prefix hit on the last page
        assert (ids, reason) == reference(prompt[:590], 3)
        assert counts.in_step == 0 and reason == FinishReason.LENGTH
        assert counts.widened_steps == widened  # every program it needed is in now
    finally:
        loop.stop()


def test_a_longer_eos_list_recompiles_rather_than_fails() -> None:
    """A row with more EOS ids than the per-row array holds widens it, and every compiled
    program took the old shape: they are dropped and the step compiles its own (counted as a
    step that waited) instead of calling a program with arguments of another shape."""
    loop = tiny_loop(attention="xla")
    runner = loop.runner
    loop.start()
    try:
        assert loop.ready.wait(600), loop.error
        eos = frozenset(range(CFG.vocab_size - 6, CFG.vocab_size))  # six ids: wider than the four held
        assert run(loop, [make(PROMPT_A, 4, eos=eos)]) == [reference(PROMPT_A, 4, eos=eos)]
        assert runner._sp["eos_ids"].shape[1] == 8
        assert runner.compiles.in_step >= 1
        assert run(loop, [make(PROMPT_B, 4)]) == [reference(PROMPT_B, 4)]
    finally:
        loop.stop()


def test_a_single_stream_on_many_rows_steps_one_row_and_samples_one_slot() -> None:
    """64 rows, one request: its decode steps run a decode region of one row (not the eight a
    step beside prefill chunks keeps) and compute logits for one sampling slot, not 64 (the
    served single stream paid for 64 rows' LM head and sampler, then for 8 rows' layers)."""
    loop = tiny_loop(num_slots=64, kv_cache_tokens=64 * 16)
    runner = loop.runner
    g = runner.geometry
    assert g.decode_bucket(1) == 1 and g.decode_bucket(1, mixed=True) == 8
    assert g.sample_slots(1, 0) == 1 and g.sample_slots(8, 32) == 8 + 32 // g.seq_block
    seen: list[tuple[tuple[int, int, int], int]] = []
    dispatch = runner.dispatch

    def recorded(batch, prev):  # type: ignore[no-untyped-def]
        seen.append((runner._program_of(batch), len(g.samplers(batch)[0])))
        return dispatch(batch, prev)

    runner.dispatch = recorded  # type: ignore[method-assign]
    loop.start()
    try:
        assert loop.ready.wait(600), loop.error
        seen.clear()  # warm-up's steps
        assert run(loop, [make(PROMPT_A, 6)]) == [reference(PROMPT_A, 6)]
    finally:
        loop.stop()
    prefill = [(key, slots) for key, slots in seen if key[1]]
    decode = [(key, slots) for key, slots in seen if not key[1]]
    assert [key[0] for key, _ in prefill] == [8, 8]  # two chunks of 16 beside an empty decode region of 8
    assert len(decode) == 5 and all(key[0] == 1 and slots == 1 for key, slots in decode)
