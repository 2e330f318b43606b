"""Our float32 model against Hugging Face transformers on the same GGUF weights.

Fixtures: ``tests/fixtures/golden_logits.npz``, written by ``scripts/make_golden.py`` (see its
header to regenerate). The long prompt (644 tokens) is prefilled in two chunks of at most
512 tokens, so it also checks chunked prefill and RoPE at far positions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from model.native import cpu_matmul
from service.engine import Engine, EngineConfig
from service.paged_engine import PagedEngine
from service.paged_loop import PagedEngineLoop, engine_loop
from service.engine.request import Chunk, Request, SamplingOptions
from service.engine.text_stream import TextStream
from sharding.layouts import Layout

FIXTURE = Path(__file__).parent / "fixtures" / "golden_logits.npz"
GREEDY = SamplingOptions(temperature=0.0)


# The unrolled engine with the AMX bf16x3 matmuls runs where the CPU has AMX-BF16 (this repo's
# machines and CI do); elsewhere the engine refuses it, which test_amx_matmul.py checks.
ENGINES = ["scan", "unrolled"] + (["unrolled-bf16x3"] if cpu_matmul.available() and cpu_matmul.amx_available() else [])


@pytest.fixture(scope="module", params=ENGINES)
def engine(smollm2_model, request: pytest.FixtureRequest) -> Engine:  # type: ignore[no-untyped-def]
    """The float32 engine in both layer forms, and the unrolled one with the AMX bf16x3 matmuls
    (JAX's Precision.HIGH), each held to the same bounds."""
    layers, _, matmul = request.param.partition("-")
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=2, max_seq_len=1024, chunk_size=512, layers=layers, matmul=matmul or "auto")
    return Engine(cfg, graphdef, params, Layout("single"), ecfg)


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as z:
        return {k: z[k] for k in z.files}


def greedy_run(engine: Engine, prompt: list[int], n: int, slot: int = 1) -> tuple[np.ndarray, list[int]]:
    """Prefill ``prompt`` into ``slot`` (in chunks), then decode greedily; returns the
    last-position logits [V] and ``n`` generated ids."""
    engine.set_sampling(slot, GREEDY)
    chunk = engine.ecfg.chunk_size
    for start in range(0, len(prompt), chunk):
        out = engine.prefill(slot, prompt[start : start + chunk], start)
    ids = [int(out.host().ids[0])]
    logits = np.asarray(out.logits)[0]
    S, T = engine.ecfg.num_slots, engine.ecfg.max_seq_len
    for i in range(n - 1):
        tokens = np.zeros(S, np.int32)
        positions = np.full(S, T, np.int32)
        tokens[slot], positions[slot] = ids[-1], len(prompt) + i
        ids.append(int(engine.decode(tokens, positions).host().ids[slot]))
    return logits, ids


@pytest.mark.slow
@pytest.mark.parametrize("i", [0, 1, 2])
def test_logits_and_greedy_tokens_match_transformers(engine: Engine, golden: dict[str, np.ndarray], i: int) -> None:
    prompt = golden[f"prompt_ids_{i}"].tolist()
    ref_logits = golden[f"last_logits_{i}"]
    ref_greedy = golden[f"greedy_{i}"].tolist()
    logits, ids = greedy_run(engine, prompt, len(ref_greedy))
    err = np.abs(logits - ref_logits).max()
    assert err < 1e-3, f"prompt {i} ({len(prompt)} tokens): max |logit diff| {err:.2e}"
    assert ids == ref_greedy, (
        f"prompt {i}: first difference at step {next(j for j, (a, b) in enumerate(zip(ids, ref_greedy, strict=True)) if a != b)}"
    )


def test_long_prompt_really_is_long(golden: dict[str, np.ndarray]) -> None:
    assert len(golden["prompt_ids_2"]) >= 500


# ---- the paged engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paged_loop(smollm2_model) -> Iterator[PagedEngineLoop]:  # type: ignore[no-untyped-def]
    """The paged engine (pages of 16, three prompts per step) behind its loop."""
    cfg, graphdef, params = smollm2_model
    ecfg = EngineConfig(num_slots=4, max_seq_len=1024, chunk_size=512, kv_cache="paged")
    loop = engine_loop(PagedEngine(cfg, graphdef, params, Layout("single"), ecfg), max_queue=8)
    assert isinstance(loop, PagedEngineLoop)
    loop.start()
    assert loop.ready.wait(900)
    yield loop
    loop.stop()


def loop_greedy(loop: PagedEngineLoop, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Submit ``prompts`` together (greedy, ``n`` ids each, no EOS) and wait for their ids."""
    done = [threading.Event() for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    for i, p in enumerate(prompts):

        def emit(chunk: Chunk, i: int = i) -> None:
            ids[i].extend(chunk.token_ids)
            if chunk.finish_reason is not None or chunk.error is not None:
                done[i].set()

        loop.submit(
            Request(f"golden-{i}", p, n, GREEDY, TextStream(PiecesOf()), emit, frozenset())  # type: ignore[arg-type]
        )
    for d in done:
        assert d.wait(600)
    return ids


class PiecesOf:
    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


@pytest.mark.slow
def test_paged_engine_greedy_tokens_match_transformers_batched_and_solo(
    paged_loop: PagedEngineLoop, golden: dict[str, np.ndarray]
) -> None:
    prompts = [golden[f"prompt_ids_{i}"].tolist() for i in range(3)]
    refs = [golden[f"greedy_{i}"].tolist() for i in range(3)]
    n = min(len(r) for r in refs)
    # All three in the same steps (the long one in two chunks beside the others' decode tokens) ...
    assert loop_greedy(paged_loop, prompts, n) == [r[:n] for r in refs]
    # ... then each alone, the first two now hitting the prefix cache the batch filled.
    hits = paged_loop.scheduler.blocks.hit_tokens
    for p, r in zip(prompts, refs, strict=True):
        assert loop_greedy(paged_loop, [p], len(r)) == [r]
    assert paged_loop.scheduler.blocks.hit_tokens > hits
