"""Speculative decoding's gain: n-gram prompt lookup or a draft model against plain decoding on
the same server, the same requests and ids, in one run (issue 42's targets: n-gram batch-1 TPOT
<= 0.5x plain on an input-grounded workload; a draft model's <= 0.6x on code completion; batch
32 output tokens/s >= 0.95x plain).

    python -m benchmarks.speculative                             # the default model, n-gram
    python -m benchmarks.speculative --model qwen2.5-coder-1.5b-instruct --rounds 2 --json s.json
    python -m benchmarks.speculative --model qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --workload completion --k 4 --batches 1

Starts one server in this process (``--speculative ngram``, or ``draft:MODEL`` with
``--draft``; k = ``--k``; as many rows as the largest batch) and talks to it over gRPC; the plain requests opt out per request (``speculative: false``), so both runs
share the weights, the compiled programs and the pool. The workload is input-grounded, as
n-gram lookup is meant for: rewrite a given 300-token Python function (add type hints, rename a
variable, a parameter, a function) and summarise a given paragraph quoting it, greedy, up to
``--tokens`` ids each (both runs produce the same ids: greedy speculation is exact). The
``completion`` workload asks for new code instead (four small Python functions from their
descriptions), what a draft model is for. A batch of
b requests takes the prompts in turn; a round sends 4 / b batches one after another (each
prompt once at batch 1), or one batch of b. TPOT is each request's (last id's arrival - first
id's) / (ids - 1), the median over the requests and the rounds; tokens/s is the output ids per
second of wall time. The runs alternate, plain first, ``--rounds`` times.
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

SNIPPET = '''def merge_intervals(intervals, min_gap=0):
    """Merge overlapping intervals given as (start, end) pairs."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1] + min_gap:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    result = []
    for start, end in merged:
        if end < start:
            raise ValueError(f"bad interval {start}..{end}")
        result.append((start, end))
    return result


def total_covered(intervals, min_gap=0):
    """The length the merged intervals cover."""
    covered = 0
    for start, end in merge_intervals(intervals, min_gap):
        covered += end - start
    return covered
'''
PARAGRAPH = (
    "The lighthouse at Point Reyes was built in 1870 and stood at the end of a long stair of 313 steps. "
    "Its first-order Fresnel lens, made in France, weighed more than two tons and could be seen 24 miles "
    "out to sea. Keepers wound the clockwork every two hours through the night, and in fog they fed the "
    "steam whistle with coal. The station was automated in 1975, and the lens still turns for visitors on "
    "weekends, when the weather allows."
)
PROMPTS = (
    "Rename the variable `merged` to `joined` in this code and show the full result:\n\n" + SNIPPET,
    "Rename the parameter `min_gap` to `gap` in this code and show the full result:\n\n" + SNIPPET,
    "Rename the function `total_covered` to `covered_length` in this code and show the full result:\n\n" + SNIPPET,
    "Summarise this paragraph, quoting its key sentences word for word:\n\n" + PARAGRAPH,
)
COMPLETIONS = (
    "Write a Python function `parse_duration(text)` that turns strings like '1h30m' or '45s' into seconds. "
    "Only the code.",
    "Write a Python class `LRUCache` with `get` and `put` methods and a fixed capacity. Only the code.",
    "Write a Python function `word_counts(path)` that reads a text file and returns the ten most common words "
    "with their counts. Only the code.",
    "Write a Python function `binary_search(items, target)` over a sorted list, returning the index or -1. "
    "Only the code.",
)
WORKLOADS = {"grounded": PROMPTS, "completion": COMPLETIONS}


def timed_batch(client: Any, requests: list[Any]) -> tuple[list[tuple[int, float, int]], float]:
    """Send ``requests`` at once: each one's (ids, TPOT seconds, draft ids accepted), and the
    seconds from the first send to the last id."""
    out: list[tuple[int, float, int]] = [(0, 0.0, 0)] * len(requests)

    def one(i: int) -> None:
        times, ids, accepted = [], 0, 0
        for resp in client.stream(requests[i], 900):
            if resp.token_ids:
                times.append(time.perf_counter())
                ids += len(resp.token_ids)
            if resp.finish_reason:
                accepted = resp.usage.accepted_draft_tokens
        out[i] = (ids, (times[-1] - times[0]) / max(1, ids - 1), accepted)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def llama_server_tpot(
    binary: str, model: str, draft: str | None, prompts: tuple[str, ...], tokens: int, rounds: int
) -> tuple[float, float]:
    """``llama-server`` (2 threads, one sequence) on ``model``, with ``-md draft`` when given (its
    own defaults for the draft's length and confidence), streaming each prompt's chat completion
    ``rounds`` times, greedy, up to ``tokens`` ids: (the median TPOT in seconds, measured as
    ``timed_batch`` does, from the client's arrival times over llama-server's own count of
    predicted ids; the share of them that were kept drafts)."""
    import http.client
    import tempfile
    from pathlib import Path

    from benchmarks.served_peers import start_http_peer
    from benchmarks.server_process import free_port, stop_server

    port = free_port()
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "4096",
           "-t", "2", "-tb", "2"]  # fmt: skip
    if draft:
        cmd += ["-md", draft, "-td", "2", "-tbd", "2"]
    peer = start_http_peer("llama-server", cmd, port, None, Path(tempfile.mkdtemp()), 600)
    tpots, kept, predicted = [], 0, 0
    try:
        for _ in range(rounds + 1):  # the first round warms its caches, not timed
            for prompt in prompts:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                        "temperature": 0, "stream": True, "seed": 0}  # fmt: skip
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
                conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                times: list[float] = []
                timings: dict[str, Any] = {}
                for line in resp:
                    if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["delta"].get("content"):
                        times.append(time.perf_counter())
                    timings = event.get("timings", timings)
                conn.close()
                n = int(timings.get("predicted_n", len(times)))
                tpots.append((times[-1] - times[0]) / max(1, n - 1))
                kept += int(timings.get("draft_n_accepted", 0))
                predicted += n
        del tpots[: len(prompts)]
    finally:
        stop_server(peer["proc"], grace_s=5)
    return statistics.median(tpots), kept / max(1, predicted)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a model name or GGUF path (default: the default model)")
    ap.add_argument("--tokens", type=positive_int, default=160, help="most ids per request (%(default)s)")
    ap.add_argument("--k", type=positive_int, default=7, help="draft ids per proposal (%(default)s)")
    ap.add_argument("--draft", help="a draft model (name or GGUF path) instead of n-gram lookup")
    ap.add_argument("--p-min", type=float, default=0.75, help="the draft model's confidence cut (%(default)s)")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="grounded", help="the prompts (%(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="alternations of the two runs (%(default)s)")
    ap.add_argument("--batches", type=positive_int, nargs="+", default=[1, 32], help="batch sizes (%(default)s)")
    ap.add_argument(
        "--llama-server", help="a llama-server binary: also time it on the same model (with -md the --draft) at batch 1"
    )
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    if args.json:
        check_writable_file(args.json, ap.prog)

    from model.weights.fetch import resolve_model
    from service.engine.config import EngineConfig
    from service.server.app import ServerThread
    from service.server.client import Client, make_request
    from service.server.config import ServerConfig

    prompts = WORKLOADS[args.workload]
    mode = f"draft:{resolve_model(args.draft)}" if args.draft else "ngram"
    cfg = ServerConfig(
        model=str(resolve_model(args.model)), port=0, metrics_port=0, max_queue=64,
        engine=EngineConfig(
            num_slots=max(args.batches), max_seq_len=1024, speculative=mode, speculative_tokens=args.k,
            draft_p_min=args.p_min,
        ),
    )  # fmt: skip
    srv = ServerThread(cfg).start()
    assert srv.running is not None  # start() returns once it serves
    try:
        client = Client(f"127.0.0.1:{srv.running.port}")
        client.wait_serving()
        gateway = srv.running.gateway
        assert gateway.facts is not None

        def requests(batch: int, speculative: bool, offset: int = 0) -> list[Any]:
            chats = [[("user", prompts[(offset + i) % len(prompts)])] for i in range(batch)]
            return [
                make_request(chat=c, temperature=0.0, max_tokens=args.tokens, speculative=speculative) for c in chats
            ]

        timed_batch(client, requests(len(prompts), False) + requests(len(prompts), True))  # compiles, caches prompts
        rows = []
        proposer = gateway.pools[0].loop.scheduler.proposer
        for batch in args.batches:
            drafting = (getattr(proposer, "rounds", 0), getattr(proposer, "seconds", 0.0))
            tpot: dict[bool, list[float]] = {False: [], True: []}
            rate: dict[bool, list[float]] = {False: [], True: []}
            ids: dict[bool, int] = {False: 0, True: 0}
            accepted = 0
            for _ in range(args.rounds):
                for speculative in (False, True):
                    made, seconds = 0, 0.0
                    for offset in range(0, max(1, len(prompts) // batch) * batch, batch):
                        results, wall = timed_batch(client, requests(batch, speculative, offset))
                        tpot[speculative] += [t for _, t, _ in results]
                        made, seconds = made + sum(n for n, _, _ in results), seconds + wall
                        accepted += sum(a for _, _, a in results) if speculative else 0
                    rate[speculative].append(made / seconds)
                    ids[speculative] += made
            plain, spec = statistics.median(tpot[False]), statistics.median(tpot[True])
            rows.append(
                {
                    "batch": batch, "tpot_ms": plain * 1e3, "spec_tpot_ms": spec * 1e3, "tpot_ratio": spec / plain,
                    "tokens_per_s": statistics.median(rate[False]), "spec_tokens_per_s": statistics.median(rate[True]),
                    "throughput_ratio": statistics.median(rate[True]) / statistics.median(rate[False]),
                    "ids": ids[False], "spec_ids": ids[True], "accepted_share": accepted / max(1, ids[True]),
                    # A draft model's rounds in this batch's speculating runs, and their mean wall time.
                    "draft_rounds": getattr(proposer, "rounds", 0) - drafting[0],
                    "draft_round_ms": (getattr(proposer, "seconds", 0.0) - drafting[1]) * 1e3
                    / max(1, getattr(proposer, "rounds", 0) - drafting[0]),
                }
            )  # fmt: skip
        path, draft_path = str(gateway.facts.path), str(resolve_model(args.draft)) if args.draft else None
        report = {
            "model": gateway.facts.name, "proposer": args.draft or "ngram", "workload": args.workload, "k": args.k,
            "p_min": args.p_min if args.draft else None,
            "tokens": args.tokens, "rows": rows,
        }  # fmt: skip
    finally:
        srv.stop()
    if args.llama_server:  # after ours stopped: each server has the cores alone
        plain = llama_server_tpot(args.llama_server, path, None, prompts, args.tokens, args.rounds)[0]
        spec, share = llama_server_tpot(args.llama_server, path, draft_path, prompts, args.tokens, args.rounds)
        ours = next(r for r in rows if r["batch"] == 1) if 1 in args.batches else None
        report["llama_server"] = {
            "tpot_ms": plain * 1e3, "spec_tpot_ms": spec * 1e3, "tpot_ratio": spec / plain, "accepted_share": share,
            "ours_over_theirs": ours["spec_tpot_ms"] / (spec * 1e3) if ours else None,
        }  # fmt: skip
    print(
        f"model {report['model']}: {report['proposer']} speculation on the {args.workload} workload, k = {args.k}"
        + (f", p_min = {args.p_min}" if args.draft else "")
        + f", up to {args.tokens} ids per request"
    )
    print(
        f"{'batch':>5} {'TPOT ms':>9} {'spec TPOT ms':>13} {'ratio':>6} {'tok/s':>8} {'spec tok/s':>11} "
        f"{'ratio':>6} {'kept drafts/ids':>16}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['tpot_ms']:>9.2f} {r['spec_tpot_ms']:>13.2f} {r['tpot_ratio']:>6.2f} "
            f"{r['tokens_per_s']:>8.1f} {r['spec_tokens_per_s']:>11.1f} {r['throughput_ratio']:>6.2f} "
            f"{r['accepted_share']:>16.2f}"
            + (f"   draft rounds {r['draft_rounds']}, {r['draft_round_ms']:.1f} ms each" if r["draft_rounds"] else "")
        )
    if "llama_server" in report:
        ls = report["llama_server"]
        print(
            f"llama-server{' -md' if args.draft else ''}, batch 1: TPOT {ls['tpot_ms']:.2f} ms plain, "
            f"{ls['spec_tpot_ms']:.2f} ms speculating ({ls['tpot_ratio']:.2f}x; kept drafts/ids "
            f"{ls['accepted_share']:.2f})"
            + (f"; ours / theirs, speculating: {ls['ours_over_theirs']:.2f}x" if ls["ours_over_theirs"] else "")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
