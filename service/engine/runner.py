"""The runner: one model on one mesh, with its placed parameters, its paged KV pool, the rows'
device state (sampling parameters, token history) and the compiled step (``Runner.step``).

Each step runs a flat batch of tokens (``service.engine.batch.RaggedBatch``; the model's
``ragged_step``): one token for every decoding sequence (and, for a speculating one, its draft
ids after it) and prefill chunks of any number of prompts, and samples one id for every row
whose token is a decode token or the last of its prefill, and one for every token followed by
a draft id (``RaggedBatch.drafted``: the id the verifier compares with that draft). Its jit arguments are the weights, the two cache arrays, the token history, the
sampling parameters, ten small metadata arrays and the token mask: their number is the same
whatever the pool size, the longest sequence or the number of rows, so the call's dispatch does
not grow with them.

What runs where is chosen once, by ``model.kernels.choose`` for the mesh's devices: the
attention backend, the weights' form (packed panels, stored blocks' kernel), the argmax and the
layer loop. The attention backend says which windows to compile (``window_buckets``).

Data parallelism (a layout's ``data`` axis, d replicas): the pool's pages and the rows are split
over ``data``, each replica serving its rows from its own range of pages; the flat batch is d
equal regions, one per replica, and the step runs ``ragged_step`` as one ``jax.vmap`` over them
(``_per_replica``), so no replica reads another's pages.

A job over several processes (``service.engine.distributed``): process 0's runner sends each
call that launches JAX work (``MIRRORED``) over its ``channel`` before making it, and the other
processes make the same calls on their own runners, in the same order.

Programs = decode x prefill x window buckets (``Geometry``); ``warmup`` compiles the ones short
sequences need and the largest window's (``warm_programs``). After warm-up no step waits for a
compile: a step whose program is not compiled yet runs in the smallest compiled program that
holds its batch (``Geometry.widen``: more padding, a wider window, the same ids) while its own
compiles on a background thread (``compile_ahead``), which later steps of its shape then run
(and which lands in JAX's persistent compilation cache). ``compiles`` counts them.

The token history (``model.sampling.TokenHistory``, for the penalties): a row is written whole
when its request is admitted (``RowInstall.history``: the prompt's ids and the ids it already
generated, which a preempted request brings back), and each step counts its decode tokens,
whose inputs are generated ids, draft ids among them; a row whose drafts were rejected is
written whole again with the next step (``StepPlan.reinstalled``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Collection
from concurrent.futures import CancelledError, Future
from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model import kernels as kernel_choice
from model.attention.base import StepMeta
from model.attention.pages import PagedKVCache
from model.config import LlamaConfig
from model.llama import ragged_step
from model.sampling import SamplingParams, TokenHistory, mask_words, sample, seed_to_key, uses_penalties
from model.weights.build import abstract_llama
from model.weights.quant_panels import QuantPanels
from service.engine import kv_pool
from service.engine.batch import MIN_WINDOW, Geometry, RaggedBatch, RowInstall, pick_bucket
from service.engine.config import EngineConfig, resolve_kv_dtype
from service.engine.output import TOP_LOGPROBS, StepOutput, pack_step
from sharding.layouts import Layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import cache_shardings, param_shardings, replicated

log = logging.getLogger(__name__)

# The calls process 0's runner mirrors to its followers: a step's, and a live switch's (made on
# the runner being built).
MIRRORED = ("step", "compile_ahead", "warmup", "relayout", "warmup_to_replace", "adopt_state")
PREVIOUS = "meshserve:previous-step-output"  # a mirrored step's ``prev``: the previous step's own output
STOP = "stop"  # process 0's last message: the followers leave
WARM_WINDOW = 512  # tokens: windows compiled before SERVING without --warmup-full

Program = tuple[int, int, int]  # (decode bucket, prefill bucket, window pages)
# One background compile at a time in the process: two would halve each other's cores and the steps'.
_BACKGROUND_COMPILE = threading.Lock()


class CompileCounts:
    """Ragged-step programs compiled after warm-up, shared by a runner and the runners that
    replace it (a live switch), for the metrics. Thread-safe.

    Attributes:
        ahead: compiled off the steps' path: a new shape, on a background thread, or a live
            switch's programs, compiled before the new runner takes over.
        in_step: compiled in a step, which waited for it (no compiled program held its batch,
            or a wider EOS list made every program stale).
        widened_steps: steps run in a larger compiled program while theirs compiled.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ahead = self.in_step = self.widened_steps = 0

    def add(self, ahead: int = 0, in_step: int = 0, widened_steps: int = 0) -> None:
        with self._lock:
            self.ahead += ahead
            self.in_step += in_step
            self.widened_steps += widened_steps


class Channel(Protocol):
    """Where process 0 sends its mirrored calls (``service.engine.distributed.StepChannel``)."""

    def send(self, message: Any) -> None: ...


class Runner:
    """Owns the placed params, the KV pool, the rows' device state and the compiled steps of one
    layout.

    Not thread-safe: one engine-loop thread calls every method after construction (``relayout``
    may run on another thread: it only reads the weights).

    Args:
        cfg: model hyperparameters.
        graphdef: the Llama module's graph (``nnx.split``).
        params: host or device state of the parameters (placed here, in the form the kernels
            take, with the layout's shardings).
        layout: the mesh layout.
        engine_cfg: sizes, dtypes and kernel modes.
        devices: devices to build the mesh on (default: all).

    Raises:
        LayoutError: the layout does not fit the devices or does not divide the model's axes.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        graphdef: nnx.GraphDef,
        params: Any,
        layout: Layout,
        engine_cfg: EngineConfig,
        devices: list[jax.Device] | None = None,
    ):
        self.cfg = cfg
        self.layout = layout
        self.dtype = jnp.dtype(engine_cfg.dtype)
        self.plan = make_plan(layout, cfg, engine_cfg.num_slots)
        self.mesh = make_mesh(layout, devices)
        mesh_devices = list(self.mesh.devices.flat)
        self.kv_dtype = jnp.dtype(resolve_kv_dtype(engine_cfg.kv_dtype, engine_cfg.dtype))
        self.kernels = kernel_choice.choose(
            mesh_devices, cfg, self.dtype, self.kv_dtype, attention=engine_cfg.attention, matmul=engine_cfg.matmul,
            layer_loop=engine_cfg.layer_loop,
        )  # fmt: skip
        engine_cfg = dataclasses.replace(engine_cfg, kv_dtype=self.kv_dtype.name, layer_loop=self.kernels.layer_loop)
        rules = self.plan.rules
        S, ps = engine_cfg.num_slots, engine_cfg.page_size
        self.graphdef, self.params, self.param_sharding = place_params(
            graphdef, params, self.dtype, self.kernels, self.mesh, rules
        )
        self.repl = replicated(self.mesh)
        # Data parallelism: each data replica serves its own rows from its own pool (pages split
        # over ``data``: replica r holds pages [r P/d, (r + 1) P/d), numbered 0.. in its tables).
        self.replicas = d = layout.data
        # The pool's size, from what was asked or from the memory left once the weights are placed.
        one_page: NamedSharding = cache_shardings(PagedKVCache.abstract(cfg, d, ps, self.kv_dtype), self.mesh, rules).k  # type: ignore[assignment]
        per_token = (
            2
            * math.prod(one_page.shard_shape(PagedKVCache.shape(cfg, d, ps, self.kv_dtype)))
            * self.kv_dtype.itemsize
            // ps
        )
        tokens = kv_pool.pool_tokens(
            kv_cache_tokens=engine_cfg.kv_cache_tokens,
            kv_cache_memory=engine_cfg.kv_cache_memory,
            num_slots=S,
            max_seq_len=engine_cfg.max_seq_len,
            page_size=ps,
            per_token=per_token,
            num_devices=len(mesh_devices),
            device_free=kv_pool.device_free_bytes(mesh_devices),
            host_available=kv_pool.host_available_bytes(),
            replicas=d,
        )
        if jax.process_count() > 1 and not engine_cfg.kv_cache_tokens:
            # Sized from each process's own memory: every process must build the same pool.
            tokens = kv_pool.agreed_tokens(tokens)
        # The resolved size replaces the ask, so a relayout (live switch) keeps the same pages.
        self.ecfg = dataclasses.replace(engine_cfg, kv_cache_tokens=tokens, kv_cache_memory=0)
        self.num_pages = self.ecfg.num_pages
        self.pages_per_replica = self.num_pages // d
        self.pool_bytes_per_device = tokens // d * per_token
        self._cache_sh = cache_shardings(
            PagedKVCache.abstract(cfg, self.num_pages, ps, self.kv_dtype), self.mesh, rules
        )
        log.info(
            "KV pool: %d pages of %d positions (%d tokens, %.1f MB per device, as `meshserve layouts` counts) "
            "in %d data replica(s)",
            self.num_pages, ps, tokens, self.pool_bytes_per_device / 1e6, d,
        )  # fmt: skip
        self.cache = jax.jit(
            partial(PagedKVCache.zeros, cfg, self.num_pages, ps, self.kv_dtype), out_shardings=self._cache_sh
        )()
        self.history = jax.jit(partial(TokenHistory.zeros, S, cfg.vocab_size), out_shardings=self.repl)()
        log.info("kernels: %s", self.kernels.describe())
        max_pages = -(-self.ecfg.max_seq_len // ps)
        self.geometry = Geometry.make(
            S, d, ps, self.ecfg.max_seq_len, self.ecfg.chunk_size, self.ecfg.max_num_batched_tokens,
            self.kernels.attention.window_buckets(max_pages, -(-MIN_WINDOW // ps)), self.ecfg.verify_tokens,
        )  # fmt: skip
        # Compiled programs, and those compiling on a background thread (``compile_ahead``). Read
        # on the loop thread while a background compile inserts: copied (``list``) to iterate.
        self._programs: dict[Program, Any] = {}
        self._compiling: dict[Program, Future] = {}
        self._compiles_abandoned = False
        self.warmed = False  # after warmup(): new shapes compile ahead (``step``)
        self.compiles = CompileCounts()
        # The rows' sampling parameters: host arrays written by the batches' installs, uploaded
        # once before the next step that follows a change (not on every step).
        self._sp = SamplingParams.host(S)
        self._sp_device: SamplingParams | None = None
        # Step inputs split by replica: token regions, page tables and rows over ``data``.
        self.by_replica = NamedSharding(self.mesh, P("data")) if d > 1 else self.repl
        self._no_prev = global_array(np.zeros((S, 2 + 2 * TOP_LOGPROBS), np.float32), self.repl)
        # The token masks of steps without constrained rows (``RaggedBatch.token_mask``), by their
        # number of sampling slots: all allowed.
        self._all_allowed: dict[int, jax.Array] = {}
        self._set_row = jax.jit(TokenHistory.with_row, out_shardings=self.repl, donate_argnums=(0,))
        self.channel: Channel | None = None  # process 0 of a job: the followers' (MIRRORED)

    def _mirror(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Send call ``name`` to the followers first (process 0 of a job; else nothing)."""
        if self.channel is not None:
            self.channel.send((name, args, kwargs))

    # ---- the compiled step -----------------------------------------------------------------
    def _program(self, key: Program, args: tuple[Any, ...], in_step: bool = True) -> Any:
        """Program ``key`` compiled (``jax.stages.Compiled``) for ``args``, the step's arguments
        (``_arguments``): as compiled, by a background compile (waited for), or compiled now.
        Compiled ahead of its first call, and called as compiled, so that compiling never runs
        it: a live switch compiles the new runner's programs while the old one steps
        (``warmup_to_replace``). ``in_step``: a step waits for it (counted after warm-up)."""
        program = self._programs.get(key)
        if program is None and (future := self._compiling.get(key)) is not None:
            with contextlib.suppress(Exception):  # compiled again below, where an error is raised
                program = future.result()
        if program is None:
            program = self._programs.get(key)  # inserted between the two looks
        if program is None:
            t0 = time.perf_counter()
            program = self._programs[key] = self._jit(*key).lower(*args).compile()
            if self.warmed and in_step:  # the step (and every stream) waited for it
                self.compiles.add(in_step=1)
                log.info(
                    "compiled the ragged-step program for %d decode + %d prefill tokens over %d pages in a step "
                    "in %.1f s", *key, time.perf_counter() - t0,
                )  # fmt: skip
        return program

    def _jit(self, decode_tokens: int, prefill_tokens: int, window_pages: int) -> Any:
        """The jitted step of program (``decode_tokens``, ``prefill_tokens``, ``window_pages``)."""
        # Locals, not ``self``: a jitted function closing over its runner is a reference cycle
        # that kept old runners (weights, KV pool) alive until a full garbage collection.
        graphdef, argmax, attention = self.graphdef, self.kernels.argmax, self.kernels.attention
        d, ps, seq_block = self.replicas, self.ecfg.page_size, self.geometry.seq_block

        def run(
            params,
            cache,
            history,
            sp,
            host_tokens,
            source,
            prev,
            positions,
            rows,
            generated,
            page_tables,
            sample_index,
            sample_rows,
            sample_main,
            ban,
            mask,
        ):  # type: ignore[no-untyped-def]
            S = page_tables.shape[0]
            from_prev = prev[jnp.clip(rows, 0, S - 1), 0].astype(jnp.int32)
            tokens = jnp.where(source == 1, from_prev, host_tokens)
            # A decode token's id is one its row generated (a draft id is, once kept): count it.
            counted = generated & (rows >= 0) & (positions >= 0)
            history = history.counted(rows, tokens, counted)
            model = nnx.merge(graphdef, params)

            def step(cache, tokens, positions, rows, tables, last):  # type: ignore[no-untyped-def]
                meta = StepMeta.build(
                    tables, rows, positions, ps, window_pages=window_pages, decode_tokens=decode_tokens,
                    seq_block=seq_block,
                )  # fmt: skip
                return ragged_step(model, cache, tokens, meta, last, attention)

            if d == 1:
                logits, cache = step(cache, tokens, positions, rows, page_tables, sample_index)
            else:
                logits, cache = _per_replica(step, d, cache, tokens, positions, rows, page_tables, sample_index)
            # The sampling slots' rows of the per-row state (an empty slot reads row 0's: its id is dropped).
            real = sample_rows >= 0
            own = jnp.where(real, sample_rows, 0)
            slot_sp = dataclasses.replace(jax.tree.map(lambda a: a[own], sp), ban_eos=ban)
            # A slot that verifies a draft sees the drafts before its own position only (read only
            # by the penalties: a step without them gathers the rows' histories as they are).
            slot_history = jax.lax.cond(
                jnp.any(uses_penalties(slot_sp) & real),
                lambda: history.at_slots(own, positions[sample_index], rows, positions, tokens, counted),
                lambda: TokenHistory(counts=history.counts[own], in_prompt=history.in_prompt[own]),
            )
            # ``mask``: one per slot (a speculating row's positions each have their own).
            next_ids = sample(logits, slot_sp, positions[sample_index] + 1, argmax, slot_history, mask)
            packed = pack_step(logits, next_ids, jnp.any(slot_sp.logprobs & real), mask)
            # One row per row, its ``last_index`` token's (what the host and the next step's ``prev``
            # read); empty slots and the slots that verify draft ids dropped.
            by_row = (
                jnp.zeros((S, packed.shape[1]), packed.dtype)
                .at[jnp.where(real & sample_main, sample_rows, S)]
                .set(packed, mode="drop")
            )
            return by_row, packed, logits, cache, history

        r, by = self.repl, self.by_replica
        # Over several processes process 0 reads only its own devices: the per-slot results (read
        # in a step that verified draft ids) are gathered to every device there.
        slots_sh = by if by.is_fully_addressable else r
        return jax.jit(
            run,
            in_shardings=(self.param_sharding, self._cache_sh, r, r, by, by, r, by, by, by, by, by, by, by, r, r),
            # Logits and the per-slot results stay with their replica's devices (logits read by
            # tests only; the per-slot results by the loop only in a step that verified draft ids).
            out_shardings=(r, slots_sh, by, self._cache_sh, r),
            donate_argnums=(1, 2),
        )

    def step(self, batch: RaggedBatch, prev: StepOutput | None = None) -> StepOutput:
        """Install the batch's rows (``batch.installs``), then dispatch one ragged step
        (asynchronous).

        Args:
            batch: the inputs, laid out as ``service.engine.batch`` says.
            prev: the previous step's output, when ``batch.source`` reads from it.

        Returns:
            One row per row of the batch (rows that sample nothing are meaningless).

        Raises:
            ValueError: a position past ``max_seq_len``, or regions no bucket holds.
        """
        key = self._program_of(batch)  # a bad batch raises here, before the followers see it
        if key not in self._programs and self.warmed:
            cover = self._cover(key)
            if cover is not None:  # run in it while this shape compiles, rather than wait
                self.compile_ahead(batch)
                batch = self.geometry.widen(batch, *cover)
                self.compiles.add(widened_steps=1)
        self._mirror("step", batch, PREVIOUS if prev is not None else None)
        return self.dispatch(batch, prev)

    def _cover(self, key: Program) -> Program | None:
        """The cheapest compiled program that holds a batch of program ``key`` (each region and
        the window at least as large; fewest tokens, then the narrowest window), or None."""
        d, p, w = key
        fits = [k for k in list(self._programs) if k[0] >= d and k[1] >= p and k[2] >= w]
        return min(fits, key=lambda k: (k[0] + k[1], k[2]), default=None)

    def compile_ahead(self, batch: RaggedBatch) -> None:
        """Compile the program ``batch`` needs on a background thread, unless it is compiled or
        compiling; its steps run it once it is in (``_program``). The thread holds the GIL while
        it traces, not while XLA compiles."""
        key = self._program_of(batch)
        if key in self._programs or key in self._compiling:
            return
        self._mirror("compile_ahead", batch)
        specs = jax.tree.map(  # shapes and shardings only: the arrays may be donated meanwhile
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
            if isinstance(a, jax.Array) else a,
            self._arguments(batch, None),
        )  # fmt: skip
        width, jitted = self._sp["eos_ids"].shape[1], self._jit(*key)
        future: Future = Future()
        self._compiling[key] = future

        def compile_in_background() -> None:
            # Below the steps' threads: on a host whose cores also run the steps (a CPU mesh), the
            # compile takes what they leave.
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                with _BACKGROUND_COMPILE:
                    if self._compiles_abandoned:
                        raise CancelledError
                    t0 = time.perf_counter()
                    program = jitted.lower(*specs).compile()
            except BaseException as exc:  # the step that needs it compiles it again, and raises
                self._compiling.pop(key, None)
                future.set_exception(exc)
                return
            if self._sp["eos_ids"].shape[1] == width:  # else every program went stale meanwhile
                self._programs[key] = program
            self._compiling.pop(key, None)
            self.compiles.add(ahead=1)
            log.info(
                "compiled the ragged-step program for %d decode + %d prefill tokens over %d pages off the steps' "
                "path in %.1f s", *key, time.perf_counter() - t0,
            )  # fmt: skip
            future.set_result(program)

        # Not a daemon (as the loop thread is): the interpreter's exit waits for it (XLA aborted
        # the process when exit killed a thread mid-compile); ``abandon_compiles`` drops the queued.
        threading.Thread(target=compile_in_background, name="compile-ahead", daemon=False).start()

    def abandon_compiles(self) -> None:
        """Compile no more programs in the background (the runner is stopping or replaced): those
        queued are dropped, the one compiling finishes."""
        self._compiles_abandoned = True

    def _program_of(self, batch: RaggedBatch) -> Program:
        """The program ``batch`` runs: its regions' buckets and its window.

        Raises:
            ValueError: a position past ``max_seq_len``, or regions no bucket holds.
        """
        if batch.max_position >= self.ecfg.max_seq_len:
            raise ValueError(f"position {batch.max_position} past max_seq_len {self.ecfg.max_seq_len}")
        g = self.geometry
        window = batch.window_pages or g.window(batch.max_position)
        if window not in g.window_buckets or window < g.window(batch.max_position):
            raise ValueError(
                f"a window of {window} pages: buckets are {g.window_buckets}, position {batch.max_position}"
            )
        if len(batch.tokens) % self.replicas:
            raise ValueError(f"{len(batch.tokens)} tokens do not split into {self.replicas} equal regions")
        decode = batch.decode_tokens
        prefill = len(batch.tokens) // self.replicas - decode
        if decode not in g.decode_buckets or prefill not in g.prefill_buckets:
            raise ValueError(
                f"regions of {decode} decode and {prefill} prefill tokens: buckets are "
                f"{g.decode_buckets} and {g.prefill_buckets}"
            )
        return decode, prefill, window

    def _arguments(
        self, batch: RaggedBatch, prev: StepOutput | None, samplers: tuple[np.ndarray, np.ndarray] | None = None
    ) -> tuple[Any, ...]:
        """The step's arguments for ``batch`` (the jitted ``run``'s, in order); ``samplers``:
        ``Geometry.samplers(batch)`` when the caller has it."""
        sample_rows, sample_index = samplers if samplers is not None else self.geometry.samplers(batch)
        own = np.maximum(sample_rows, 0)
        ban = batch.ban_eos[own] & (sample_rows >= 0)
        main = (sample_rows >= 0) & (batch.last_index[own] == sample_index)  # not a draft's verifier
        host = (batch.tokens, batch.source, batch.positions, batch.rows, batch.generated, batch.page_tables)
        split: tuple[np.ndarray | jax.Array, ...] = (*host, sample_index, sample_rows, main)
        if not self.by_replica.is_fully_addressable:  # over several processes: jit takes no numpy there
            split = tuple(global_array(np.asarray(a), self.by_replica) for a in split)
        tokens, source, positions, rows, generated, page_tables, slot_index, slot_rows, slot_main = split
        previous = prev.packed if prev is not None else self._no_prev
        if batch.token_mask is not None:
            mask = global_array(batch.token_mask, self.repl)
        else:
            if len(sample_rows) not in self._all_allowed:
                words = mask_words(self.cfg.vocab_size)
                allowed = np.full((len(sample_rows), words), -1, np.int32)
                self._all_allowed[len(sample_rows)] = global_array(allowed, self.repl)
            mask = self._all_allowed[len(sample_rows)]
        return (
            self.params, self.cache, self.history, self._sampling(), tokens, source, previous, positions, rows,
            generated, page_tables, slot_index, slot_rows, slot_main, ban, mask,
        )  # fmt: skip

    def dispatch(self, batch: RaggedBatch, prev: StepOutput | None) -> StepOutput:
        """A step of ``batch`` as it is: no mirroring, no other program chosen (a follower
        runs what process 0 sent); its program compiled here if it is not yet (waiting for a
        background compile of it)."""
        key = self._program_of(batch)
        for install in batch.installs:
            self._install(install)
        samplers = self.geometry.samplers(batch)
        args = self._arguments(batch, prev, samplers)
        packed, slots, logits, self.cache, self.history = self._program(key, args)(*args)
        return StepOutput(packed, logits, samplers[0], slots if batch.drafted is not None else None)

    # ---- per-row state ---------------------------------------------------------------------
    def _install(self, install: RowInstall) -> None:
        """A request's row: its sampling parameters (uploaded before the step; more EOS ids than
        any request so far widen the per-row array to the next power of two, one recompile),
        and, when it uses penalties, its token history, written whole (asynchronously)."""
        width = self._sp["eos_ids"].shape[1]
        write_sampling_row(self._sp, install)
        self._sp_device = None
        if self._sp["eos_ids"].shape[1] != width:  # every program takes the old shape
            self._programs.clear()
            self._compiling.clear()
        if install.history is not None:
            prompt_ids, generated_ids = install.history
            V = self.cfg.vocab_size
            in_prompt = np.zeros(V, bool)
            in_prompt[np.asarray(prompt_ids, np.int64)] = True
            counts = np.bincount(np.asarray(generated_ids, np.int64), minlength=V).astype(np.int32)
            self.history = self._set_row(self.history, np.int32(install.row), counts, in_prompt)

    def _sampling(self) -> SamplingParams:
        if self._sp_device is None:
            self._sp_device = SamplingParams(**upload_host_arrays(self._sp, self.repl))
        return self._sp_device

    # ---- compiling ahead -------------------------------------------------------------------
    def idle_batch(self, program: Program) -> RaggedBatch:
        """A batch of ``program``'s shapes, all padding but one token of row 0 at the window's
        last position (or ``max_seq_len``'s: the largest window's last page may reach past it),
        page table all page 0: for warm-up (it writes one position of page 0, which no sequence
        has yet)."""
        decode, prefill, window = program
        b = self.geometry.empty_batch(decode, prefill)
        position = min(window * self.ecfg.page_size, self.ecfg.max_seq_len) - 1
        real = decode if prefill else 0
        b.positions[real], b.rows[real] = position, 0
        return dataclasses.replace(b, num_real=1, max_position=position)

    def warm_programs(self, full: bool = False) -> list[Program]:
        """The (decode bucket, prefill bucket, window pages) programs ``warmup`` compiles: at the
        smallest window, every decode bucket's decode-only step and every prefill bucket beside
        every decode bucket of mixed steps (new prompts while sequences are short); decode-only
        steps at every window up to ``WARM_WINDOW`` tokens (sequences growing); and at the
        largest window decode-only steps of every decode bucket and the largest of all, so that
        a compiled program holds every batch (``step``). With ``full``, every prefill bucket and
        window with all rows decoding, and decode-only steps of every decode bucket and window.
        A backend with one window compiles one program per (decode, prefill) pair."""
        ps, g = self.ecfg.page_size, self.geometry
        D, Pb, W = g.decode_buckets, g.prefill_buckets, g.window_buckets
        if full:
            return list(dict.fromkeys([(D[-1], p, w) for p in Pb for w in W] + [(d, 0, w) for d in D[:-1] for w in W]))
        warm = [w for w in W[1:] if w * ps <= WARM_WINDOW]
        return list(
            dict.fromkeys(
                [(d, 0, W[0]) for d in D]
                + [(d, p, W[0]) for d in g.mixed_decode_buckets for p in Pb[1:]]
                + [(d, 0, w) for d in D for w in warm]
                + [(d, 0, W[-1]) for d in D]
                + [(D[-1], Pb[-1], W[-1])]
            )
        )

    def warmup(self, full: bool = False, also: Collection[Program] = ()) -> float:
        """Compile (and run once) ``warm_programs(full)`` and the programs ``also`` names; the rest
        compile ahead when first needed (``step``). Returns the seconds spent."""
        self._mirror("warmup", full=full, also=tuple(also))
        return self._warm([*self.warm_programs(full), *also])

    def _warm(self, programs: list[Program], run: bool = True) -> float:
        """Compile ``programs`` and, with ``run``, run each once on an idle batch."""
        t0 = time.perf_counter()
        programs = list(dict.fromkeys(programs))
        for program in programs:
            batch = self.idle_batch(program)
            self._program(program, self._arguments(batch, None), in_step=False)
            if run:
                self.dispatch(batch, None).host()
        elapsed = time.perf_counter() - t0
        log.info("warm-up compiled %d ragged-step programs in %.1f s", len(programs), elapsed)
        self.warmed = True
        return elapsed

    # ---- layout switch -----------------------------------------------------------------------
    def warmup_to_replace(self, old: Runner) -> float:
        """Before this runner takes over from ``old`` (a live switch): compile the programs
        ``warmup`` does and ``replacement_programs(old)``, so traffic like ``old``'s compiles
        nothing after the switch. Compiles only, runs nothing: ``old`` keeps stepping meanwhile
        (``SetLayout`` builds beside the loop), and two programs with collectives running at
        once on the same devices wait on each other (XLA:CPU aborted the process when an
        all-reduce of the new layout's warm-up waited 40 s for a device busy with the old
        layout's steps). Counted as compiled ahead in the ``compiles`` this runner shares with
        ``old`` (``relayout``). Returns the seconds spent."""
        self._mirror("warmup_to_replace")
        programs = list(dict.fromkeys([*self.warm_programs(), *self.replacement_programs(old)]))
        elapsed = self._warm(programs, run=False)
        self.compiles.add(ahead=len(programs))
        return elapsed

    def replacement_programs(self, old: Runner) -> list[Program]:
        """The programs here that serve the steps ``old`` has compiled or is compiling: each of
        its (decode, prefill, window) buckets as this runner's buckets take it (sizes past the largest
        clipped to it), and, where this runner has fewer data replicas, also the regions that
        hold ``old``'s replicas' tokens together (sizes x old replicas / these)."""
        g = self.geometry

        def fit(n: int, buckets: tuple[int, ...]) -> int:
            return pick_bucket(min(n, buckets[-1]), buckets)

        scales = [1] if old.replicas <= self.replicas else [1, -(-old.replicas // self.replicas)]
        return list(
            dict.fromkeys(
                (
                    fit(d * k, g.mixed_decode_buckets if p else g.decode_buckets),
                    fit(p * k, g.prefill_buckets),
                    fit(w, g.window_buckets),
                )
                for d, p, w in [*old._programs, *old._compiling]
                for k in scales
            )
        )

    def relayout(self, layout: Layout, devices: list[jax.Device], params: Any = None) -> Runner:
        """A new runner with this runner's weights on ``layout``'s mesh over ``devices``.

        The weights move through the host (in a job over several processes device to device),
        take the form the new devices' kernels run and are put on the new shardings, unless
        ``params`` (e.g. restored from a checkpoint into the new shardings) are given; the new
        runner has its own empty pool and history until ``adopt_state``. Safe to call from
        another thread while this runner keeps stepping: it reads the weights and runs no
        program with collectives (a job's loop thread calls it between two steps).

        Raises:
            LayoutError: the layout does not fit ``devices`` or the model's axes.
            ValueError: ``params`` given in a job over several processes (restored on this
                process alone, they cannot be mirrored).
        """
        if params is not None and self.channel is not None:
            raise ValueError("a job over several processes moves the live weights; restored ones cannot be mirrored")
        self._mirror("relayout", layout, [d.id for d in devices])
        if params is None:
            # Within one process, through the host: a device-to-device reshard is a program of
            # collectives, which must not run beside this runner's steps (``warmup_to_replace``).
            # Across processes the loop thread builds between two steps: nothing runs beside it.
            live = self.params if self.mesh.is_multi_process else jax.device_get(self.params)
            new = Runner(self.cfg, self.graphdef, live, layout, self.ecfg, devices)
        else:
            new = Runner(self.cfg, abstract_llama(self.cfg)[0], params, layout, self.ecfg, devices)  # as loaded
        new.channel = self.channel
        new.compiles = self.compiles
        return new

    def adopt_state(self, old: Runner) -> None:
        """Take over ``old``'s token history and sampling state (moved to this mesh) and, when
        both have as many data replicas, its pages: the page numbers stay, so the scheduler's
        tables remain valid. With another replica count the pages are not taken (each replica's
        pool is another range of them): the scheduler must have recomputed every sequence
        (``Scheduler.repartition``). Call between two steps."""
        self._mirror("adopt_state")
        if old.replicas == self.replicas:
            self.cache = jax.device_put(old.cache, self._cache_sh)
        self.history = jax.device_put(old.history, self.repl)
        self._sp = {k: v.copy() for k, v in old._sp.items()}
        self._sp_device = None

    # ---- facts -------------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold here: ``max_seq_len``, and no more than one
        replica's pool (a sequence's pages all come from its replica's)."""
        return min(self.ecfg.max_seq_len, self.pages_per_replica * self.ecfg.page_size)

    def weight_bytes_per_device(self) -> dict[str, int]:
        """Bytes of parameters held by each device, keyed by device id string."""
        return bytes_per_device(self.params)


# ---- placement ------------------------------------------------------------------------------------
def place_params(
    graphdef: nnx.GraphDef, params: Any, dtype: jnp.dtype, kernels: kernel_choice.Kernels, mesh: jax.sharding.Mesh,
    rules: Any,
) -> tuple[nnx.GraphDef, Any, Any]:  # fmt: skip
    """A model's parameters on a layout's mesh: float host arrays cast to ``dtype``, put in the
    form ``kernels`` run (``model.kernels.to_form``), placed by ``param_shardings``.

    Returns:
        (the graph of that form, the placed state, its tree of shardings).

    Raises:
        LayoutError: a split axis does not divide (``param_shardings``).
    """
    params = jax.tree.map(  # blocks kept as stored keep their dtypes
        lambda a: np.asarray(a, dtype) if isinstance(a, np.ndarray) else a,
        params,
        is_leaf=lambda x: isinstance(x, QuantPanels),
    )
    graphdef, params = kernel_choice.to_form(graphdef, params, kernels)
    sharding = param_shardings(params, mesh, rules)
    if mesh.is_multi_process:
        # Each process places only its own shards of the host copy it read (``global_array``):
        # no collective per weight comparing whole arrays across processes.
        def place(s: jax.sharding.Sharding, sub: Any) -> Any:  # ``sharding`` is a prefix of ``params``
            return jax.tree.map(
                lambda a: global_array(a, s) if isinstance(a, np.ndarray) else jax.device_put(a, s), sub
            )

        return graphdef, jax.tree.map(place, sharding, params), sharding
    return graphdef, jax.device_put(params, sharding), sharding


def global_array(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``host`` on ``sharding``: ``jax.device_put`` where the sharding's devices are all this
    process's; where it spans several processes (jax.distributed,
    ``service.engine.distributed``), built from this process's own shards of ``host``, which
    every process must hold alike (not checked: ``device_put`` would compare it across the
    processes, a collective per array, and ``jit`` refuses numpy inputs for a sharding there
    that is not fully replicated)."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def upload_host_arrays(host: dict[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """Device copies of host arrays (the sampling parameters), shapes and dtypes kept. Copies
    first: ``write_sampling_row`` writes the host arrays in place, and a CPU ``device_put`` may
    alias numpy memory."""
    return {k: global_array(v.copy(), sharding) for k, v in host.items()}


def bytes_per_device(tree: Any) -> dict[str, int]:
    """Bytes of ``tree``'s array shards held by each device, keyed by device id string."""
    out: dict[str, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            key = str(shard.device.id)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out


def write_sampling_row(sp: dict[str, np.ndarray], install: RowInstall) -> None:
    """Write one request's sampling parameters into row ``install.row`` of the host arrays
    ``sp`` (``SamplingParams.host``'s, in place). More EOS ids than the per-row width replaces
    ``sp["eos_ids"]`` with one widened to the next power of two (-1 padding)."""
    slot, options = install.row, install.sampling
    sp["temperature"][slot] = options.temperature
    sp["top_k"][slot] = options.top_k
    sp["top_p"][slot] = options.top_p
    sp["keys"][slot] = seed_to_key(options.seed)
    sp["logprobs"][slot] = install.logprobs
    sp["presence_penalty"][slot] = options.presence_penalty
    sp["frequency_penalty"][slot] = options.frequency_penalty
    sp["repetition_penalty"][slot] = options.repetition_penalty
    sp["min_p"][slot] = options.min_p
    ids = install.eos_ids
    rows, width = sp["eos_ids"].shape
    if len(ids) > width:
        wider = np.full((rows, 1 << (len(ids) - 1).bit_length()), -1, np.int32)
        wider[:, :width] = sp["eos_ids"]
        sp["eos_ids"] = wider
    sp["eos_ids"][slot] = -1
    sp["eos_ids"][slot, : len(ids)] = ids


def _per_replica(
    step: Any,
    replicas: int,
    cache: PagedKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    rows: jax.Array,
    page_tables: jax.Array,
    sample_index: jax.Array,
) -> tuple[jax.Array, PagedKVCache]:
    """``step`` (``ragged_step`` with its static arguments bound) run by each data replica on its
    own region, rows and pool, as one ``jax.vmap`` over a leading replica axis that the SPMD
    partitioner keeps on the ``data`` mesh axis (``spmd_axis_name``), so no replica reads
    another's pages.

    Args: the whole flat batch (``RaggedBatch``'s layout): tokens, positions, rows [N] (rows
        global, N = replicas x n), page_tables [S, max_pages] (pages numbered within each
        replica's pool), sample_index [d R] (global indices of the tokens sampled from, R per
        replica, each in its replica's region), cache [L, P, ...] (replica r's pool: pages
        [r P/d, (r + 1) P/d)).

    Returns:
        logits [d R, V] and the cache, as ``ragged_step``'s.
    """
    d, S = replicas, page_tables.shape[0]
    n, S_r = tokens.shape[0] // d, S // d
    replica = jnp.arange(d, dtype=jnp.int32)[:, None]

    def split(a: jax.Array) -> jax.Array:
        return a.reshape(d, a.shape[0] // d, *a.shape[1:])

    local_rows = jnp.where(split(rows) >= 0, split(rows) - replica * S_r, -1)
    local_last = split(sample_index) - replica * n

    def pages(a: jax.Array) -> jax.Array:  # [L, P, ...] -> [L, d, P/d, ...]
        return a.reshape(a.shape[0], d, a.shape[1] // d, *a.shape[2:])

    def one(k, v, tokens, positions, rows, tables, last):  # type: ignore[no-untyped-def]
        logits, c = step(PagedKVCache(k=k, v=v), tokens, positions, rows, tables, last)
        return logits, c.k, c.v

    logits, k, v = jax.vmap(one, in_axes=(1, 1, 0, 0, 0, 0, 0), out_axes=(0, 1, 1), spmd_axis_name="data")(
        pages(cache.k), pages(cache.v), split(tokens), split(positions), local_rows, split(page_tables), local_last
    )

    def whole(a: jax.Array) -> jax.Array:
        return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])

    return logits.reshape(-1, logits.shape[-1]), PagedKVCache(k=whole(k), v=whole(v))
