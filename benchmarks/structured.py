"""Structured outputs' cost: batch 1 and batch 8 with every row under a JSON schema against the same
requests unconstrained, in one run (issue 41's targets: TPOT <= 1.10x at batch 8, <= 1.15x at
batch 1), with the host's mask time per step and the grammar compile times (first and cached).

    python -m benchmarks.structured                      # the default model, 48 ids per request
    python -m benchmarks.structured --tokens 64 --rounds 3 --json s.json

Starts a server in this process (the default model, or ``--model``; 8 rows) and talks to it over
gRPC. The constrained requests ask for a JSON array of exactly ``--tokens`` / 3 one-digit
integers (``[d, d, ...]``: three ids per item on SmolLM2's vocabulary, a fixed length whatever
digits the model picks); the unconstrained ones generate ``--tokens`` ids with ``ignore_eos``. TPOT is each request's
(last id's arrival - first id's) / (ids - 1), the median over the batch's requests and the
rounds; the runs alternate, constrained and not, ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from typing import Any

from benchmarks import check_writable_file
from service.server.arg_types import positive_int

PROMPT = "List some digits."


def digits_schema(items: int) -> dict[str, Any]:
    """A JSON array of exactly ``items`` integers 0..9."""
    return {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": items,
        "maxItems": items,
    }


def timed_batch(client: Any, requests: list[Any]) -> list[tuple[int, float]]:
    """Send ``requests`` at once; each one's (ids, TPOT seconds)."""
    out: list[tuple[int, float]] = [(0, 0.0)] * len(requests)

    def one(i: int) -> None:
        times, ids = [], 0
        for resp in client.stream(requests[i], 600):
            if resp.token_ids:
                times.append(time.perf_counter())
                ids += len(resp.token_ids)
        out[i] = (ids, (times[-1] - times[0]) / max(1, ids - 1))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model name or GGUF path (default: the default model)")
    ap.add_argument("--tokens", type=positive_int, default=48, help="ids per request (%(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="alternations of the two runs (%(default)s)")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.json:
        check_writable_file(args.json, ap.prog)

    from model.weights.fetch import resolve_model
    from protos.meshserve.v1 import meshserve_pb2 as pb
    from service.engine.config import EngineConfig
    from service.server.app import ServerThread
    from service.server.client import Client, make_request
    from service.server.config import ServerConfig
    from service.server.validation import GrammarSpec

    cfg = ServerConfig(
        model=str(resolve_model(args.model)), port=0, metrics_port=0, max_queue=64,
        engine=EngineConfig(num_slots=8, max_seq_len=1024),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    assert srv.running is not None  # start() returns once it serves
    try:
        client = Client(f"127.0.0.1:{srv.running.port}")
        client.wait_serving()
        gateway = srv.running.gateway
        assert gateway.grammars is not None and gateway.facts is not None
        schema = json.dumps(digits_schema(args.tokens // 3))
        t0 = time.perf_counter()
        gateway.grammars.vocabulary()
        vocabulary_s = time.perf_counter() - t0
        spec = GrammarSpec("json_schema", schema, "bench")
        t0 = time.perf_counter()
        gateway.grammars.compile(spec)
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        gateway.grammars.compile(spec)
        cached_s = time.perf_counter() - t0

        def requests(batch: int, constrained: bool) -> list[Any]:
            kw: dict[str, Any] = (
                {"constraint": pb.Constraint(json_schema=schema), "max_tokens": 4 * args.tokens}
                if constrained else {"max_tokens": args.tokens, "min_tokens": args.tokens, "ignore_eos": True}
            )  # fmt: skip
            return [make_request(chat=[("user", PROMPT)], temperature=0.0, **kw) for _ in range(batch)]

        timed_batch(client, requests(8, False) + requests(8, True)[:1])  # compiles; the mask path's first fill
        rows = []
        for batch in (1, 8):
            tpot: dict[bool, list[float]] = {False: [], True: []}
            ids: dict[bool, list[int]] = {False: [], True: []}
            masks = gateway.pools[0].loop.masks
            assert masks is not None  # built by the warm-up's constrained request
            fills, fill_s = masks.fills, masks.fill_seconds
            for _ in range(args.rounds):
                for constrained in (False, True):
                    for n, t in timed_batch(client, requests(batch, constrained)):
                        tpot[constrained].append(t)
                        ids[constrained].append(n)
            mask_ms = (masks.fill_seconds - fill_s) / max(1, masks.fills - fills) * 1e3
            free, bound = statistics.median(tpot[False]), statistics.median(tpot[True])
            rows.append(
                {
                    "batch": batch, "tpot_ms": free * 1e3, "constrained_tpot_ms": bound * 1e3,
                    "ratio": bound / free, "mask_ms_per_step": mask_ms,
                    "ids": statistics.median(ids[False]), "constrained_ids": statistics.median(ids[True]),
                }
            )  # fmt: skip
        report = {
            "model": gateway.facts.name,
            "vocabulary_s": vocabulary_s,
            "compile_first_s": first_s,
            "compile_cached_s": cached_s,
            "rows": rows,
        }
    finally:
        srv.stop()
    print(f"model {report['model']}: llguidance vocabulary {vocabulary_s * 1e3:.0f} ms (once per model); "
          f"schema compile {first_s * 1e3:.2f} ms first, {cached_s * 1e3:.3f} ms cached")  # fmt: skip
    print(
        f"{'batch':>5} {'TPOT ms':>9} {'JSON TPOT ms':>13} {'ratio':>6} {'mask ms/step':>13} {'ids':>5} {'JSON ids':>9}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tpot_ms']:>9.2f} {r['constrained_tpot_ms']:>13.2f} {r['ratio']:>6.2f} "
            f"{r['mask_ms_per_step']:>13.3f} {r['ids']:>5.0f} {r['constrained_ids']:>9.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
