"""A cache-less dense reference forward of the model, the oracle for the engine's ragged step:
one sequence's whole prompt at once, softmax attention over a causal mask as the textbook writes
it (Vaswani et al. 2017, §3.2.1; query heads sharing KV heads, Ainslie et al. 2023), with no
pages, no attention backend, no window and no flat batch. It shares only the per-token math of
``model.llama`` (norms, projections, RoPE, MLP), which the Hugging Face goldens check
(tests/test_golden.py, tests/test_hf_llama.py); what the engine adds over it (the paged cache,
its writes, ragged batches, the backends) is what the tests hold to it.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from helpers import penalized

from model.config import LlamaConfig
from model.llama import Llama, out_and_mlp, project_qkv, rope_tables
from model.weights.build import random_llama
from service.engine.config import EngineConfig
from service.engine.draft_model import DraftModelProposer, draft_engine_config
from service.engine.loop import EngineLoop, make_loop
from service.engine.request import Chunk, FinishReason, Request, SamplingOptions
from service.engine.runner import Runner
from service.engine.text_stream import TextStream
from sharding.layouts import Layout

# The tiny random model the engine tests share, and prompts of one, two and three 16-token chunks.
CFG = LlamaConfig.tiny()
T, CHUNK = 64, 16
GRAPHDEF, PARAMS = random_llama(CFG, seed=3)
_rng = np.random.default_rng(0)
PROMPT_A = _rng.integers(0, CFG.vocab_size, 20).tolist()
PROMPT_B = _rng.integers(0, CFG.vocab_size, 7).tolist()
PROMPT_C = np.random.default_rng(7).integers(0, CFG.vocab_size, 33).tolist()
N = 16


def dense_forward(model: Llama, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One sequence ``tokens`` [T] int32: logits [T, V] float32 of every position, and every
    layer's keys and values [L, T, K, H] float32 (RoPE applied: what a KV cache holds)."""
    cfg = model.cfg
    T = tokens.shape[0]
    x = model.embed_tokens(tokens)[None]  # [1, T, D]
    cos, sin = rope_tables(jnp.arange(T, dtype=jnp.int32)[None], cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    causal = jnp.tril(jnp.ones((T, T), bool))
    weights = model.layers.weights()
    keys, values = [], []
    for i in range(cfg.num_layers):
        p = {
            name: (w[i] if isinstance(w, tuple) else jax.tree.map(lambda a, i=i: a[i], w))
            for name, w in weights.items()
        }
        q, k, v = project_qkv(cfg, x, p, cos, sin, jnp.float32)  # q [1, T, K, G, H] scaled; k, v [1, T, K, H]
        scores = jnp.einsum("tkgh,skh->kgts", q[0], k[0], precision=jax.lax.Precision.HIGHEST)
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        attn = jnp.einsum("kgts,skh->tkgh", probs, v[0], precision=jax.lax.Precision.HIGHEST)
        x = out_and_mlp(cfg, x, p, attn[None])
        keys.append(k[0])
        values.append(v[0])
    return model.logits(x[0]), jnp.stack(keys), jnp.stack(values)


def dense_logits(graphdef: nnx.GraphDef, params: Any, tokens: list[int] | np.ndarray) -> np.ndarray:
    """``dense_forward``'s logits [T, V] float32 (on the host) of a model's graph and parameters
    (stacked, as ``random_llama`` makes them) over ``tokens``."""
    return np.asarray(_jitted(graphdef)(params, jnp.asarray(tokens, jnp.int32))[0])


def dense_kv(graphdef: nnx.GraphDef, params: Any, tokens: list[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``dense_forward``'s keys and values [L, T, K, H] float32 (on the host)."""
    _, k, v = _jitted(graphdef)(params, jnp.asarray(tokens, jnp.int32))
    return np.asarray(k), np.asarray(v)


_cache: dict[Any, Any] = {}


def _jitted(graphdef: nnx.GraphDef) -> Any:
    if graphdef not in _cache:
        _cache[graphdef] = jax.jit(lambda params, tokens: dense_forward(nnx.merge(graphdef, params), tokens))
    return _cache[graphdef]


def reference(
    prompt: list[int],
    n: int,
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
    eos: frozenset[int] = frozenset(),
    min_tokens: int = 0,
) -> tuple[list[int], FinishReason]:
    """Greedy ids and finish reason of the tiny model (``GRAPHDEF``, ``PARAMS``), one whole dense
    forward per id (``dense_forward``), its logits penalized by Hugging Face's processor and
    OpenAI's formula (``helpers.penalized``); EOS ids get -inf before the penalties while fewer
    than ``min_tokens`` ids are out (vLLM's order)."""
    out: list[int] = []
    for i in range(n):
        seq = prompt + out
        padded = np.zeros(-(-len(seq) // T) * T, np.int32)  # few lengths, few compiles: the tail is never read
        padded[: len(seq)] = seq
        logits = dense_logits(GRAPHDEF, PARAMS, padded)[len(seq) - 1].copy()
        if i < min_tokens:
            logits[sorted(eos)] = -np.inf
        token = int(np.argmax(penalized(logits, prompt, out, repetition, presence, frequency)))
        if token in eos:
            return out, FinishReason.EOS
        out.append(token)
    return out, FinishReason.LENGTH


class Pieces:
    """A detokenizer stand-in: each id's text is "<id>"."""

    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


def make(prompt: list[int], max_tokens: int = N, eos: frozenset[int] = frozenset(), **kw: object) -> Request:
    """A request; ``kw``: SamplingOptions fields (temperature 0 unless given) or
    min_tokens/ignore_eos/constraint."""
    request_kw = {k: kw.pop(k) for k in ("min_tokens", "ignore_eos", "constraint") if k in kw}
    kw.setdefault("temperature", 0.0)
    return Request(
        request_id=str(id(prompt)),
        prompt_ids=list(prompt),
        max_tokens=max_tokens,
        sampling=SamplingOptions(**kw),  # type: ignore[arg-type]
        text=TextStream(Pieces()),
        emit=lambda chunk: None,
        eos_ids=eos,
        **request_kw,  # type: ignore[arg-type]
    )


def tiny_loop(
    layout: str = "1x1", devices: list | None = None, max_queue: int = 16, draft: tuple[Any, Any] | None = None,
    **engine: Any,
) -> EngineLoop:  # fmt: skip
    """An engine loop (not started) over the tiny model on ``layout`` ("DxM"); ``engine``:
    ``EngineConfig`` fields over the tests' defaults (4 rows, ``T`` tokens, chunks of ``CHUNK``,
    pages of 4, a budget of 32 prefill tokens); ``draft``: a draft model's (graphdef, params)
    of ``CFG``'s shapes, which proposes draft ids on the same layout (``speculative``
    "draft:tiny")."""
    fields: dict[str, Any] = dict(num_slots=4, max_seq_len=T, chunk_size=CHUNK, page_size=4, max_num_batched_tokens=32)
    if draft is not None:
        fields["speculative"] = "draft:tiny"
    fields.update(engine)
    data, model = (int(n) for n in layout.split("x"))
    lay = Layout(layout, data=data, model=model)
    runner = Runner(CFG, GRAPHDEF, PARAMS, lay, EngineConfig(**fields), devices)
    proposer = None
    if draft is not None:
        draft_runner = Runner(CFG, *draft, lay, draft_engine_config(runner.ecfg), devices)
        proposer = DraftModelProposer(draft_runner, runner.ecfg.speculative_tokens, runner.ecfg.draft_p_min)
    return make_loop(runner, max_queue, proposer=proposer)


def run(loop: EngineLoop, requests: list[Request]) -> list[tuple[list[int], FinishReason | None]]:
    """Submit ``requests`` together (in order: the first takes the lower free row) and wait
    for all; each one's ids and finish reason."""
    done = [threading.Event() for _ in requests]
    ids: list[list[int]] = [[] for _ in requests]
    reasons: list[FinishReason | None] = [None] * len(requests)

    def emit_for(i: int):  # type: ignore[no-untyped-def]
        def emit(chunk: Chunk) -> None:
            ids[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None or chunk.error is not None:
                reasons[i] = chunk.finish_reason
                done[i].set()

        return emit

    for i, r in enumerate(requests):
        r.emit = emit_for(i)
        loop.submit(r)
    for d in done:
        assert d.wait(300)
    return list(zip(ids, reasons, strict=True))


def run_across_switch(loop: EngineLoop, new: Runner, requests: list[Request]) -> list[list[int]]:
    """Submit ``requests`` to the started ``loop``, switch it to ``new`` (built and warmed) once
    a stream has two ids, and wait for all: each one's ids. Each emit sleeps 20 ms on the loop
    thread, so the switch lands while the streams run."""
    import time

    started = threading.Event()
    ids: list[list[int]] = [[] for _ in requests]
    done = [threading.Event() for _ in requests]
    for i, r in enumerate(requests):

        def emit(chunk: Chunk, i: int = i) -> None:
            ids[i].extend(chunk.token_ids)
            time.sleep(0.02)
            if len(ids[i]) >= 2:
                started.set()
            if chunk.finish_reason is not None or chunk.error is not None:
                done[i].set()

        r.emit = emit
        loop.submit(r)
    assert started.wait(120)
    loop.switch_runner(new)
    assert loop.runner is new
    assert not all(d.is_set() for d in done)  # still streaming after the switch
    assert all(d.wait(300) for d in done)
    return ids
