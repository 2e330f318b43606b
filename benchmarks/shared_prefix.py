"""Shared prefixes: requests that share a long system prompt, sent one after another (issue 19's
prefix-cache target).

    python -m benchmarks.shared_prefix --address 127.0.0.1:50051              # 16 requests, 1,024 shared tokens
    python -m benchmarks.shared_prefix --requests 16 --prefix-tokens 1024 --max-tokens 8 --json p.json

Against a running server: ``--requests`` requests whose token ids start with the same
``--prefix-tokens`` ids (a fixed pseudo-random run of ordinary ids, so no tokenizer or chat
template decides the length) and end with a few ids of their own (``--suffix-tokens``), each
sent after the previous one finished, greedy, ``--max-tokens`` ids. Prints each request's TTFT,
the ratio of the median TTFT of requests 2..N to the first's (issue 19's target: <= 0.25), and
the server's prefix-cache counters before and after (``--metrics-address``, the server's
``--metrics-port``), whose difference shows the reuse.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

import numpy as np

from benchmarks import check_writable_file, scrape_counters
from service.server.arg_types import positive_int

TARGET_RATIO = 0.25


def prefix_counters(metrics_address: str | None) -> dict[str, float]:
    """The server's prefix-cache counters summed over pools (empty without an address)."""
    if not metrics_address:
        return {}
    return scrape_counters(metrics_address, ("prefix_cache_queried_tokens_total", "prefix_cache_hit_tokens_total"))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its rows and ratio; 0 when every request finished."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.shared_prefix", description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="127.0.0.1:50051", help="the server's gRPC host:port (%(default)s)")
    ap.add_argument("--metrics-address", help="the server's metrics host:port, for the prefix-cache counters")
    ap.add_argument("--requests", type=positive_int, default=16, help="requests (%(default)s)")
    ap.add_argument("--prefix-tokens", type=positive_int, default=1024, help="shared leading ids (%(default)s)")
    ap.add_argument("--suffix-tokens", type=positive_int, default=16, help="ids of each request's own (%(default)s)")
    ap.add_argument("--max-tokens", type=positive_int, default=8, help="ids generated per request (%(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the ids (%(default)s)")
    ap.add_argument("--json", help="write the rows and the ratio to this file")
    args = ap.parse_args(argv)
    if args.json:
        check_writable_file(args.json, ap.prog)

    from service.server.client import Client, make_request

    client = Client(args.address)
    client.wait_serving()
    vocab = client.model_info().vocab_size
    rng = np.random.default_rng(args.seed)
    # Ordinary ids (the first thousand hold the byte and special tokens of most vocabularies).
    prefix = rng.integers(1000, vocab, args.prefix_tokens).tolist()
    before = prefix_counters(args.metrics_address)
    rows: list[dict[str, Any]] = []
    for i in range(args.requests):
        ids = prefix + rng.integers(1000, vocab, args.suffix_tokens).tolist()
        r = client.generate(make_request(token_ids=ids, max_tokens=args.max_tokens, temperature=0.0))
        rows.append({"request": i + 1, "prompt_tokens": r.prompt_tokens, "ttft_ms": 1e3 * r.ttft_s,
                     "finish_reason": r.finish_reason})  # fmt: skip
        print(f"request {i + 1:3d}: {r.prompt_tokens} prompt tokens, TTFT {1e3 * r.ttft_s:8.1f} ms", flush=True)
    client.close()
    after = prefix_counters(args.metrics_address)
    first = rows[0]["ttft_ms"]
    rest = statistics.median(r["ttft_ms"] for r in rows[1:]) if len(rows) > 1 else float("nan")
    ratio = rest / first
    print(
        f"TTFT: first {first:.1f} ms, median of 2..{len(rows)} {rest:.1f} ms, ratio {ratio:.3f} "
        f"(target <= {TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'missed'})"
    )
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    if delta:
        print("prefix cache during the run: " + ", ".join(f"{k} +{v:.0f}" for k, v in delta.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "ratio": ratio, "counters": delta}, f, indent=1)
        print(f"{ap.prog}: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
