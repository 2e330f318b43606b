"""``benchmarks.mirror_cost``'s messages: the batches the real planning code makes for 8 decoding
rows have the engine's shapes and dtypes, survive the channel's pickle, and replay. The tiny
random model on one device (the benchmark itself runs SmolLM2 and two processes: not here)."""

from __future__ import annotations

import dataclasses
import pickle

import jax
import numpy as np

from benchmarks.mirror_cost import ROWS, batches_equal, record_decode_steps, replay


def test_decode_batches_have_the_engine_shapes_and_replay() -> None:
    from model.config import LlamaConfig
    from model.weights.build import random_llama
    from service.engine.config import EngineConfig
    from service.engine.runner import Runner
    from sharding.layouts import load_layout

    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, seed=0)
    ecfg = EngineConfig(num_slots=ROWS, kv_cache_tokens=ROWS * 2048)
    engine = Runner(cfg, graphdef, params, load_layout("single"), ecfg, jax.devices()[:1])
    steps = record_decode_steps(engine, prompt_len=5, decode_steps=3)
    assert len(steps) == 3 and all(ns > 0 for _, ns in steps)
    batches = [b for b, _ in steps]
    for k, b in enumerate(batches):
        assert b.decode_tokens == len(b.tokens) == ROWS and b.num_real == ROWS and b.installs == ()
        for name in ("tokens", "positions", "rows", "source"):
            assert getattr(b, name).shape == (ROWS,) and getattr(b, name).dtype == np.int32, name
        assert b.generated.dtype == np.bool_ and b.generated.all()
        assert b.page_tables.shape == (ROWS, engine.geometry.max_pages) == (ROWS, 2048 // 16)
        assert b.page_tables.dtype == np.int32 and b.last_index.dtype == np.int32
        assert sorted(b.rows.tolist()) == list(range(ROWS))
        assert (b.positions == 5 + k).all() and b.max_position == 5 + k
        assert (b.source == 1).all()  # every decode id read from the previous step on the device
        assert batches_equal(pickle.loads(pickle.dumps(b, protocol=5)), b)
    assert not batches_equal(batches[0], batches[1])
    assert not batches_equal(batches[0], dataclasses.replace(batches[0], page_tables=batches[0].page_tables + 1))
    assert len(replay(engine.step, batches)) == 3
