"""The native CPU panel matmul (``model.native.cpu_matmul``) against numpy float64; packing into
panels (``pack``, ``pack_stacked``, ``unpack``) and the model's weights in that form
(``model.weights.packed_weights``); the engine's step over packed weights against XLA's dots
(a ``Runner`` with matmul "auto" against one with "xla") and against the dense reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from reference import dense_logits

from model.config import LlamaConfig
from model.native import cpu_matmul
from model.weights.build import random_block_llama, random_llama
from model.weights.packed_weights import PANEL_IN_DIMS, pack_panels, unpack_panels
from model.weights.quant_panels import QuantPanels
from service.engine.batch import RaggedBatch, RowInstall
from service.engine.config import EngineConfig
from service.engine.request import SamplingOptions
from service.engine.runner import Runner
from sharding.layouts import Layout


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_matmul.available(), "the kernels must build on a machine with g++ (CI has it)"


# ---- the kernel -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("m", "k", "n"),
    [
        (1, 576, 960),  # one row: a 1-row tile
        (3, 64, 32),  # one panel; one full 3-row tile (AVX2)
        (16, 100, 96),  # one full 16-row tile (AVX-512); K not a multiple of anything
        (17, 1536, 576),  # a full tile and a 1-row tile (AVX-512); 5 x 3 + 2 rows (AVX2)
        (64, 576, 3072),  # four full tiles (AVX-512), 96 panels over the threads
        (45, 7, 64),  # 16 + 16 + 13 rows (AVX-512), 15 x 3 (AVX2)
    ],
)
def test_matmul_matches_numpy(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(m * 1000 + k)
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    y = jax.jit(cpu_matmul.matmul)(x, cpu_matmul.pack(jnp.asarray(w), 1))
    assert y.shape == (m, n) and y.dtype == jnp.float32
    want = x.astype(np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_pack_layout_and_out_shape() -> None:
    """Panel p holds columns 32p..32p+31 of every row; the outputs take the weight's trailing
    axes; leading axes beyond the first are contracted too (wo [N, H, D] with in_dims 2)."""
    w = np.arange(2 * 3 * 4 * 16, dtype=np.float32).reshape(2, 3, 4, 16)  # [N=2, H=3, 4, 16]: K=6, N=64
    packed = cpu_matmul.pack(jnp.asarray(w), 2)
    assert packed.out_shape == (4, 16) and packed.in_shape == (2, 3) and packed.data.shape == (2, 6, 32)
    assert packed.shape == w.shape and packed.dtype == jnp.float32 and packed.layer is None
    flat = w.reshape(6, 64)
    for p in range(2):
        np.testing.assert_array_equal(np.asarray(packed.data[p]), flat[:, 32 * p : 32 * p + 32])
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    y = cpu_matmul.matmul(jnp.asarray(x), packed)
    assert y.shape == (5, 4, 16)
    np.testing.assert_allclose(np.asarray(y).reshape(5, 64), x.astype(np.float64) @ flat, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("shape", "in_dims"), [((64, 96), 1), ((2, 3, 4, 16), 2), ((64, 2, 4, 16), 1)])
def test_pack_and_unpack_round_trip_exactly(shape: tuple[int, ...], in_dims: int) -> None:
    """``unpack`` is ``pack``'s and ``pack_stacked``'s inverse, bit for bit (a stack of 3 of the
    same shape too), and ``Panels.shape`` is the input-major weight's."""
    rng = np.random.default_rng(len(shape))
    w = rng.standard_normal(shape).astype(np.float32)
    packed = cpu_matmul.pack(jnp.asarray(w), in_dims)
    assert packed.shape == shape
    back = np.asarray(cpu_matmul.unpack(packed))
    assert back.dtype == np.float32 and back.shape == shape
    np.testing.assert_array_equal(back, w)

    stack = rng.standard_normal((3, *shape)).astype(np.float32)
    packed = cpu_matmul.pack_stacked(jnp.asarray(stack), in_dims)
    k = int(np.prod(shape[:in_dims]))
    n = int(np.prod(shape[in_dims:]))
    assert packed.data.shape == (3, n // 32, k, 32) and packed.shape == stack.shape
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(packed)), stack)
    for layer in range(3):  # each matrix of the stack is that layer's ``pack``
        one = cpu_matmul.pack(jnp.asarray(stack[layer]), in_dims)
        np.testing.assert_array_equal(np.asarray(packed.data[layer]), np.asarray(one.data))


def test_pack_rejects_what_the_kernel_does_not_take() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_matmul.pack(jnp.zeros((8, 48), jnp.float32), 1)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_matmul.pack(jnp.zeros((8, 64), jnp.bfloat16), 1)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_matmul.pack_stacked(jnp.zeros((2, 8, 48), jnp.float32), 1)
    assert cpu_matmul.supports(960, jnp.float32)
    assert not cpu_matmul.supports(960, jnp.bfloat16)
    assert not cpu_matmul.supports(48, jnp.float32)


def test_stacked_panels_multiply_by_the_layer_they_are_given_inside_a_scan() -> None:
    """``pack_stacked``: L matrices in one array; inside ``lax.scan`` the traced layer index picks
    the matrix, read in place, and each product equals numpy float64's of that matrix."""
    rng = np.random.default_rng(0)
    L, M, K, N = 3, 5, 96, 64
    w = rng.standard_normal((L, K, 2, N // 2)).astype(np.float32)  # out_shape (2, N/2), as fused weights
    x = rng.standard_normal((M, K)).astype(np.float32)
    stack = cpu_matmul.pack_stacked(jnp.asarray(w), 1)
    assert stack.data.shape == (L, N // 32, K, 32) and stack.out_shape == (2, N // 2)

    def body(_: None, layer: jax.Array) -> tuple[None, jax.Array]:
        return None, cpu_matmul.matmul(jnp.asarray(x), dataclasses.replace(stack, layer=layer))

    _, ys = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32)))()
    for i in range(L):
        want = (x.astype(np.float64) @ w[i].reshape(K, N).astype(np.float64)).reshape(M, 2, N // 2)
        np.testing.assert_allclose(np.asarray(ys[i]), want, rtol=1e-4, atol=1e-4 * np.sqrt(K))
    with pytest.raises(ValueError, match="need a layer index"):
        cpu_matmul.matmul(jnp.asarray(x), stack)
    one = cpu_matmul.pack(jnp.asarray(w[0]), 1)
    with pytest.raises(ValueError, match="need a layer index"):  # one matrix with a layer index
        cpu_matmul.matmul(jnp.asarray(x), dataclasses.replace(one, layer=jnp.int32(0)))
    outside = dataclasses.replace(stack, layer=jnp.int32(L))
    with pytest.raises(Exception, match="layer index outside"):
        np.asarray(jax.jit(cpu_matmul.matmul)(jnp.asarray(x), outside))


def test_mismatched_k_is_an_error_not_a_crash() -> None:
    packed = cpu_matmul.pack(jnp.zeros((8, 32), jnp.float32), 1)
    with pytest.raises(Exception, match="panels must be"):
        jax.block_until_ready(cpu_matmul.matmul(jnp.zeros((2, 9), jnp.float32), packed))


# ---- the model's weights as panels ------------------------------------------------------------
def tiny(tied: bool) -> LlamaConfig:
    return LlamaConfig.tiny(tie_word_embeddings=tied)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pack_panels_packs_every_matmul_weight_and_unpack_restores_them_exactly(tied: bool) -> None:
    """``pack_panels`` replaces the four stacked layer weights by stacked ``Panels`` and the head
    by one ``Panels`` (a tied model gains a packed ``lm_head``, the table transposed, and keeps
    its table for the lookups); the norms stay arrays. ``unpack_panels`` gives back every
    array bit for bit, and the tied model's graph without the head."""
    cfg = tiny(tied)
    graphdef, params = random_llama(cfg, seed=5)
    model = nnx.merge(graphdef, params)
    before = {name: np.asarray(w) for name, w in model.layers.weights().items()}
    table = np.asarray(model.embed.get_value())
    head = None if tied else np.asarray(model.lm_head.get_value())

    packed = pack_panels(model)
    assert set(packed) == {*PANEL_IN_DIMS, "lm_head"}
    for name, in_dims in PANEL_IN_DIMS.items():
        w = getattr(model.layers, name).get_value()
        assert isinstance(w, cpu_matmul.Panels) and w.data.ndim == 4, name
        assert w.shape == before[name].shape and len(w.in_shape) == in_dims, name
        np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(w)), before[name])
    for name in ("attn_norm", "mlp_norm"):
        assert not isinstance(getattr(model.layers, name).get_value(), cpu_matmul.Panels)
    packed_head = model.lm_head.get_value()
    assert isinstance(packed_head, cpu_matmul.Panels) and packed_head.shape == (cfg.hidden_size, cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(packed_head)), table.T if tied else head)
    np.testing.assert_array_equal(np.asarray(model.embed.get_value()), table)  # the lookups' table
    assert model.lm_head.get_metadata()["logical_axes"] == ("embed", "vocab")
    assert pack_panels(model) == []  # already packed: nothing more

    unpack_panels(model)
    for name, w in model.layers.weights().items():
        assert not isinstance(w, cpu_matmul.Panels)
        np.testing.assert_array_equal(np.asarray(w), before[name])
    if tied:
        assert not hasattr(model, "lm_head")
        assert nnx.split(model)[0] == graphdef  # the graph it started with
    else:
        np.testing.assert_array_equal(np.asarray(model.lm_head.get_value()), head)
    np.testing.assert_array_equal(np.asarray(model.embed.get_value()), table)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_packed_model_computes_the_unpacked_ones_logits(tied: bool) -> None:
    """The dense reference forward over a packed model (every matmul through the kernel, the
    head too) gives the unpacked model's logits."""
    cfg = tiny(tied)
    graphdef, params = random_llama(cfg, seed=6)
    tokens = np.random.default_rng(6).integers(0, cfg.vocab_size, 24).astype(np.int32)
    model = nnx.merge(graphdef, params)
    pack_panels(model)
    packed_graphdef, packed_params = nnx.split(model)
    assert (packed_graphdef != graphdef) == tied  # a tied model gained its head
    want = dense_logits(graphdef, params, tokens)
    got = dense_logits(packed_graphdef, packed_params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_pack_panels_leaves_what_the_kernel_does_not_take() -> None:
    """bfloat16 weights and GGUF blocks kept as stored (``QuantPanels``) are not packed."""
    graphdef, params = random_llama(tiny(True), seed=0, dtype=jnp.bfloat16)
    model = nnx.merge(graphdef, params)
    assert pack_panels(model) == [] and not hasattr(model, "lm_head")
    for tied in (True, False):
        graphdef, params = random_block_llama(tiny(tied), seed=1, fmt="q8_0")
        model = nnx.merge(graphdef, params)
        assert pack_panels(model) == []
        assert all(isinstance(getattr(model.layers, n).get_value(), QuantPanels) for n in PANEL_IN_DIMS)
        assert isinstance(model.embed.get_value(), QuantPanels) and hasattr(model, "lm_head") != tied


# ---- the engine's step over packed weights -----------------------------------------------------
ROW, PROMPT_LEN, DECODES = 1, 21, 6


def greedy_steps(runner: Runner, prompt: np.ndarray, decodes: int) -> tuple[list[int], np.ndarray]:
    """Row ``ROW`` of ``runner``: the prompt in one prefill chunk, then ``decodes`` decode steps
    fed the greedy ids; (the ids, the logits [1 + decodes, V] they were taken from)."""
    g = runner.geometry
    D, max_pages = g.decode_buckets[0], g.max_pages
    table = np.arange(ROW * max_pages, (ROW + 1) * max_pages, dtype=np.int32) % runner.num_pages

    def batch(prefill: int, fill) -> RaggedBatch:  # type: ignore[no-untyped-def]
        b = g.empty_batch(D, prefill)
        b.page_tables[ROW] = table
        fill(b)
        real = b.positions[b.rows >= 0]
        return dataclasses.replace(b, num_real=len(real), max_position=int(real.max()))

    def prefill(b: RaggedBatch) -> None:
        n = len(prompt)
        b.tokens[D : D + n], b.positions[D : D + n], b.rows[D : D + n] = prompt, np.arange(n), ROW
        b.last_index[ROW] = D + n - 1

    install = RowInstall(row=ROW, sampling=SamplingOptions(temperature=0.0), logprobs=False, eos_ids=())
    out = runner.step(dataclasses.replace(batch(g.prefill_bucket(g.padded(len(prompt))), prefill), installs=(install,)))
    ids, logits = [int(out.host().ids[ROW])], [out.row_logits(ROW)]
    for i in range(decodes):

        def decode(b: RaggedBatch, i: int = i) -> None:
            b.tokens[0], b.positions[0], b.rows[0], b.generated[0] = ids[-1], len(prompt) + i, ROW, True
            b.last_index[ROW] = 0

        out = runner.step(batch(0, decode))
        ids.append(int(out.host().ids[ROW]))
        logits.append(out.row_logits(ROW))
    return ids, np.stack(logits)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_runner_with_panels_matches_xla_and_the_dense_reference(tied: bool) -> None:
    """One CPU device, float32, the scan: matmul "auto" packs every matmul weight and the head
    into panels (the placed parameters hold ``Panels`` and no input-major copy); its prefill and
    decode steps give the logits of a runner on XLA's dots to float32 rounding, both the
    dense reference's, and the same greedy ids."""
    cfg = tiny(tied)
    graphdef, params = random_llama(cfg, seed=7)
    one = jax.devices()[:1]
    ecfg = EngineConfig(
        num_slots=2, max_seq_len=64, chunk_size=32, page_size=8, kv_cache_tokens=128, max_num_batched_tokens=32
    )
    runners = {
        m: Runner(cfg, graphdef, params, Layout("1x1"), dataclasses.replace(ecfg, matmul=m), one)
        for m in ("auto", "xla")
    }
    panels, xla = runners["auto"], runners["xla"]
    assert panels.kernels.panels and not xla.kernels.panels
    assert panels.kernels.layer_loop == xla.kernels.layer_loop == "scan"
    assert panels.kernels.attention.name == xla.kernels.attention.name  # only the matmuls differ

    def forms(runner: Runner) -> dict[str, bool]:
        model = nnx.merge(runner.graphdef, runner.params)
        out = {n: isinstance(getattr(model.layers, n).get_value(), cpu_matmul.Panels) for n in PANEL_IN_DIMS}
        out["lm_head"] = hasattr(model, "lm_head") and isinstance(model.lm_head.get_value(), cpu_matmul.Panels)
        return out

    assert all(forms(panels).values()) and not any(forms(xla).values())

    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, PROMPT_LEN).astype(np.int32)
    (ids_p, logits_p), (ids_x, logits_x) = (greedy_steps(r, prompt, DECODES) for r in (panels, xla))
    np.testing.assert_allclose(logits_p, logits_x, rtol=1e-5, atol=1e-5)
    assert ids_p == ids_x
    seq = np.concatenate([prompt, np.asarray(ids_x[:-1], np.int32)])
    want = dense_logits(graphdef, params, seq)[PROMPT_LEN - 1 :]
    np.testing.assert_allclose(logits_p, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits_x, want, rtol=1e-4, atol=1e-4)
