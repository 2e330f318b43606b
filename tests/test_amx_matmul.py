"""The AMX bf16x3 matmul (``model.native.cpu_matmul.pack_bf16x3``, ``native/amx_matmul.cc``): the
split and the packed layout against numpy definitions (everywhere), the kernel against numpy
float64 and the engine against XLA's float32 steps (on CPUs with AMX-BF16), and the engine's
refusal where it cannot run (simulated on CPUs that have AMX). Logits and greedy ids against
Hugging Face are in test_golden.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_cpu_matmul import kernel_against_float64

from model.native import cpu_matmul
from model.config import LlamaConfig
from model.weights.loader import random_llama
from service.engine import Engine, EngineConfig
from service.engine.request import SamplingOptions
from sharding.layouts import Layout

AMX = cpu_matmul.available() and cpu_matmul.amx_available()
needs_amx = pytest.mark.skipif(not AMX, reason="no AMX-BF16 on this CPU: nothing to run the kernel on")


def test_split_keeps_sixteen_mantissa_bits() -> None:
    w = np.random.default_rng(0).standard_normal(10_000).astype(np.float32) * np.float32(1e3)
    hi, lo = cpu_matmul.split_bf16(jnp.asarray(w))
    assert hi.dtype == lo.dtype == jnp.bfloat16
    back = np.asarray(hi, np.float64) + np.asarray(lo, np.float64)
    assert np.all(np.abs(back - w) <= np.abs(w) * 2.0**-16)
    assert np.all(np.asarray(hi, np.float32) == w.astype(jnp.bfloat16).astype(np.float32))  # RNE


def test_pack_layout_matches_its_definition() -> None:
    """data[p, b, s, c, r, 2j + t] = half s of W[32b + 2r + t, 32p + 16c + j]."""
    k, n = 64, 96
    w = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    packed = cpu_matmul.pack_bf16x3(jnp.asarray(w.reshape(k, 3, 32)), 1)
    assert packed.format == "bf16x3" and packed.out_shape == (3, 32) and packed.dtype == jnp.float32
    data = np.asarray(packed.data.astype(jnp.float32))
    assert data.shape == (n // 32, k // 32, 2, 2, 16, 32)
    hi, lo = (np.asarray(h.astype(jnp.float32)) for h in cpu_matmul.split_bf16(jnp.asarray(w)))
    for p, b, s, c, r, j, t in [
        (0, 0, 0, 0, 0, 0, 0),
        (2, 1, 1, 1, 15, 15, 1),
        (1, 0, 0, 1, 7, 3, 1),
        (2, 1, 0, 0, 9, 12, 0),
    ]:
        assert data[p, b, s, c, r, 2 * j + t] == (hi, lo)[s][32 * b + 2 * r + t, 32 * p + 16 * c + j]


def test_pack_rejects_what_the_kernel_does_not_take() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_matmul.pack_bf16x3(jnp.zeros((40, 64), jnp.float32), 1)  # K = 40
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_matmul.pack_bf16x3(jnp.zeros((64, 48), jnp.float32), 1)
    with pytest.raises(ValueError, match="float32"):
        cpu_matmul.pack_bf16x3(jnp.zeros((64, 64), jnp.bfloat16), 1)


def test_engine_config_refuses_bf16x3_outside_unrolled_float32() -> None:
    with pytest.raises(ValueError, match="unrolled"):
        EngineConfig(matmul="bf16x3", layers="scan")
    with pytest.raises(ValueError, match="matmul must be one of"):
        EngineConfig(matmul="bf16")


@needs_amx
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 64, 32),  # one row of a 16-row tile, one panel
        (13, 576, 960),  # a partial 16-row block
        (40, 576, 96),  # a full 32-row block and an 8-row one
        (64, 1536, 576),  # two full blocks, 18 panels over the threads
        (100, 32, 64),  # K = one k-block; 32 + 32 + 32 + 4 rows
    ],
)
def test_kernel_matches_numpy_to_bf16x3_precision(m: int, k: int, n: int) -> None:
    y, want, x, w = kernel_against_float64(m, k, n, cpu_matmul.pack_bf16x3)
    # each product to about 2^-16 relative; the errors of K of them add like a random walk
    scale = np.sqrt((x**2) @ (w**2))
    assert np.all(np.abs(y - want) <= 8 * 2.0**-16 * scale + 1e-6)


def tiny_engine(matmul: str, slots: int = 3) -> Engine:
    cfg = LlamaConfig.tiny()
    graphdef, params = random_llama(cfg, 0)
    ecfg = EngineConfig(num_slots=slots, max_seq_len=128, chunk_size=32, layers="unrolled", matmul=matmul)
    return Engine(cfg, graphdef, params, Layout("single"), ecfg)


@needs_amx
def test_engine_bf16x3_agrees_with_float32() -> None:
    """The same prompts through a bf16x3 engine and an all-XLA float32 engine: prefill and decode
    logits within bf16x3's error, the same greedy ids."""
    engines = {m: tiny_engine(m) for m in ("bf16x3", "xla")}
    assert engines["bf16x3"].panels is not None and engines["xla"].panels is None
    assert engines["bf16x3"].panels["wqkv"][0].format == "bf16x3"
    prompts = [[5, 17, 42, 99, 7], [300, 2, 2, 64, 128, 1, 9], [11] * 20]
    results = {}
    for name, e in engines.items():
        for slot in range(len(prompts)):
            e.set_sampling(slot, SamplingOptions(temperature=0.0))
        firsts = [e.prefill(slot, p, 0) for slot, p in enumerate(prompts)]
        prefill_logits = np.stack([np.asarray(o.logits)[0] for o in firsts])
        tokens = np.array([o.host().ids[0] for o in firsts], np.int32)
        positions = np.array([len(p) for p in prompts], np.int32)
        ids, decode_logits = [tokens], []
        for _ in range(6):
            out = e.decode(tokens, positions)
            tokens, positions = np.asarray(out.host().ids, np.int32), positions + 1
            ids.append(tokens)
            decode_logits.append(np.asarray(out.logits))
        results[name] = (prefill_logits, np.stack(decode_logits), np.stack(ids))
    got, want = results["bf16x3"], results["xla"]
    np.testing.assert_allclose(got[0], want[0], atol=2e-4)
    np.testing.assert_allclose(got[1], want[1], atol=2e-4)
    np.testing.assert_array_equal(got[2], want[2])


def test_engine_refuses_bf16x3_without_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU has no AMX (simulated here on one that has), asking for bf16x3 is a clear
    error at start-up, not a crash in the first step."""
    monkeypatch.setattr(cpu_matmul, "amx_available", lambda: False)
    with pytest.raises(ValueError, match="AMX-BF16"):
        tiny_engine("bf16x3")


def test_serve_flag_reaches_the_server_config() -> None:
    from service.server.cli import _serve_config, build_parser

    args = build_parser().parse_args(["serve", "--layers", "unrolled", "--matmul", "bf16x3"])
    cfg = _serve_config(args)
    assert (cfg.engine.layers, cfg.engine.matmul) == ("unrolled", "bf16x3")
    assert _serve_config(build_parser().parse_args(["serve"])).engine.matmul == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--matmul", "bf16"])
