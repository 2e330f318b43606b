"""KV memory follows the requests, not ``slots x max_seq_len`` (issue 19's memory target).

    python -m benchmarks.kv_memory                     # 64 x (128 + 256) ids; pools of 32,768 and 16,384 tokens
    python -m benchmarks.kv_memory --pools 32768 8192 --json m.json

Starts ``meshserve serve --slots S --max-seq-len L --kv-cache-tokens P`` (``benchmarks.
server_process``; defaults S = 64, L = 8,192: a cache sized for every slot's longest sequence
would hold 64 x 8,192 positions) once for each ``--pools`` value P, and sends the same workload
to each: ``--requests`` greedy requests of ``--prompt-len`` pseudo-random ids (no EOS id among
them) and ``--output-len`` generated ids (``ignore_eos``), all at once. For each pool it prints
the pool's tokens and bytes (``GetModelInfo``), the bytes of S x L positions
(``slots_engine_bytes``: what the per-slot engine the paged pool replaced held), the preemptions
the server counted (``meshserve_preemptions_total``), failures, and whether every request's ids
equal those of the first pool's run (the largest pool, sorted first). Issue 19's target: the
first pool (64 x 512 tokens) serves the workload without preemption; a smaller one preempts and
still returns identical ids.

Identical ids are a claim about greedy decoding in float32: a preempted sequence is recomputed
in other batches than the first run's, so its logits can differ in the last bits; ids stay the
same unless two logits are that close.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import check_writable_file, scrape_counters
from benchmarks.server_process import free_port, start_server, stop_server
from service.server.arg_types import positive_int


def preemptions_total(metrics_address: str) -> float:
    """The server's ``meshserve_preemptions_total``, summed over pools (0 before any)."""
    return scrape_counters(metrics_address, ["preemptions_total"]).get("preemptions_total", 0.0)


def run_workload(address: str, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> list[dict[str, Any]]:
    """Send every prompt at once (one thread each), greedy, ``ignore_eos``; each request's ids,
    finish reason and error (gRPC status name, or None)."""
    import grpc

    from protos.meshserve.v1 import meshserve_pb2 as pb
    from service.server.client import Client, make_request

    client = Client(address)
    results: list[dict[str, Any]] = [{} for _ in prompts]

    def one(i: int) -> None:
        ids: list[int] = []
        finish, error = "", None
        req = make_request(
            token_ids=prompts[i], max_tokens=max_tokens, temperature=0.0, ignore_eos=True, request_id=f"kv-{i}"
        )
        try:
            for resp in client.stream(req, timeout_s):
                ids.extend(resp.token_ids)
                if resp.finish_reason:
                    finish = pb.FinishReason.Name(resp.finish_reason)
        except grpc.RpcError as exc:
            error = exc.code().name
        results[i] = {"ids": ids, "finish_reason": finish, "error": error}

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        client.close()
    return results


def model_info(address: str) -> Any:
    """The default pool's ``GetModelInfo``."""
    from protos.meshserve.v1 import meshserve_pb2 as pb
    from service.server.client import Client

    client = Client(address)
    try:
        return client.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    finally:
        client.close()


def kv_bytes_per_token(info: Any, serve_args: list[str]) -> int:
    """Bytes of K and V per cached position over all layers and KV heads
    (``service.engine.kv_pool.bytes_per_token``) in the cache's dtype: ``--kv-dtype`` among
    ``serve_args``, else the weights' ``dtype`` ("auto")."""
    from service.engine.kv_pool import bytes_per_token

    kv_dtype = info.dtype
    for flag, value in itertools.pairwise(serve_args):
        if flag == "--kv-dtype" and value != "auto":
            kv_dtype = value
    return bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, kv_dtype)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a row per pool; 0 when every request finished everywhere."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF file or model directory (default: the server's default model)")
    ap.add_argument("--pools", type=positive_int, nargs="+", default=[32768, 16384], help="pool tokens (%(default)s)")
    ap.add_argument("--slots", type=positive_int, default=64, help="serve --slots (%(default)s)")
    ap.add_argument("--max-seq-len", type=positive_int, default=8192, help="serve --max-seq-len (%(default)s)")
    ap.add_argument("--requests", type=positive_int, default=64, help="requests, sent at once (%(default)s)")
    ap.add_argument("--prompt-len", type=positive_int, default=128, help="prompt ids (%(default)s)")
    ap.add_argument("--output-len", type=positive_int, default=256, help="generated ids (%(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="seeds the prompts (%(default)s)")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more flag for serve (repeatable)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds for a server to start, and per request")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    if args.json:
        check_writable_file(args.json, ap.prog)

    rows: list[dict[str, Any]] = []
    reference: list[list[int]] | None = None
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for pool in sorted(args.pools, reverse=True):
            metrics = free_port()
            serve = [
                "--slots", str(args.slots), "--max-seq-len", str(args.max_seq_len), "--kv-cache-tokens", str(pool),
                "--metrics-port", str(metrics), *args.serve_arg,
            ]  # fmt: skip
            if args.model:
                serve += ["--model", args.model]
            proc, port = start_server(serve, Path(tmp) / f"serve-{pool}.log", args.timeout)
            try:
                address = f"127.0.0.1:{port}"
                info = model_info(address)
                if reference is None:  # same prompts for every pool: drawn once, from the model's vocabulary
                    rng = np.random.default_rng(args.seed)
                    allowed = np.setdiff1d(np.arange(info.vocab_size), np.asarray(list(info.eos_token_ids), np.int64))
                    prompts = [rng.choice(allowed, args.prompt_len).tolist() for _ in range(args.requests)]
                before = preemptions_total(f"127.0.0.1:{metrics}")
                t0 = time.perf_counter()
                results = run_workload(address, prompts, args.output_len, args.timeout)
                seconds = time.perf_counter() - t0
                preemptions = preemptions_total(f"127.0.0.1:{metrics}") - before
            finally:
                stop_server(proc)
            ids = [r["ids"] for r in results]
            errors = sum(1 for r in results if r["error"] or len(r["ids"]) != args.output_len)
            failed += errors
            if reference is None:
                reference = ids
            per_token = kv_bytes_per_token(info, args.serve_arg)
            row = {
                "pool_tokens": info.kv_cache_tokens,
                "pool_pages": info.kv_cache_pages,
                "page_size": info.page_size,
                "pool_bytes": info.kv_cache_tokens * per_token,
                "slots_engine_bytes": args.slots * args.max_seq_len * per_token,
                "needed_tokens": args.requests * (args.prompt_len + args.output_len),
                "preemptions": preemptions,
                "failed": errors,
                "identical_to_first": sum(a == b for a, b in zip(ids, reference, strict=True)),
                "requests": args.requests,
                "seconds": seconds,
                "output_tokens_per_s": sum(len(i) for i in ids) / seconds,
            }
            rows.append(row)
            print(
                f"pool {row['pool_tokens']:>7} tokens ({row['pool_bytes'] / 2**20:8.1f} MiB; slots x max-seq-len "
                f"{row['slots_engine_bytes'] / 2**20:8.1f} MiB)  needed {row['needed_tokens']}  preemptions "
                f"{preemptions:.0f}  failed {errors}  ids identical to the first pool's {row['identical_to_first']}"
                f"/{args.requests}  {seconds:.0f} s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
