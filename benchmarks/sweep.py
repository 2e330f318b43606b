"""``meshserve-bench sweep``: time the served engine directly (no gRPC) over layer loops x layouts
x batch sizes x prompt lengths.

For every point (layer loop, layout, batch B, prompt length P) a fresh ``Runner`` with B rows is
built on the devices present (fake CPU devices included: ``--cpu-devices 8`` or
``XLA_FLAGS=--xla_force_host_platform_device_count=8``), each row with pages of its own, and its
steps are the flat batches the engine loop builds (``service.engine.batch``):

1. unless ``--no-prefill``, B prompts of P ids (a fixed seeded RNG: the same prompts for every
   layout and batch) are prefilled one after the other, each alone in its step and blocking on
   its one host copy: the median is the prefill time per prompt, a proxy for TTFT on an idle
   server (the first call compiles the program; timed as the prefill compile);
2. the decode program (every row decoding, the window of the last timed position) is compiled,
   then ``warmup_steps`` + ``steps`` greedy decode steps run for all B rows twice: serially,
   each dispatched then waited for (``step_ms``, and ``decode_call_ms``, the ``Runner.step``
   call alone before its host copy waits: its arguments, the dispatch, and whatever the runtime
   does before returning), and pipelined as the engine loop runs them, step i + 1 dispatched
   before step i's ids are read on the host, each decode token reading its id on the device:
   the median interval between two steps' ids landing is the TPOT, and B / TPOT the decode
   throughput. The pipelined run goes on for one step past the timed ones (two without
   warm-up), at the last position: each timed interval holds the next step's dispatch, as the
   loop's do (the last step's ids alone, read with nothing dispatched after them, would time
   a host copy where the runtime runs a step inside its dispatch).

Compile times are the first calls' times less one steady-state run of the same program.

Weights' values do not change the speed, so ``--random`` times random weights at the model's
shapes (no GGUF read). Each point also gets the roofline's (``benchmarks/roofline.py``)
predicted TPOT, TTFT and throughput for the same layout, batch and decode window, on a hardware
preset (``--hardware``; ``auto`` measures this CPU or matches the accelerator's kind), and the
plots overlay them. The measured figures are also set against that hardware: ``mbu`` and
``mfu`` of the decode step (the roofline's bytes and FLOPs per device of a step at the decode
window, over the measured TPOT, over the bandwidth and peak) and ``prefill_mfu`` of one prompt's
prefill (``benchmarks.roofline.decode_utilization`` and ``prefill_utilization``).

Outputs in ``--out``: ``sweep.csv`` and ``sweep.json`` (rows plus the run's metadata), and with
matplotlib (``pip install -e '.[bench]'``) ``pareto.png`` (decode throughput vs TPOT per layout)
and ``step_time.png`` (decode step time vs batch: flat while weight reads dominate, rising past the
compute-bound knee).

This module imports no JAX at import time, so ``--cpu-devices`` can still set ``XLA_FLAGS``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from service.server.arg_types import nonnegative_int, positive_int

log = logging.getLogger(__name__)

# CSV columns, in order (the JSON rows carry the same keys).
FIELDS = [
    "layout",
    "data",
    "model",
    "attention",
    "layers",
    "kv_dtype",
    "devices",
    "batch",
    "prompt_len",
    "status",
    "max_seq_len",
    "decode_window",
    "setup_s",
    "compile_prefill_s",
    "compile_decode_s",
    "compile_s",
    "prefill_ms",
    "prefill_min_ms",
    "prefill_tok_s",
    "warmup_steps",
    "steps",
    "tpot_ms",
    "tpot_min_ms",
    "tpot_max_ms",
    "step_ms",
    "decode_call_ms",
    "decode_tok_s",
    "predicted_tpot_ms",
    "predicted_ttft_ms",
    "predicted_tok_s",
    "predicted_regime",
    "roofline_fraction",
    "mbu",
    "mfu",
    "prefill_mfu",
]


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """What to sweep.

    Attributes:
        layouts: layout presets, YAML paths or "DxM" shorthands.
        batches: batch sizes B (each point's engine has exactly B slots, all decoding).
        prompt_lens: prompt lengths P (one prefill chunk each).
        steps: timed decode steps K per point (the TPOT is their median).
        warmup_steps: decode steps run before the timed ones, not counted.
        dtype: parameter dtype.
        kv_dtype: ``EngineConfig.kv_dtype``: "auto" (= ``dtype``), "float32" or "bfloat16".
        layers: ``EngineConfig.layer_loop`` forms to time, each of "auto", "scan" or "unrolled"
            (the outermost loop: every point once per form).
        prefill: time each point's prompts' prefill (TTFT's proxy; one more program to compile
            per point); without it the rows are decoded from zeroed pages, which times the same.
        seed: seeds the prompt ids.
        max_seq_len: KV-cache tokens per slot; None = just enough (P + warmup_steps + steps + 1).
    """

    layouts: tuple[str, ...] = ("1x1",)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prompt_lens: tuple[int, ...] = (128,)
    steps: int = 16
    warmup_steps: int = 2
    dtype: str = "float32"
    kv_dtype: str = "auto"
    layers: tuple[str, ...] = ("auto",)
    prefill: bool = True
    seed: int = 0
    max_seq_len: int | None = None

    def __post_init__(self) -> None:
        if not self.layouts or not self.batches or not self.prompt_lens:
            raise ValueError("layouts, batches and prompt_lens must each name at least one value")
        if min(self.batches) < 1 or min(self.prompt_lens) < 1:
            raise ValueError(f"batches and prompt lengths must be >= 1, got {self.batches} and {self.prompt_lens}")
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError(f"steps must be >= 1 and warmup_steps >= 0, got {self.steps} and {self.warmup_steps}")
        if self.max_seq_len is not None and self.max_seq_len < max(self.prompt_lens) + self.warmup_steps + self.steps:
            raise ValueError(
                f"max_seq_len {self.max_seq_len} < longest prompt + warm-up + timed steps "
                f"({max(self.prompt_lens) + self.warmup_steps + self.steps})"
            )

    def seq_len(self, prompt_len: int) -> int:
        return self.max_seq_len or prompt_len + self.warmup_steps + self.steps + 1


def make_prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """[batch, prompt_len] int32 ids from a RNG seeded by (seed, prompt_len): row i is the same for
    every batch size and layout."""
    rng = np.random.default_rng([seed, prompt_len])
    return rng.integers(0, vocab_size, size=(batch, prompt_len), dtype=np.int32)


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def _page_tables(runner: Any, batch: int) -> np.ndarray:
    """[batch, max_pages] int32: each row's own ``max_pages`` pages of its replica's pool, in order."""
    g = runner.geometry
    per = g.rows_per_replica
    return np.stack([(row % per) * g.max_pages + np.arange(g.max_pages) for row in range(batch)]).astype(np.int32)


def _prompt_batch(runner: Any, ids: np.ndarray, row: int, tables: np.ndarray, installs: tuple = ()) -> Any:
    """``ids`` as row ``row``'s first and only chunk, sampling at its last token, over the rows'
    page tables ``tables``: the flat batch the loop builds for a prompt arriving at an idle
    server (``installs``: the rows' sampling parameters to install with it)."""
    import dataclasses as dc

    g = runner.geometry
    n = len(ids)
    b = g.empty_batch(g.decode_buckets[0], g.prefill_bucket(g.padded(n)))
    start = g.replica_of(row) * len(b.tokens) // g.replicas + g.decode_buckets[0]
    b.tokens[start : start + n], b.positions[start : start + n], b.rows[start : start + n] = ids, np.arange(n), row
    b.last_index[row] = start + n - 1
    b.page_tables[: len(tables)] = tables
    return dc.replace(b, num_real=n, max_position=n - 1, installs=installs)


def measure_point(
    runner: Any, prompts: np.ndarray, steps: int, warmup_steps: int, prefill: bool = True
) -> dict[str, Any]:
    """Prefill ``prompts`` (one per row, B = the runner's row count), then decode every row at
    once, as the served engine runs them (``Runner.step`` on the flat batches the loop builds);
    see the module docstring. Returns the timing fields of one row."""
    import dataclasses as dc

    from service.engine.batch import RowInstall
    from service.engine.request import SamplingOptions

    B, P = prompts.shape
    if runner.ecfg.num_slots != B:
        raise ValueError(f"the runner has {runner.ecfg.num_slots} rows; the sweep fills exactly B = {B}")
    g = runner.geometry
    greedy = tuple(RowInstall(row, SamplingOptions(temperature=0.0), False, ()) for row in range(B))
    tables = _page_tables(runner, B)

    # Prompts one at a time, each alone in its step (the first call compiles): TTFT's proxy.
    first_prefill, prefill_s = 0.0, []
    tokens = prompts[:, -1].copy()  # without prefill: decode from zeroed pages
    if prefill:
        t0 = time.perf_counter()
        runner.step(_prompt_batch(runner, prompts[0], 0, tables, greedy)).host()
        first_prefill = time.perf_counter() - t0
        for row in range(B):
            t0 = time.perf_counter()
            host = runner.step(_prompt_batch(runner, prompts[row], row, tables)).host()
            prefill_s.append(time.perf_counter() - t0)
            tokens[row] = host.ids[row]

    def decode_batch(position: int, from_prev: bool, installs: tuple = ()) -> Any:
        b = g.empty_batch(g.decode_bucket(B // g.replicas), 0)
        n = len(b.tokens) // g.replicas
        for row in range(B):  # row r of replica d: d's region, at r's rank among d's rows
            i = g.replica_of(row) * n + row % g.rows_per_replica
            b.positions[i], b.rows[i], b.generated[i], b.last_index[row] = position, row, True, i
            if from_prev:
                b.source[i] = 1
            else:
                b.tokens[i] = tokens[row]
        b.page_tables[:B] = tables
        return dc.replace(b, num_real=B, max_position=position, installs=installs)

    # Compile the decode program (its window covers the last timed position); the throwaway
    # step's writes at that position are overwritten before anything reads them.
    last = P + warmup_steps + steps - 1
    t0 = time.perf_counter()
    runner.step(decode_batch(last, False, () if prefill else greedy)).host()
    first_decode = time.perf_counter() - t0
    batches = [decode_batch(P + i, i > 0) for i in range(warmup_steps + steps)]
    for i, b in enumerate(batches):  # every step at the last one's window: one program
        batches[i] = dc.replace(b, max_position=last)

    # Serial: each step dispatched, then waited for (its call's time, and the step's).
    call_s, step_s, prev = [], [], None
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        out = runner.step(b, prev)
        t1 = time.perf_counter()
        out.host()
        if i >= warmup_steps:
            call_s.append(t1 - t0)
            step_s.append(time.perf_counter() - t0)
        prev = out
    # Pipelined, as the engine loop runs: step i+1 dispatched before step i's ids are read. The
    # interval between two landings is a step's only while the next step is dispatched within
    # it: where the runtime runs a step inside its dispatch (XLA:CPU, small programs) the drain
    # (the last step's ids read with nothing dispatched after them) times a host copy alone. So
    # the timed steps are followed by untimed ones at the last position (the same work), and
    # the drain is not timed: gap j is batch j + 1 landing after batch j.
    first = max(warmup_steps - 1, 0)
    trailing = [batches[-1]] * (1 if warmup_steps else 2)
    landed, prev = [], None
    for b in [*batches, *trailing]:
        out = runner.step(b, prev)
        if prev is not None:
            prev.host()
            landed.append(time.perf_counter())
        prev = out
    assert prev is not None
    prev.host()
    gaps = np.diff(landed)[first : first + steps].tolist()

    prefill_med = statistics.median(prefill_s) if prefill_s else None
    tpot = statistics.median(gaps)
    step = statistics.median(step_s)
    compile_prefill = max(0.0, first_prefill - prefill_med) if prefill_med is not None else 0.0
    return {
        "decode_window": last + 1,
        "compile_prefill_s": compile_prefill,
        "compile_decode_s": max(0.0, first_decode - step),
        "compile_s": compile_prefill + max(0.0, first_decode - step),
        "prefill_ms": _ms(prefill_med) if prefill_med is not None else None,
        "prefill_min_ms": _ms(min(prefill_s)) if prefill_s else None,
        "prefill_tok_s": P / prefill_med if prefill_med else None,
        "warmup_steps": warmup_steps,
        "steps": steps,
        "tpot_ms": _ms(tpot),
        "tpot_min_ms": _ms(min(gaps)),
        "tpot_max_ms": _ms(max(gaps)),
        "step_ms": _ms(step),
        "decode_call_ms": _ms(statistics.median(call_s)),
        "decode_tok_s": B / tpot,
    }


# ---- the roofline overlay ----------------------------------------------------------------------
# (cfg, plan, batch, prompt_len, context_len, dtype, KV dtype, measured TPOT s, measured prefill s,
#  the weights held as blocks by name -> format) -> fields
Predictor = Callable[[Any, Any, int, int, int, str, str, float, float, dict[str, str]], dict[str, Any]]

# Accelerator device kinds (``jax.devices()[0].device_kind``, lower case) -> hardware presets.
DEVICE_KIND_PRESETS = (("h200", "h200"), ("h100", "h100-sxm"), ("v5 lite", "tpu-v5e"), ("v5e", "tpu-v5e"),
                       ("v5p", "tpu-v5p"), ("v6", "tpu-v6e"))  # fmt: skip


def pick_hardware(hardware: str | None, platform_name: str, device_kind: str) -> tuple[Any, str]:
    """The ``benchmarks.roofline.Hardware`` to predict with, and a line saying which or why there is none.

    ``hardware``: a preset of ``configs/hardware.yaml``; None or "auto" = ``cpu-this-machine``
    (measured now by ``roofline.measure_cpu``) on the "cpu" platform, else the preset matching
    ``device_kind`` (``DEVICE_KIND_PRESETS``); "none" or "" = no prediction.
    """
    if hardware in ("none", ""):
        return None, "roofline overlay off (--hardware none)"
    from benchmarks import roofline as rl

    name = hardware
    if name in (None, "auto"):
        if platform_name == "cpu":
            name = "cpu-this-machine"
        else:
            kind = device_kind.lower()
            name = next((preset for key, preset in DEVICE_KIND_PRESETS if key in kind), None)
            if name is None:
                return None, f"no roofline overlay: no hardware preset for {device_kind!r} (pass --hardware)"
    try:
        hw = rl.load_hardware(name)
    except Exception as exc:  # an unusable preset must never sink a measurement
        return None, f"no roofline overlay: {exc}"
    bandwidth = f"{hw.hbm_bytes_per_s / 1e9:.1f} GB/s"
    peak = ", ".join(f"{v / 1e9:.0f} GFLOP/s {k}" for k, v in hw.peak_flops.items())
    return hw, f"roofline overlay: hardware {name!r} ({bandwidth}, {peak})"


def roofline_predictor(hardware: str | None, platform_name: str, device_kind: str) -> tuple[Predictor | None, str]:
    """A :data:`Predictor` on the hardware :func:`pick_hardware` picks (or None), and its line.

    The predictor returns the roofline's TPOT, TTFT, throughput and regime, the measured decode
    step's ``mbu`` and ``mfu`` and the measured prefill's ``prefill_mfu``
    (``benchmarks.roofline.decode_utilization`` / ``prefill_utilization``), the weights priced as
    held: its last argument names those held as blocks (``--weights int8``, a GGUF's blocks), the
    rest are floats of the sweep's dtype."""
    hw, line = pick_hardware(hardware, platform_name, device_kind)
    if hw is None:
        return None, line
    from benchmarks import roofline as rl

    def predict(
        cfg: Any,
        plan: Any,
        batch: int,
        prompt_len: int,
        context_len: int,
        dtype: str,
        kv_dtype: str,
        tpot_s: float,
        prefill_s: float,
        formats: dict[str, str],
    ) -> dict[str, Any]:
        par = rl.Parallelism.from_plan(plan)
        B = batch // par.dp
        wl = rl.Workload(batch=B, context_len=context_len, prompt_len=prompt_len, dtype=dtype, kv_dtype=kv_dtype)
        held = rl.held_weights(cfg, plan, wl.itemsize, formats) if formats else None
        r = rl.roofline(cfg, hw, par, wl, held)
        decode = rl.decode_utilization(cfg, hw, par, B, context_len, dtype, tpot_s, kv_dtype=kv_dtype, held=held)
        timed = prefill_s == prefill_s  # NaN: the point timed no prefill
        prefill = rl.prefill_utilization(cfg, hw, par, prompt_len, dtype, prefill_s, kv_dtype=kv_dtype, held=held)
        prefill_mfu = prefill.mfu if timed else None
        return {
            "predicted_tpot_ms": _ms(r.tpot_s),
            "predicted_ttft_ms": _ms(r.ttft_s),
            "predicted_tok_s": r.tokens_per_s,
            "predicted_regime": r.regime,
            "mbu": decode.mbu,
            "mfu": decode.mfu,
            "prefill_mfu": prefill_mfu,
        }

    return predict, line


# ---- loading -------------------------------------------------------------------------------------
def model_to_time(
    model: str | None,
    cache_dir: str | None,
    random: bool,
    tiny: bool,
    seed: int = 0,
    dtype: str = "float32",
    weights: str = "float",
) -> tuple[Any, Any, Any, str]:
    """(cfg, graphdef, params, description) of the model to time; weights in ``dtype``.

    ``tiny``: random weights at ``LlamaConfig.tiny()``'s shapes; ``random``: random weights at the
    model's shapes (reads only its config); else the model's own weights (GGUF, Hugging Face
    directory, or converted checkpoint, by ``model.weights.loader.load_model``: a checkpoint restored
    onto the first device, the others read on the host for the engine to place). ``weights``
    "int8": the matmul weights as Q8_0 blocks (random ones, ``model.weights.build.random_block_llama``,
    or the model's quantized at load, ``load_model(quantize="int8")``); "float": as ``dtype``.

    Raises:
        FileNotFoundError, ValueError: see ``model.weights.loader.load_model``.
    """
    import jax.numpy as jnp

    from model.config import LlamaConfig
    from model.weights.build import random_block_llama, random_llama
    from model.weights.loader import load_model, read_model_config

    def make_random(cfg: LlamaConfig) -> tuple[Any, Any]:
        if weights == "int8":
            return random_block_llama(cfg, seed, jnp.dtype(dtype), "q8_0")
        return random_llama(cfg, seed, jnp.dtype(dtype))

    held = ", matmul weights as int8 (Q8_0) blocks" if weights == "int8" else ""
    if tiny:
        cfg = LlamaConfig.tiny()
        return (cfg, *make_random(cfg), f"random weights, LlamaConfig.tiny(){held}")
    from model.weights.fetch import resolve_model

    path = resolve_model(model, cache_dir)
    if random:
        cfg = read_model_config(path)
        return (cfg, *make_random(cfg), f"random weights at the shapes of {path}{held}")
    m = load_model(path, dtype, quantize="int8" if weights == "int8" else None)
    return m.cfg, m.graphdef, m.state, f"{path} ({m.kind}){held}"


def default_layouts(num_devices: int) -> list[str]:
    """1x1, plus 1xN (tensor parallel) and Nx1 (data parallel) over all N devices when N > 1."""
    return ["1x1"] if num_devices == 1 else ["1x1", f"1x{num_devices}", f"{num_devices}x1"]


# ---- the sweep -----------------------------------------------------------------------------------
def run_sweep(
    scfg: SweepConfig,
    cfg: Any,
    graphdef: Any,
    params: Any,
    predictor: Predictor | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every (layout, prompt length, batch) point, in that nesting order, as one row each (keys:
    ``FIELDS``). Points that cannot be built (too few devices, an axis that does not divide)
    are rows with ``status`` "skipped: <why>"; failures are "error: <what>"."""
    from flax import nnx

    from model.weights.block_params import block_formats

    # The weights held as blocks (every layout's engine keeps them so), for the roofline's bytes.
    formats = {path.rsplit("/", 1)[-1]: fmt for path, fmt in block_formats(nnx.to_pure_dict(params)).items()}
    rows = []
    for form in scfg.layers:
        rows += _sweep_form(scfg, form, cfg, graphdef, params, formats, predictor, progress)
    return rows


def _sweep_form(
    scfg: SweepConfig,
    form: str,
    cfg: Any,
    graphdef: Any,
    params: Any,
    formats: dict[str, str],
    predictor: Predictor | None,
    progress: Callable[[dict[str, Any]], None] | None,
) -> list[dict[str, Any]]:
    from service.engine.config import EngineConfig
    from service.engine.runner import Runner
    from sharding.layouts import LayoutError, load_layout
    from sharding.plan import make_plan

    rows = []
    for name in scfg.layouts:
        for P in scfg.prompt_lens:
            prompts = make_prompts(max(scfg.batches), P, cfg.vocab_size, scfg.seed)
            for B in scfg.batches:
                row: dict[str, Any] = dict.fromkeys(FIELDS)
                row.update(layout=name, batch=B, prompt_len=P, max_seq_len=scfg.seq_len(P))
                engine = None
                try:
                    layout = load_layout(name)
                    row.update(data=layout.data, model=layout.model, devices=layout.num_devices)
                    plan = make_plan(layout, cfg, B)
                    row["attention"] = plan.attention
                    seq = scfg.seq_len(P)
                    ecfg = EngineConfig(
                        num_slots=B,
                        max_seq_len=seq,
                        chunk_size=P,
                        max_num_batched_tokens=P,
                        dtype=scfg.dtype,
                        kv_dtype=scfg.kv_dtype,
                        layer_loop=form,
                        kv_cache_tokens=B * -(-seq // 16) * 16,
                    )
                    t0 = time.perf_counter()
                    engine = Runner(cfg, graphdef, params, layout, ecfg)
                    row["setup_s"] = time.perf_counter() - t0
                    row["layers"] = engine.ecfg.layer_loop  # "auto" resolved
                    row["kv_dtype"] = engine.ecfg.kv_dtype  # "auto" resolved
                    row.update(measure_point(engine, prompts[:B], scfg.steps, scfg.warmup_steps, scfg.prefill))
                    row["status"] = "ok"
                except LayoutError as exc:
                    row["status"] = f"skipped: {exc}"
                except Exception as exc:
                    log.exception("sweep point %s B=%d P=%d failed", name, B, P)
                    row["status"] = f"error: {type(exc).__name__}: {exc}"
                finally:
                    del engine
                    gc.collect()
                if row["status"] == "ok" and predictor is not None:
                    try:
                        tpot_s = row["tpot_ms"] / 1e3
                        prefill_s = row["prefill_ms"] / 1e3 if row["prefill_ms"] is not None else float("nan")
                        kv, window = row["kv_dtype"], row["decode_window"]
                        row.update(predictor(cfg, plan, B, P, window, scfg.dtype, kv, tpot_s, prefill_s, formats))
                        row["roofline_fraction"] = row["predicted_tpot_ms"] / row["tpot_ms"]
                    except Exception as exc:  # a prediction must never lose a measurement
                        log.warning("roofline prediction failed for %s B=%d P=%d: %s", name, B, P, exc)
                rows.append(row)
                if progress is not None:
                    progress(row)
    return rows


# ---- outputs -------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def format_row(row: dict[str, Any]) -> str:
    head = f"{row['layout']:>8s} B={row['batch']:<4d} P={row['prompt_len']:<5d}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    prefill = tpot = ""
    if row["predicted_tpot_ms"] is not None:
        tpot = f" (roofline {row['predicted_tpot_ms']:.2f} ms, MBU {row['mbu']:.1%}, MFU {row['mfu']:.1%})"
        if row["prefill_mfu"] is not None:
            prefill = f" (roofline {row['predicted_ttft_ms']:.2f} ms, MFU {row['prefill_mfu']:.1%})"
    prefill = f"prefill {row['prefill_ms']:8.2f} ms/prompt{prefill}  " if row["prefill_ms"] is not None else ""
    return (
        f"{head} {row['layers']:>8s} {prefill}TPOT {row['tpot_ms']:8.2f} ms{tpot}  step {row['step_ms']:.2f} ms  "
        f"{row['decode_tok_s']:8.1f} tok/s  decode call {row['decode_call_ms']:.2f} ms  compile {row['compile_s']:.1f} s"
    )


def write_results(rows: list[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write ``sweep.csv``, ``sweep.json`` and (with matplotlib) the plots; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with (out / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if row.get(k) is None else row[k] for k in FIELDS})
    (out / "sweep.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return [out / "sweep.csv", out / "sweep.json", *plot_results(rows, out)]


def pareto_front(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (tpot, throughput) points no other point beats on both (lower TPOT, higher throughput),
    by increasing TPOT."""
    front: list[tuple[float, float]] = []
    for tpot, tput in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or tput > front[-1][1]:
            front.append((tpot, tput))
    return front


def plot_results(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """``pareto.png`` and ``step_time.png`` in ``out_dir``; [] when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        log.info("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return []
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in ok:
        series.setdefault((r["layout"], r["prompt_len"]), []).append(r)
    several_p = len({p for _, p in series}) > 1
    has_pred = any(r["predicted_tpot_ms"] is not None for r in ok)
    colors = [f"C{i % 10}" for i in range(len(series))]

    def label(key: tuple[str, int]) -> str:
        return f"{key[0]}, P={key[1]}" if several_p else key[0]

    fig = Figure(figsize=(8, 6))
    ax = fig.add_subplot()
    for color, (key, rs) in zip(colors, series.items(), strict=True):
        rs = sorted(rs, key=lambda r: r["batch"])
        ax.plot([r["tpot_ms"] for r in rs], [r["decode_tok_s"] for r in rs], "o-", color=color, label=label(key))
        for r in rs:
            ax.annotate(f"B={r['batch']}", (r["tpot_ms"], r["decode_tok_s"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
        pred = [r for r in rs if r["predicted_tpot_ms"] is not None]
        if pred:
            ax.plot([r["predicted_tpot_ms"] for r in pred], [r["predicted_tok_s"] for r in pred], "x--",
                    color=color, alpha=0.6, label=f"{label(key)} (roofline)")  # fmt: skip
    front = pareto_front([(r["tpot_ms"], r["decode_tok_s"]) for r in ok])
    ax.step([p[0] for p in front], [p[1] for p in front], "k:", where="post", lw=1, label="Pareto frontier (measured)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("TPOT: decode step time (ms)")
    ax.set_ylabel("decode throughput, all slots (tokens/s)")
    ax.set_title("Throughput vs per-token latency" + (" (dashed: roofline)" if has_pred else ""))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out_dir / "pareto.png", dpi=120, bbox_inches="tight")

    fig = Figure(figsize=(8, 6))
    ax = fig.add_subplot()
    for color, (key, rs) in zip(colors, series.items(), strict=True):
        rs = sorted(rs, key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rs], [r["tpot_ms"] for r in rs], "o-", color=color, label=label(key))
        pred = [r for r in rs if r["predicted_tpot_ms"] is not None]
        if pred:
            ax.plot([r["batch"] for r in pred], [r["predicted_tpot_ms"] for r in pred], "x--",
                    color=color, alpha=0.6, label=f"{label(key)} (roofline)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size B (decoding slots)")
    ax.set_ylabel("decode step time (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Step time vs batch: flat while memory-bound, rising past the compute-bound knee")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out_dir / "step_time.png", dpi=120, bbox_inches="tight")
    return [out_dir / "pareto.png", out_dir / "step_time.png"]


# ---- command line -------------------------------------------------------------------------------
def add_sweep_arguments(p: argparse.ArgumentParser) -> None:
    """The ``meshserve-bench sweep`` flags."""
    p.add_argument("--model", help="GGUF file or model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--cache-dir", help="model cache (default $MESHSERVE_CACHE or ~/.cache/meshserve)")
    p.add_argument("--random", action="store_true", help="random weights at the model's shapes (speed is the same)")
    p.add_argument("--tiny", action="store_true", help="random weights at LlamaConfig.tiny()'s shapes (smoke tests)")
    p.add_argument("--layouts", nargs="+", help="presets or DxM (default: 1x1, 1xN and Nx1 over the N devices)")
    p.add_argument("--batches", nargs="+", type=positive_int, default=[1, 2, 4, 8, 16, 32, 64], help="(%(default)s)")
    p.add_argument("--prompt-lens", nargs="+", type=positive_int, default=[128], help="prompt tokens (%(default)s)")
    p.add_argument("--steps", type=positive_int, default=16, help="timed decode steps per point (%(default)s)")
    p.add_argument("--warmup-steps", type=nonnegative_int, default=2, help="untimed decode steps first (%(default)s)")
    p.add_argument("--max-seq-len", type=positive_int, help="KV tokens per slot (default: prompt + steps + 1)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="parameters (%(default)s)")
    p.add_argument(
        "--weights",
        choices=["float", "int8"],
        default="float",
        help="matmul weights as --dtype (%(default)s) or as int8 (Q8_0) blocks: random ones with --random/--tiny, "
        "else the model's quantized at load; the roofline overlay still prices them as --dtype",
    )
    p.add_argument(
        "--kv-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="KV cache (%(default)s: --dtype's)",
    )
    p.add_argument(
        "--layers",
        nargs="+",
        choices=["auto", "scan", "unrolled"],
        default=["auto"],
        help="EngineConfig.layer_loop forms, each timed at every point (%(default)s: scan on CPU, unrolled "
        "on accelerators)",
    )
    p.add_argument(
        "--no-prefill",
        dest="prefill",
        action="store_false",
        help="time decode only, from zeroed pages (one program less to compile per point)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the prompt ids and random weights (%(default)s)")
    p.add_argument(
        "--hardware",
        default="auto",
        help="roofline preset for the overlay (configs/hardware.yaml), 'auto' (this CPU, or the accelerator's "
        "kind) or 'none' (%(default)s)",
    )
    p.add_argument("--cpu-devices", type=positive_int, help="fake N CPU devices (sets XLA_FLAGS before JAX starts)")
    p.add_argument("--out", default="sweep-results", help="directory for CSV, JSON and plots (%(default)s)")


def _set_cpu_devices(n: int) -> None:
    if "jax" in sys.modules:
        import jax

        if jax.device_count() != n:
            print(f"meshserve-bench sweep: JAX is already started with {jax.device_count()} devices; --cpu-devices ignored",
                  file=sys.stderr)  # fmt: skip
        return
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run_from_args(args: argparse.Namespace) -> int:
    """Run ``meshserve-bench sweep``: print a line per point, write the results, say where.

    Returns 0 when every point was measured or skipped (with its reason) and at least one was
    measured; 1 otherwise. Exits with a message, before measuring, on contradictory flags or an
    ``--out`` that is not a directory."""
    if args.tiny and args.model:
        raise SystemExit("meshserve-bench sweep: --tiny times LlamaConfig.tiny(); drop --model or --tiny")
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise SystemExit(f"meshserve-bench sweep: --out {args.out} is a file; give a directory")
    if args.cpu_devices:
        _set_cpu_devices(args.cpu_devices)
    import jax

    devices = jax.devices()
    # The roofline's hardware first: "auto" measures this CPU (roofline.measure_cpu), whose read
    # rate comes out low while XLA is still computing --random's weights beside it.
    predictor, overlay = roofline_predictor(args.hardware, devices[0].platform, devices[0].device_kind)
    try:
        scfg = SweepConfig(
            layouts=tuple(args.layouts or default_layouts(len(devices))),
            batches=tuple(args.batches),
            prompt_lens=tuple(args.prompt_lens),
            steps=args.steps,
            warmup_steps=args.warmup_steps,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            layers=tuple(args.layers),
            prefill=args.prefill,
            seed=args.seed,
            max_seq_len=args.max_seq_len,
        )
        cfg, graphdef, params, source = model_to_time(
            args.model, args.cache_dir, args.random, args.tiny, args.seed, args.dtype, args.weights
        )
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"meshserve-bench sweep: {exc}") from None
    print(
        f"meshserve-bench sweep: {source}; {cfg.param_count() / 1e6:.1f} M parameters, {args.dtype}; "
        f"{len(devices)} {devices[0].platform} device(s) ({devices[0].device_kind})\n  {overlay}",
        file=sys.stderr,
    )
    meta = {
        "model": source,
        "config": dataclasses.asdict(cfg),
        "parameters": cfg.param_count(),
        "sweep": dataclasses.asdict(scfg),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "num_devices": len(devices),
        "jax": jax.__version__,
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "roofline": overlay,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    rows = run_sweep(scfg, cfg, graphdef, params, predictor, progress=lambda r: print(format_row(r), flush=True))
    paths = write_results(rows, meta, args.out)
    print(f"meshserve-bench sweep: wrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    measured = [r for r in rows if r["status"] == "ok"]
    if not measured:
        print(
            "meshserve-bench sweep: no point was measured (every one skipped or failed: see the rows)", file=sys.stderr
        )
        return 1
    if not any(p.suffix == ".png" for p in paths):  # with a measured point, only for want of matplotlib
        print("meshserve-bench sweep: no plots (matplotlib missing: pip install -e '.[bench]')", file=sys.stderr)
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped") for r in rows) else 1
