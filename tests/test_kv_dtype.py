"""A bfloat16 or 8-bit KV cache under float32 weights (``EngineConfig.kv_dtype``): against Hugging Face
transformers' float32 logits and greedy ids (``tests/fixtures/golden_logits.npz``, written by
``scripts/make_golden.py``), through the served engine with each attention backend (the native
CPU kernels and XLA's); the roofline's KV bytes by hand; the configuration surfaces (engine,
server flags, sweep, peers' MBU).

A bfloat16 entry keeps 8 of float32's 24 significand bits (relative rounding error up to
2^-9). Every key and value is rounded once, when written, and attention reads it widened
exactly (``model.llama.ragged_step``: a prefill chunk's tokens see each other's rounded keys,
as later steps do), so every prompt's logits move by a few hundredths, not only those whose
later chunks read an earlier chunk's keys.

An 8-bit cache holds each (token, KV head) row as llama.cpp's Q8_0 block of it (codes and a
float16 scale: ``model.attention.pages.to_stored``), checked byte for byte against gguf's
quantizer; its error per entry is up to half a code step, max|row| / 254.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import dense_kv
from test_golden import FIXTURE, first_difference, greedy_request, served

from benchmarks import roofline as rl
from benchmarks.cli import main as bench_main
from model.attention.pages import from_stored
from model.config import LlamaConfig
from service.engine.batch import build
from service.engine.config import EngineConfig, resolve_kv_dtype
from service.engine.loop import make_loop
from service.engine.runner import Runner
from service.server.cli import _serve_config, build_parser, main
from sharding.layouts import Layout

# With a float32 cache the logits are within FLOAT32_BOUND of transformers' (test_golden.py). With
# a bfloat16 cache they were measured within 0.055-0.099 on the three golden prompts (native
# kernels 0.098, 0.093, 0.066; XLA 0.083, 0.062, 0.056: the backends' float32 keys differ in
# their last bits, so some round to other bfloat16 values): held to twice the largest, and to
# more than the float32 bound (the rounded cache is really read).
FLOAT32_BOUND = 1e-3
BOUND = 0.2
# With an 8-bit cache the logits were measured within 0.25-0.70 of transformers' on the three
# golden prompts with the native kernels (0.341, 0.700, 0.251) and 0.17-0.79 with XLA's (0.382,
# 0.793, 0.167), the 32 greedy ids of each identical: held to twice the largest.
INT8_BOUND = 1.6
# The backends a bfloat16 cache is served by: the native CPU kernels (the default on one CPU
# device, reading bfloat16 pages in place) and XLA's gathers and dots.
ATTENTION = ["auto", "xla"]


@pytest.fixture(scope="module", params=ATTENTION)
def runner(smollm2_model, request: pytest.FixtureRequest) -> Runner:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=512, kv_dtype="bfloat16", attention=request.param)
    return Runner(cfg, graphdef, params, Layout("single"), ecfg)


@pytest.fixture(scope="module", params=ATTENTION)
def int8_runner(smollm2_model, request: pytest.FixtureRequest) -> Runner:  # type: ignore[no-untyped-def]
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=512, kv_dtype="int8", attention=request.param)
    return Runner(cfg, graphdef, params, Layout("single"), ecfg)


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.slow
def test_the_cache_is_bfloat16_and_the_weights_stay_float32(runner: Runner) -> None:
    leaves = jax.tree.leaves(runner.cache)
    assert len(leaves) == 2 and all(a.dtype == jnp.uint16 for a in leaves)  # bfloat16's bits: storage_dtype
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(runner.params))
    assert runner.ecfg.kv_dtype == "bfloat16" and runner.ecfg.dtype == "float32"
    from model import native

    # "auto" on one CPU device: the native kernels, which take bfloat16 pages (where built).
    assert runner.kernels.attention.native == (runner.ecfg.attention == "auto" and native.available())


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2])
def test_logits_and_greedy_tokens_against_transformers(runner: Runner, golden: dict[str, np.ndarray], i: int) -> None:
    prompt = golden[f"prompt_ids_{i}"].tolist()
    ref_greedy = golden[f"greedy_{i}"].tolist()
    (ids,), (logits,) = served(runner, [prompt], len(ref_greedy))
    err = float(np.abs(logits - golden[f"last_logits_{i}"]).max())
    assert FLOAT32_BOUND < err < BOUND, f"prompt {i} ({len(prompt)} tokens): max |logit diff| {err:.2e}"
    # 32 ids through the rounded cache, identical on these prompts.
    assert ids == ref_greedy, f"prompt {i}: first difference at step {first_difference(ids, ref_greedy)}"


@pytest.mark.slow
def test_the_cache_holds_the_rounded_keys(smollm2_model, golden: dict[str, np.ndarray]) -> None:  # type: ignore[no-untyped-def]
    """After a prompt's prefill in a fresh pool, its pages hold the prompt's keys and values
    rounded to bfloat16 (layer 0's, which no rounding upstream moves, within one bfloat16 step of
    the dense float32 forward's, ``reference.dense_kv``; every layer's not zero), and every other
    page stays untouched (zeros)."""
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=512, kv_dtype="bfloat16", kv_cache_tokens=2048)
    runner = Runner(cfg, graphdef, params, Layout("single"), ecfg)
    prompt = golden["prompt_ids_0"].tolist()
    scheduler = make_loop(runner, max_queue=1).scheduler
    request = greedy_request("cache", prompt, 1)
    scheduler.add(request)
    plan = scheduler.schedule()
    runner.step(build(plan, runner.geometry, scheduler.page_tables)).host()
    ps = ecfg.page_size
    pages = scheduler.page_tables[request.slot, : -(-len(prompt) // ps)]
    dense = dense_kv(graphdef, params, prompt)  # keys, values [L, T, K, H] float32
    for a, want in zip((runner.cache.k, runner.cache.v), dense, strict=True):
        assert a.dtype == jnp.uint16  # bfloat16's bits
        pool = np.asarray(from_stored(a))  # [L, P, K, page_size, H] float32
        held = pool[:, pages].transpose(0, 1, 3, 2, 4).reshape(cfg.num_layers, -1, cfg.num_kv_heads, cfg.head_dim)
        got = held[:, : len(prompt)]  # [L, T, K, H]
        assert np.all(np.abs(got).max(axis=-1) > 0)  # every position of every layer and head
        assert not np.any(held[:, len(prompt) :])  # the last page's tail
        # One bfloat16 step (8 significand bits) of the float32 value: rounding, and the last
        # bits by which the engine's float32 matmuls differ from the dense forward's.
        np.testing.assert_array_less(np.abs(got[0] - want[0]), 2.0**-7 * np.abs(want[0]) + 1e-30)
        rounded = np.asarray(want[0]).astype(jnp.bfloat16).astype(np.float32)
        assert np.mean(got[0] == rounded) > 0.99  # nearly all exactly the dense key rounded
        others = np.ones(pool.shape[1], bool)
        others[pages] = False
        assert not np.any(pool[:, others])


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2])
def test_int8_logits_and_greedy_tokens_against_transformers(
    int8_runner: Runner, golden: dict[str, np.ndarray], i: int
) -> None:
    """The golden prompts through an 8-bit cache (each backend reading its codes and scales):
    the 32 greedy ids of each identical to transformers' float32 ones, the logits within
    ``INT8_BOUND``."""
    from model import native

    cache = int8_runner.cache
    assert cache.k.dtype == jnp.int8 and cache.k.shape[-1] == int8_runner.cfg.head_dim + 2
    assert int8_runner.kernels.attention.native == (int8_runner.ecfg.attention == "auto" and native.available())
    prompt = golden[f"prompt_ids_{i}"].tolist()
    ref_greedy = golden[f"greedy_{i}"].tolist()
    (ids,), (logits,) = served(int8_runner, [prompt], len(ref_greedy))
    err = float(np.abs(logits - golden[f"last_logits_{i}"]).max())
    assert BOUND < err < INT8_BOUND, f"prompt {i} ({len(prompt)} tokens): max |logit diff| {err:.2e}"
    assert ids == ref_greedy, f"prompt {i}: first difference at step {first_difference(ids, ref_greedy)}"


def test_an_int8_row_is_ggufs_q8_0_block_of_it() -> None:
    """``to_stored`` on rows of 32 (one Q8_0 block): the codes and the float16 scale byte for
    byte as gguf's quantizer (bit-exact to ggml's) writes them, scale first there; decoded as its
    dequantizer decodes them (``from_stored``); a row of zeros stays zeros. Rows of 64: each
    half's codes are not the block's (one scale per row), each decodes within half a step (and
    the scale's float16 rounding)."""
    from gguf import GGMLQuantizationType, quants

    from model.attention.pages import to_stored

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 3, 32)) * rng.uniform(1e-3, 300, (40, 3, 1))).astype(np.float32)
    x[0, 0] = 0.0
    stored = np.asarray(to_stored(jnp.asarray(x), jnp.int8))
    assert stored.dtype == np.int8 and stored.shape == (40, 3, 34)
    as_blocks = np.concatenate([stored[..., 32:], stored[..., :32]], axis=-1).view(np.uint8).reshape(-1, 34)
    want = quants.quantize(x.reshape(-1, 32), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    np.testing.assert_array_equal(as_blocks, want)
    jitted = np.asarray(jax.jit(to_stored, static_argnums=1)(jnp.asarray(x), jnp.int8))  # as in the step
    np.testing.assert_array_equal(jitted, stored)
    decoded = np.asarray(from_stored(jnp.asarray(stored)))
    np.testing.assert_array_equal(decoded.reshape(-1), quants.dequantize(want, GGMLQuantizationType.Q8_0).reshape(-1))
    assert not decoded[0, 0].any()

    wide = rng.standard_normal((10, 64)).astype(np.float32) * 5
    back = np.asarray(from_stored(to_stored(jnp.asarray(wide), jnp.int8)))
    step = np.abs(wide).max(-1, keepdims=True) / 127
    # Half a code step, and up to 127 codes times the scale's float16 rounding (2^-11 relative).
    assert (np.abs(back - wide) <= (0.5 + 127 * 2.0**-11) * step * (1 + 1e-4)).all()


def test_an_int8_cache_serves_the_float32_caches_ids_and_holds_more_tokens() -> None:
    """The tiny model through the engine with an 8-bit cache, on one device and on 2x2: the
    greedy ids of a float32 cache (its logits are peaked: no near-ties); and the same pool bytes
    (``kv_cache_memory``) hold (4 x H) / (H + 2) times the tokens a float32 cache holds."""
    from reference import make, run, tiny_loop

    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 20, 33)]
    for layout, devices in (("1x1", jax.devices()[:1]), ("2x2", jax.devices()[:4])):
        ids = {}
        for kv in ("float32", "int8"):
            loop = tiny_loop(layout, devices, kv_dtype=kv)
            loop.start()
            try:
                assert loop.ready.wait(300) and loop.error is None, loop.error
                ids[kv] = run(loop, [make(p, 12, repetition_penalty=2.0) for p in prompts])
            finally:
                loop.stop()
        assert ids["int8"] == ids["float32"], layout
        assert len({i for got, _ in ids["int8"] for i in got}) > 3  # the ids vary
    memory = 2**20
    tokens = {
        kv: tiny_loop(kv_dtype=kv, kv_cache_memory=memory).runner.ecfg.kv_cache_tokens for kv in ("float32", "int8")
    }
    H = LlamaConfig.tiny().head_dim
    assert tokens["int8"] / tokens["float32"] == pytest.approx(4 * H / (H + 2), rel=0.02)


def test_config_is_checked_and_resolved() -> None:
    assert EngineConfig().kv_dtype == "auto"
    assert resolve_kv_dtype("auto", "float32") == "float32"
    assert resolve_kv_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_dtype("bfloat16", "float32") == "bfloat16"
    assert EngineConfig(kv_dtype="int8").kv_dtype == "int8"
    with pytest.raises(ValueError, match="kv_dtype must be 'auto' or one of float32, bfloat16, int8, got 'float16'"):
        EngineConfig(kv_dtype="float16")
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, got 'float64'"):
        EngineConfig(dtype="float64")


def test_roofline_counts_the_kv_cache_in_its_own_dtype() -> None:
    """Llama 3 8B's KV cache: 2 (K, V) x 32 layers x 8 heads x 128 = 65536 entries per token, so at
    B = 8 and S = 1024 a decode step reads 8 x 1024 x 65536 x 2 bytes = 1 GiB in bfloat16 and 2 GiB
    in float32, whatever the weights' dtype."""
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192)  # fmt: skip
    hw = rl.Hardware(name="h", hbm_bytes_per_s=1e12, peak_flops={"float32": 1e14}, interconnect_bytes_per_s=1e11)
    par = rl.Parallelism()
    f32 = rl.decode_step(cfg, hw, par, rl.Workload(batch=8, context_len=1024, dtype="float32"))
    bf16 = rl.decode_step(cfg, hw, par, rl.Workload(batch=8, context_len=1024, dtype="float32", kv_dtype="bfloat16"))
    assert f32.kv_bytes == 2 * 2**30 and bf16.kv_bytes == 2**30
    assert bf16.weight_bytes == f32.weight_bytes and bf16.flops == f32.flops
    assert f32.memory_bytes - bf16.memory_bytes == 2**30
    r = rl.roofline(cfg, hw, par, rl.Workload(batch=8, context_len=1024, dtype="float32", kv_dtype="bfloat16"))
    assert r.kv_stored_bytes == 2**30
    u = rl.decode_utilization(cfg, hw, par, 8, 1024, "float32", 1.0, kv_dtype="bfloat16")
    assert u.mbu == pytest.approx(bf16.memory_bytes / 1e12)


def test_serve_flag_reaches_the_server_config() -> None:
    args = build_parser().parse_args(["serve", "--kv-dtype", "bfloat16"])
    assert _serve_config(args).engine.kv_dtype == "bfloat16"
    assert _serve_config(build_parser().parse_args(["serve"])).engine.kv_dtype == "auto"
    assert _serve_config(build_parser().parse_args(["serve", "--kv-dtype", "int8"])).engine.kv_dtype == "int8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-dtype", "float16"])


@pytest.mark.slow
def test_layouts_command_gives_the_kv_bytes_in_the_cache_dtype(
    smollm2_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SmolLM2-135M on one device, 8 slots x 2048 tokens: 2 x 30 x 3 x 64 entries per token, so
    8 x 2048 x 11520 x 4 bytes = 754.97 MB in float32 and 377.5 MB in bfloat16; 2 x 30 x 3 rows
    of 64 codes and a 2-byte scale per token, 8 x 2048 x 180 x 66 bytes = 194.6 MB in int8."""
    kv_mb = {}
    for kv in ("auto", "bfloat16", "int8"):
        assert main(["layouts", "--model", str(smollm2_gguf), "--slots", "8", "--kv-dtype", kv]) == 0
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if x.startswith("single "))
        kv_mb[kv] = float(line.split("MB")[1].split()[-1])
    assert kv_mb == {
        "auto": pytest.approx(755.0, abs=0.1),
        "bfloat16": pytest.approx(377.5, abs=0.1),
        "int8": pytest.approx(194.6, abs=0.1),
    }


def test_sweep_runs_with_a_bfloat16_cache(tmp_path: Path) -> None:
    argv = ["sweep", "--tiny", "--layouts", "1x1", "--batches", "2", "--prompt-lens", "8", "--steps", "2"]
    argv += ["--warmup-steps", "1", "--kv-dtype", "bfloat16", "--hardware", "cpu-peers-md", "--out", str(tmp_path)]
    assert bench_main(argv) == 0  # meshserve-bench sweep
    (row,) = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert row["status"] == "ok" and row["kv_dtype"] == "bfloat16" and row["mbu"] > 0


def test_peers_count_each_engines_kv_bytes() -> None:
    """peers.py's MBU reads the KV cache at each engine's own dtype: bfloat16 for meshserve's
    bf16-KV rows, float16 for llama.cpp's (its default context), float32 for the rest."""
    spec = importlib.util.spec_from_file_location("peers", Path(__file__).parent.parent / "benchmarks" / "peers.py")
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    tiny = LlamaConfig.tiny()  # matmul weights 90112, norms 320; KV 512 B/token in fp32
    wl = {"prompt_len": 8, "new_tokens": 4, "batches": [1], "ttft_prompt": list(range(16))}
    batches = {"1": {"tpot_ms": 1.0, "decode_tok_s": 1e3, "ttft_s": 0.01}}
    results = {
        label: {"status": "ok", "batches": json.loads(json.dumps(batches)), "ttft_long_s": 0.5}
        for label in ("meshserve fp32", "meshserve fp32, bf16 KV", "llama.cpp F32")
    }
    peers.add_utilization(results, wl, {"read_bytes_per_s": 1e9, "float32_flops": 1e9}, tiny)
    weights = (90112 + 320) * 4
    mbu = {label: r["batches"]["1"]["mbu"] for label, r in results.items()}
    assert mbu["meshserve fp32"] == pytest.approx((weights + 10 * 512) / 1e-3 / 1e9)  # context 8 + 4/2 = 10
    assert mbu["meshserve fp32, bf16 KV"] == pytest.approx((weights + 10 * 256) / 1e-3 / 1e9)
    assert mbu["llama.cpp F32"] == mbu["meshserve fp32, bf16 KV"]


def test_the_int8_benchmark_prints_each_caches_step_and_the_ratio(
    tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``benchmarks/kv_int8.py`` on the tiny model's shapes: a line per batch with both caches'
    step times and int8's ratio to float32 judged against the target, the pools' sizes
    (the int8 pool's rows: 16 codes and a scale, 18 bytes against float32's 64)."""
    from benchmarks import kv_int8

    code = kv_int8.main(["--model", str(tiny_gguf), "--batches", "2", "--context", "48", "--rounds", "1"])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("B=  2:"))
    ratio = float(line.split("int8 / float32 ")[1].split()[0])
    assert code == (0 if ratio <= kv_int8.TARGET_RATIO else 2)
    assert "float32 min" in line and "int8 min" in line and ("PASS" in line) == (code == 0)
    pools = {
        kv: x.rsplit("pool ", 1)[1] for x in out.splitlines() for kv in ("float32", "int8") if x.startswith(f"  {kv}:")
    }
    assert set(pools) == {"float32", "int8"}
