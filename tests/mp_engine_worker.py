"""One process of tests/test_multiprocess_engine.py's two-process job (run as a script, with
``JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=4``):

    python tests/mp_engine_worker.py --process-id I --coordinator 127.0.0.1:PORT --layouts 1x8,8x1 --out ids.json \
        [--speculative ngram|draft]

For each layout in turn, both processes build the tiny random model and a ``Runner`` on
the layout over all 8 devices; process 0 drives ``service.engine.loop.make_loop`` over a
runner mirroring its calls over the step channel, runs ``REQUESTS`` (greedy) and stops the followers (``STOP``), process 1
``follow``s; process 0 then writes every layout's ids as JSON. With ``--speculative draft``
both also build a draft model's runner (the same tiny model: ``build_draft``), process 0's
proposing through it and mirroring its calls tagged, process 1's replaying them. One job for all the layouts: a
job's start (two interpreters, jax.distributed, gloo) costs about 15 s here. Importable without JAX
work (the test takes ``REQUESTS``, ``ecfg`` and ``run_requests`` from here for its one-process
run)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for p in (str(ROOT), str(ROOT / "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

import numpy as np  # noqa: E402

SEED = 3
EXIT_NO_DISTRIBUTED = 3  # jax.distributed.initialize itself failed
T, CHUNK = 64, 16
SLOTS = 8  # the 8x1 layout's data axis divides it
_rng = np.random.default_rng(0)
PROMPT_A = _rng.integers(0, 256, 20).tolist()  # tests/test_engine_penalties.py's (vocab 256)
PROMPT_B = _rng.integers(0, 256, 7).tolist()
PROMPT_C = np.random.default_rng(7).integers(0, 256, 33).tolist()  # tests/reference.py's
# (prompt, max_tokens, sampling): greedy unless a temperature is given; the penalties make the
# tiny model's greedy ids vary (without them it repeats one id) and send the token history
# (a row install with a history) through the mirror too; the last one samples with a seed.
REQUESTS: tuple[tuple[list[int], int, dict[str, float]], ...] = (
    (PROMPT_A, 12, {"repetition_penalty": 3.0}),
    (PROMPT_B, 12, {"frequency_penalty": 0.8, "presence_penalty": 0.3}),
    (PROMPT_C, 8, {}),
    (PROMPT_B, 10, {"temperature": 1.0, "seed": 5}),
)


def ecfg(speculative: str = "off") -> Any:
    """The engine's settings; ``speculative`` "draft" speculates with ``build_draft``'s runner."""
    from service.engine.config import EngineConfig

    if speculative == "draft":
        speculative = "draft:tiny"
    return EngineConfig(
        num_slots=SLOTS, max_seq_len=T, chunk_size=CHUNK, page_size=4,
        kv_cache_tokens=SLOTS * T, max_num_batched_tokens=32, speculative=speculative, speculative_tokens=3,
    )  # fmt: skip


def build_engine(layout: str, speculative: str = "off") -> Any:
    import jax

    from model.config import LlamaConfig
    from model.weights.build import random_llama
    from service.engine.runner import Runner
    from sharding.layouts import Layout

    data, model = (int(n) for n in layout.split("x"))
    graphdef, params = random_llama(LlamaConfig.tiny(), seed=SEED)
    lay = Layout(layout, data=data, model=model)
    return Runner(LlamaConfig.tiny(), graphdef, params, lay, ecfg(speculative), jax.devices())


def build_draft(target: Any) -> Any:
    """The draft model's runner beside ``target``: the same tiny model (greedy, so its drafts
    are kept where no penalty moves the target's argmax), its own pool (``draft_engine_config``)."""
    import jax

    from model.config import LlamaConfig
    from model.weights.build import random_llama
    from service.engine.draft_model import draft_engine_config
    from service.engine.runner import Runner

    graphdef, params = random_llama(LlamaConfig.tiny(), seed=SEED)
    return Runner(LlamaConfig.tiny(), graphdef, params, target.layout, draft_engine_config(target.ecfg), jax.devices())


class _Pieces:
    def push(self, token_id: int) -> str:
        return f"<{token_id}>"

    def flush(self) -> str:
        return ""


def run_requests(loop: Any, timeout_s: float = 120.0) -> list[list[int]]:
    """``REQUESTS`` submitted together; each one's ids (raises on an error or timeout)."""
    from service.engine.request import Request, SamplingOptions
    from service.engine.text_stream import TextStream

    done = [threading.Event() for _ in REQUESTS]
    ids: list[list[int]] = [[] for _ in REQUESTS]
    errors: list[str] = []

    def emit_for(i: int) -> Any:
        def emit(chunk: Any) -> None:
            ids[i].extend(chunk.token_ids)
            if chunk.error is not None:
                errors.append(str(chunk.error))
            if chunk.finish_reason is not None or chunk.error is not None:
                done[i].set()

        return emit

    for i, (prompt, n, sampling) in enumerate(REQUESTS):
        loop.submit(
            Request(
                request_id=f"r{i}", prompt_ids=list(prompt), max_tokens=n,
                sampling=SamplingOptions(**{"temperature": 0.0, **sampling}), text=TextStream(_Pieces()), emit=emit_for(i),
                eos_ids=frozenset(),
            )
        )  # fmt: skip
    end = time.monotonic() + timeout_s
    for d in done:
        if not d.wait(max(0.0, end - time.monotonic())):
            raise TimeoutError(f"requests not done in {timeout_s} s (loop error: {loop.error!r})")
    if errors:
        raise RuntimeError(f"requests failed: {errors}")
    return ids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--layouts", default="2x4", help="comma-separated, run in this order")
    parser.add_argument("--out")
    parser.add_argument("--timeout", type=int, default=170)
    parser.add_argument("--speculative", default="off", help="off, ngram or draft (EngineConfig.speculative)")
    args = parser.parse_args()
    with contextlib.suppress(Exception):  # die with the parent (Linux PR_SET_PDEATHSIG)
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    signal.alarm(args.timeout)  # SIGALRM ends a hung process

    from service.engine import distributed

    t0 = time.monotonic()
    try:
        distributed.initialize(args.coordinator, 2, args.process_id)
    except Exception:
        import traceback

        traceback.print_exc()
        return EXIT_NO_DISTRIBUTED
    import jax

    from model.weights.fetch import cache_dir
    from service.server.startup import enable_compilation_cache

    enable_compilation_cache(cache_dir())  # as the server's: a rerun skips most of the warm-up's compiles
    assert jax.device_count() == 8 and jax.process_count() == 2, (jax.device_count(), jax.process_count())
    channel = distributed.StepChannel.open()
    result: dict[str, Any] = {"ids": {}, "seconds": {}, "followed_steps": {}, "drafts_accepted": {}}
    for layout in args.layouts.split(","):
        t1 = time.monotonic()
        engine = build_engine(layout, args.speculative)
        draft = build_draft(engine) if args.speculative == "draft" else None
        built = time.monotonic() - t1
        if args.process_id == 0:
            from service.engine.loop import make_loop
            from service.engine.runner import STOP

            engine.channel = channel  # process 0's runner mirrors its calls to the follower
            proposer = None
            if draft is not None:
                from service.engine.draft_model import DraftModelProposer

                draft.channel = distributed.DraftChannel(channel)  # and so does the draft model's, tagged
                proposer = DraftModelProposer(draft, engine.ecfg.speculative_tokens, engine.ecfg.draft_p_min)
            loop = make_loop(engine, max_queue=8, proposer=proposer)
            loop.start()
            if not loop.ready.wait(args.timeout):
                raise TimeoutError("warm-up did not finish")
            warm = time.monotonic() - t1 - built
            if loop.error is not None:
                raise RuntimeError(f"engine loop died: {loop.error!r}") from loop.error
            result["ids"][layout] = run_requests(loop)
            result["drafts_accepted"][layout] = loop.scheduler.drafts_accepted
            result["draft_steps"] = getattr(proposer, "steps", 0)
            loop.stop()
            if loop.error is not None:
                raise RuntimeError(f"engine loop died: {loop.error!r}") from loop.error
            channel.send((STOP, (), {}))
            result["seconds"][layout] = {"build": built, "warmup": warm, "total": time.monotonic() - t1}
        else:
            result["followed_steps"][layout] = distributed.follow(engine, channel, draft)
    result["total_s"] = time.monotonic() - t0
    if args.process_id == 0:
        Path(args.out).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    channel.close()
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # at once: an interpreter exit can hang in JAX's distributed shutdown
    sys.exit(code)
