"""meshserve's measurement tools, kept apart from the serving code (which imports none of them).
They measure the one engine the server runs: ``service.engine.runner.Runner``, stepped directly
with the flat batches its engine loop builds, or driven by that loop (``EngineLoop``), or a
running server over gRPC.

``meshserve-bench`` (``benchmarks/cli.py``) runs three of them:

* ``benchmarks.bench``: ``meshserve-bench bench``, a gRPC load generator against a running server.
* ``benchmarks.sweep``: ``meshserve-bench sweep``, the engine timed directly (no gRPC) over a grid.
* ``benchmarks.roofline``: ``meshserve-bench roofline``, the analytic roofline model.

The others are scripts:

* ``benchmarks.peers``, ``benchmarks.cpu_ceilings``, ``benchmarks.native_decode``,
  ``benchmarks.decode_floor``, ``benchmarks.int8_error``, ``benchmarks.quant_matmul``: run as
  ``python benchmarks/NAME.py`` (peer servers against the served engine, the CPU's measured
  ceilings, the native kernels against XLA's in the engine, a batch-1 step's fixed cost and
  bytes, int8 weights' error, the quantized matmul kernels).
* ``benchmarks.dispatch``: ``python -m benchmarks.dispatch``, the step's dispatch cost against
  the KV pool's size.
* ``benchmarks.ragged_step``: ``python -m benchmarks.ragged_step``, the engine's ragged step with
  the native CPU attention backend against the XLA backend.
* ``benchmarks.multiprocess_channel``: ``python -m benchmarks.multiprocess_channel``, two
  jax.distributed CPU processes: the step plan's channel from process 0, and collectives.
* ``benchmarks.mirror_cost``: ``python -m benchmarks.mirror_cost``, the per-step cost of process
  0's runner sending each step over its ``StepChannel`` against a batch-8 SmolLM2-135M decode step.
* ``benchmarks.long_context``, ``benchmarks.kv_memory``, ``benchmarks.shared_prefix``: servers
  started (``benchmarks.server_process``) or running, compared over gRPC.
* ``benchmarks.served_peers``: ``python -m benchmarks.served_peers``, meshserve served against
  ``llama-server`` and vLLM for CPU through their APIs; ``benchmarks/hf_export.py`` (no import of
  ours, run by a peer's Python) makes the float32 Hugging Face directory vLLM serves.

The imports point one way: benchmarks -> service -> sharding -> model.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterable
from pathlib import Path


def check_writable_file(path: str, prog: str) -> None:
    """Before a long run: exit with a clear message if ``path`` cannot be a file to write.

    Raises:
        SystemExit: "PROG: PATH is a directory; ..." or "PROG: cannot write PATH: no folder ...".
    """
    target = Path(path)
    if target.is_dir():
        raise SystemExit(f"{prog}: {path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise SystemExit(f"{prog}: cannot write {path}: no folder {target.parent}")


def scrape_counters(metrics_address: str, names: Iterable[str]) -> dict[str, float]:
    """The server's counters ``meshserve_<name>`` for each of ``names``, each summed over its
    label sets (the pools), read from ``http://METRICS_ADDRESS/metrics`` (the server's
    ``--metrics-port``); a name with no sample on the page is left out."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    wanted = list(names)
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in wanted:
            if line.startswith(f"meshserve_{name}{{"):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out
