"""The paged engine: params, one paged KV pool and one compiled ragged step, for one model on one
mesh.

Each step runs a flat batch of tokens (``model.llama.ragged_step``): one token for every
decoding sequence and prefill chunks of any number of prompts, and samples one id for every
row (``EngineConfig.num_slots`` rows; a row is the sequence a ``PagedScheduler`` placed there)
whose token is a decode token or the last of its prefill. Its jit arguments are the weights
(stacked: the scan form), the two cache arrays, the token history, the sampling parameters
and eleven small metadata arrays: their number is the same whatever the pool size, the longest
sequence or the number of rows, so the call's dispatch does not grow with them.

The flat batch has two regions (``RaggedBatch``): the decode region, one position per decode
token (each gathers its own window, so padding there costs a whole window of copies: the region
is a bucket of the decoding rows, not always one position per row), and the prefill region,
where each chunk starts at a multiple of ``seq_block`` tokens, so that ``ragged_step`` gathers
each block's window once (``ragged_paged_attention_blocks``) rather than once per token.

Data parallelism (a layout's ``data`` axis, d replicas): the pool's pages and the rows are split
over ``data``, each replica serving its rows from its own range of pages; the flat batch is d
equal regions, one per replica, each laid out as above, and the step runs ``ragged_step`` as
one ``jax.vmap`` over them (``_per_replica``), so no replica reads another's pages. The sizes
below are then per replica (rows S/d).

Shape variants: the decode region is a power of two from ``MIN_DECODE`` up to the row count;
the prefill region 0 tokens or a power of two times ``seq_block`` up to
``max_num_batched_tokens`` (rounded up to a block), or up to one chunk per row where that is
less; attention reads a power-of-two number of
pages per sequence covering the step's longest (``MIN_WINDOW`` tokens at least; where decode
tokens attend through the native CPU kernel, which reads any position, the prefill region's
longest only). Programs = decode x prefill x window buckets, e.g. 1 x 5 x 5 = 25 for 4 rows,
512 tokens a step in blocks of 64 and 2,048-token sequences in pages of 16 (with native decode
attention: decode-only steps are one program per decode bucket, 1 + 4 x 5 = 21). ``warmup``
compiles the ones short sequences need (``warm_programs``: 7 of those 25, 5 with native decode
attention); the rest compile on first use (and land in JAX's persistent compilation cache).

The token history (``model.sampling.TokenHistory``, for the penalties) is kept as the slots
engine keeps it, with one difference: a request's row is written whole when it is admitted
(``set_history``: the prompt's ids and the ids it already generated, which a preempted request
brings back), and each step counts only decode tokens, whose input is a generated id.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Collection
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from model import cpu_argmax, cpu_matmul
from model.config import LlamaConfig
from model.kernels import choose_attention, has_stored_blocks
from model.llama import SEQ_BLOCK, ragged_step
from model.packed_weights import packed_bytes, stacked_panel_weights
from model.paged_kv import PagedKVCache
from model.sampling import SamplingParams, TokenHistory, first_argmax, sample
from service import kv_pool
from service.engine import (
    TOP_LOGPROBS,
    EngineConfig,
    StepOutput,
    bytes_per_device,
    global_array,
    pack_step,
    pick_bucket,
    place_params,
    power_of_two_buckets,
    resolve_kv_dtype,
    upload_host_arrays,
    write_sampling_row,
)
from service.request import SamplingOptions
from sharding.layouts import Layout
from sharding.mesh import make_mesh
from sharding.plan import make_plan
from sharding.rules import cache_shardings, replicated

log = logging.getLogger(__name__)

MIN_WINDOW = 128  # tokens: the smallest attention window
MIN_DECODE = 8  # the smallest decode region (all rows when there are fewer)
WARM_WINDOW = 512  # tokens: windows compiled before SERVING without --warmup-full


@dataclasses.dataclass(frozen=True)
class RaggedBatch:
    """One step's inputs on the host: one region of n = D + P tokens for each of the engine's
    ``replicas`` (N = replicas x n, region r at [r n, (r + 1) n)). A region has its decode
    region [0, D) (its replica's decode tokens, then padding; D = ``decode_tokens``, a
    ``PagedEngine.decode_bucket``) and its prefill region [D, n), P a
    ``PagedEngine.prefill_bucket``, each chunk starting at a multiple of
    ``PagedEngine.seq_block`` from D. Region r holds only tokens of replica r's rows
    (``PagedEngine.replica_of``), whose page tables number the pages of replica r's pool.

    Attributes:
        tokens: [N] int32 input ids (those with ``source`` 1 are read on the device).
        positions: [N] int32, each token's position in its sequence; -1 for padding.
        rows: [N] int32, each token's row (its sequence); -1 for padding.
        source: [N] int32: 0 the id is ``tokens``'s, 1 it is the id the previous step sampled
            for the token's row (still on the device).
        generated: [N] bool, the token is a decode token (its id is a generated one, counted
            in the row's history for the penalties).
        last_index: [R] int32, for each row the index in [0, N) of the token whose logits it
            samples from, within its replica's region (that region's first index for rows that
            sample nothing).
        ban_eos: [R] bool, the row's sampled id may not be one of its EOS ids.
        page_tables: [R, max_pages] int32, each row's pages in order, numbered within its
            replica's pool ([0, ``PagedEngine.pages_per_replica``)).
        num_real: real tokens (the rest are padding).
        max_position: the largest position of a real token.
        decode_tokens: D, each region's decode region's length.
        prefill_max_position: the largest position of a real token in a prefill region; -1
            when there is none.
    """

    tokens: np.ndarray
    positions: np.ndarray
    rows: np.ndarray
    source: np.ndarray
    generated: np.ndarray
    last_index: np.ndarray
    ban_eos: np.ndarray
    page_tables: np.ndarray
    num_real: int
    max_position: int
    decode_tokens: int
    prefill_max_position: int = -1


class PagedEngine:
    """Owns the sharded params, the paged KV pool and the compiled ragged steps of one layout.

    Not thread-safe: one engine-loop thread calls every method after construction. The weights
    always take the stacked (scan) form (``ecfg.layers`` says "scan"); decode tokens attend
    through the native CPU kernel of ``model.cpu_paged_attention`` on one CPU device where it
    is built and ``ecfg.decode_attention`` is "auto" (``kernels``, chosen by
    ``model.kernels.choose_attention``), else, like the prefill region, through XLA's path.

    Args: as ``service.engine.Engine``; ``engine_cfg.paged`` holds.

    Raises:
        LayoutError: the layout does not fit the devices or does not divide the model's axes.
        ValueError: ``engine_cfg`` is not paged (``EngineConfig.paged``).
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
        if not engine_cfg.paged:
            raise ValueError(
                f"PagedEngine needs a paged config, got kv_cache={engine_cfg.kv_cache!r}, layers={engine_cfg.layers!r}"
            )
        self.cfg = cfg
        self.graphdef = graphdef
        self.layout = layout
        self.dtype = jnp.dtype(engine_cfg.dtype)
        self.plan = make_plan(layout, cfg, engine_cfg.num_slots)
        self.mesh = make_mesh(layout, devices)
        platform = self.mesh.devices.flat[0].platform
        kv_dtype = resolve_kv_dtype(engine_cfg.kv_dtype, engine_cfg.dtype)
        engine_cfg = dataclasses.replace(engine_cfg, layers="scan", kv_dtype=kv_dtype, kv_cache="paged")
        self.ecfg = engine_cfg
        self.kv_dtype = jnp.dtype(kv_dtype)
        rules = self.plan.rules
        S, ps = engine_cfg.num_slots, engine_cfg.page_size
        self.max_pages = -(-engine_cfg.max_seq_len // ps)
        self.params, self.param_sharding = place_params(params, self.dtype, "scan", self.mesh, rules)
        self.repl = replicated(self.mesh)
        # Data parallelism: each data replica serves its own rows from its own pool (pages split
        # over ``data``: replica r holds pages [r P/d, (r + 1) P/d), numbered 0.. in its tables).
        self.replicas = layout.data
        self.rows_per_replica = S // self.replicas  # make_plan checked that data divides S
        # The pool's size, from what was asked or from the memory left once the weights are placed.
        d = self.replicas
        one_page = cache_shardings(PagedKVCache.abstract(cfg, d, ps, self.kv_dtype), self.mesh, rules).k
        shape = PagedKVCache.shape(cfg, d, ps)
        per_token = 2 * math.prod(one_page.shard_shape(shape)) * self.kv_dtype.itemsize // ps
        devices_of_mesh = list(self.mesh.devices.flat)
        tokens = kv_pool.pool_tokens(
            kv_cache_tokens=engine_cfg.kv_cache_tokens,
            kv_cache_memory=engine_cfg.kv_cache_memory,
            num_slots=S,
            max_seq_len=engine_cfg.max_seq_len,
            page_size=ps,
            per_token=per_token,
            num_devices=len(devices_of_mesh),
            device_free=kv_pool.device_free_bytes(devices_of_mesh),
            host_available=kv_pool.host_available_bytes(),
            replicas=d,
        )
        if jax.process_count() > 1 and not engine_cfg.kv_cache_tokens:
            # Sized from each process's own memory: every process must build the same pool.
            tokens = kv_pool.agreed_tokens(tokens)
        # The resolved size replaces the ask, so a relayout (live switch) keeps the same pages.
        engine_cfg = dataclasses.replace(engine_cfg, kv_cache_tokens=tokens, kv_cache_memory=0)
        self.ecfg = engine_cfg
        self.num_pages = engine_cfg.num_pages
        self.pages_per_replica = self.num_pages // d
        self.pool_bytes_per_device = tokens // d * per_token
        cache_sh = cache_shardings(PagedKVCache.abstract(cfg, self.num_pages, ps, self.kv_dtype), self.mesh, rules)
        self._cache_sh = cache_sh
        log.info(
            "KV pool: %d pages of %d positions (%d tokens, %.1f MB per device, as `meshserve layouts` counts) "
            "in %d data replica(s)",
            self.num_pages, ps, tokens, self.pool_bytes_per_device / 1e6, d,
        )  # fmt: skip
        self.cache = jax.jit(
            partial(PagedKVCache.zeros, cfg, self.num_pages, ps, self.kv_dtype), out_shardings=cache_sh
        )()
        self.history = jax.jit(partial(TokenHistory.zeros, S, cfg.vocab_size), out_shardings=self.repl)()
        one_cpu = self.mesh.devices.size == 1 and platform == "cpu"
        self.argmax = cpu_argmax.first_argmax if one_cpu and cpu_argmax.available() else first_argmax
        # Decode tokens attend through the native kernel where it runs (one CPU device): XLA's
        # per-token windows and tiny dots cost ~10x more there (model/cpu_paged_attention.py).
        self.kernels = choose_attention("paged", devices_of_mesh, engine_cfg.decode_attention, cfg, self.kv_dtype)
        log.info("paged decode attention: %s", self.kernels.name)
        # Float32 layer matmuls (and the LM head) through the native panel kernel where it runs
        # (one CPU device): a packed second copy of those weights, read in place at the scan's
        # layer index, where XLA's dots first copy each layer's slice of the stacked weights.
        # Weights held as stored blocks have a kernel of their own and are not packed.
        self.panels: dict[str, Any] | None = None
        if packs_panels(self.mesh.devices.size, platform, engine_cfg, self.dtype):
            self.panels = stacked_panel_weights(nnx.merge(graphdef, self.params)) or None
        if self.panels:
            how = f"native CPU kernel, float32 panels ({self.panel_bytes() / 1e6:.0f} MB packed: {', '.join(self.panels)})"
        elif has_stored_blocks(self.params):
            how = "the weights held as blocks through their kernel (above); any float32 ones through XLA's dots"
        else:
            how = "XLA's dots"
        log.info("paged matmuls: %s", how)

        # Blocks of the prefill region: a chunk pads to a whole block, so no bigger than a chunk.
        self.seq_block = min(SEQ_BLOCK, engine_cfg.chunk_size)
        # The region holds a step's chunks: at most the budget, and at most one chunk per row.
        blocks_of = lambda n: -(-n // self.seq_block) * self.seq_block  # noqa: E731
        # (Per replica: each replica's region holds its own rows' tokens under its own budget.)
        S_r = self.rows_per_replica
        region = min(blocks_of(engine_cfg.max_num_batched_tokens), S_r * blocks_of(engine_cfg.chunk_size))
        self.prefill_buckets = [0, *power_of_two_buckets(self.seq_block, region)]
        self.decode_buckets = power_of_two_buckets(min(MIN_DECODE, S_r), S_r)
        self.window_buckets = power_of_two_buckets(min(-(-MIN_WINDOW // ps), self.max_pages), self.max_pages)
        self._fns: dict[tuple[int, int, int], Any] = {}
        self.warmed = False  # after warmup(): a program compiled later is logged (it stalls a step)
        # Sampling parameters: host arrays changed by set_sampling, uploaded once before the next
        # step that follows a change (not on every step).
        self._sp = SamplingParams.host(S)
        self._sp_device: SamplingParams | None = None
        # Step inputs split by replica: token regions, page tables and rows over ``data``.
        self.by_replica = NamedSharding(self.mesh, P("data")) if d > 1 else self.repl
        self._no_prev = global_array(np.zeros((S, 2 + 2 * TOP_LOGPROBS), np.float32), self.repl)
        self._set_row = jax.jit(_set_history_row, out_shardings=self.repl, donate_argnums=(0,))

    # ---- the compiled step ---------------------------------------------------------------
    def _step_fn(self, decode_tokens: int, prefill_tokens: int, window_pages: int) -> Any:
        key = (decode_tokens, prefill_tokens, window_pages)
        if key not in self._fns:
            # Locals, not ``self``: a jitted function closing over its engine is a reference
            # cycle that kept old engines alive until a full garbage collection.
            graphdef, argmax, seq_block, kernels = self.graphdef, self.argmax, self.seq_block, self.kernels
            d = self.replicas

            def run(
                params,
                panels,
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
                last_index,
                ban,
            ):  # type: ignore[no-untyped-def]
                S = page_tables.shape[0]
                from_prev = prev[jnp.clip(rows, 0, S - 1), 0].astype(jnp.int32)
                tokens = jnp.where(source == 1, from_prev, host_tokens)
                real = (rows >= 0) & (positions >= 0)
                # A decode token's id is one its row generated: count it (padding goes to row S, dropped).
                counts = history.counts.at[jnp.where(generated & real, rows, S), tokens].add(1, mode="drop")
                history = TokenHistory(counts=counts, in_prompt=history.in_prompt)
                model = nnx.merge(graphdef, params)
                step = partial(
                    ragged_step, model, window_pages=window_pages, prefill_from=decode_tokens,
                    seq_block=seq_block, kernels=kernels, panels=panels,
                )  # fmt: skip
                if d == 1:
                    logits, cache = step(cache, tokens, positions, rows, page_tables, last_index)
                else:
                    logits, cache = _per_replica(step, d, cache, tokens, positions, rows, page_tables, last_index)
                sp = dataclasses.replace(sp, ban_eos=ban)
                next_ids = sample(logits, sp, positions[last_index] + 1, argmax, history)
                return pack_step(logits, next_ids, jnp.any(sp.logprobs)), logits, cache, history

            r, by = self.repl, self.by_replica
            self._fns[key] = jax.jit(
                run,
                in_shardings=(self.param_sharding, r, self._cache_sh, r, r, by, by, r, by, by, by, by, by, r),
                # Logits stay with their replica's devices (read by tests, not by the loop).
                out_shardings=(r, by, self._cache_sh, r),
                donate_argnums=(2, 3),
            )
        return self._fns[key]

    # ---- per-row state ---------------------------------------------------------------------
    def set_sampling(
        self, slot: int, options: SamplingOptions, logprobs: bool = False, eos_ids: Collection[int] = ()
    ) -> None:
        """Install a request's sampling parameters in row ``slot`` (uploaded before the next step;
        no recompile, except when more EOS ids than any request so far widen the per-row array
        to the next power of two)."""
        write_sampling_row(self._sp, slot, options, logprobs, eos_ids)
        self._sp_device = None

    def set_history(self, slot: int, prompt_ids: list[int], generated_ids: list[int]) -> None:
        """Write row ``slot`` of the token history whole: the prompt's ids and the counts of the
        ids already generated (a preempted request's, recomputed). Asynchronous."""
        V = self.cfg.vocab_size
        in_prompt = np.zeros(V, bool)
        in_prompt[np.asarray(prompt_ids, np.int64)] = True
        counts = np.bincount(np.asarray(generated_ids, np.int64), minlength=V).astype(np.int32)
        self.history = self._set_row(self.history, np.int32(slot), counts, in_prompt)

    def _sampling(self) -> SamplingParams:
        if self._sp_device is None:
            self._sp_device = SamplingParams(**upload_host_arrays(self._sp, self.repl))
        return self._sp_device

    # ---- the step ---------------------------------------------------------------------------
    def decode_bucket(self, num_tokens: int) -> int:
        """The decode region's length for ``num_tokens`` decode tokens (<= the row count)."""
        return pick_bucket(num_tokens, self.decode_buckets)

    def prefill_bucket(self, num_tokens: int) -> int:
        """The prefill region's length for ``num_tokens`` (chunks already padded to blocks).

        Raises:
            ValueError: more than the largest bucket.
        """
        return pick_bucket(num_tokens, self.prefill_buckets)

    def step(self, batch: RaggedBatch, prev: StepOutput | None = None) -> StepOutput:
        """Dispatch one ragged step (asynchronous).

        Args:
            batch: the inputs, laid out as ``RaggedBatch`` says.
            prev: the previous step's output, when ``batch.source`` reads from it.

        Returns:
            One row per row of the batch (rows that sample nothing are meaningless).

        Raises:
            ValueError: a position past ``max_seq_len``, or more tokens than a step holds.
        """
        if batch.max_position >= self.ecfg.max_seq_len:
            raise ValueError(f"position {batch.max_position} past max_seq_len {self.ecfg.max_seq_len}")
        decode = batch.decode_tokens
        prefill = len(batch.tokens) // self.replicas - decode
        if len(batch.tokens) % self.replicas:
            raise ValueError(f"{len(batch.tokens)} tokens do not split into {self.replicas} equal regions")
        # The window covers the tokens that gather one: all of them on XLA's path, only the
        # prefill region's where decode tokens attend natively (the kernel reads any position).
        reach = batch.prefill_max_position if self.kernels.native else batch.max_position
        window = pick_bucket(max(reach, 0) // self.ecfg.page_size + 1, self.window_buckets)
        if decode not in self.decode_buckets or prefill not in self.prefill_buckets:
            raise ValueError(
                f"regions of {decode} decode and {prefill} prefill tokens: buckets are "
                f"{self.decode_buckets} and {self.prefill_buckets}"
            )
        cold = self.warmed and (decode, prefill, window) not in self._fns
        fn = self._step_fn(decode, prefill, window)
        t0 = time.perf_counter() if cold else 0.0
        host = (batch.tokens, batch.source, batch.positions, batch.rows, batch.generated, batch.page_tables)
        split: tuple[np.ndarray | jax.Array, ...] = (*host, batch.last_index)
        if not self.by_replica.is_fully_addressable:  # over several processes: jit takes no numpy there
            split = tuple(global_array(a, self.by_replica) for a in (*host, batch.last_index))
        tokens, source, positions, rows, generated, page_tables, last_index = split
        packed, logits, self.cache, self.history = fn(
            self.params,
            self.panels or {},
            self.cache,
            self.history,
            self._sampling(),
            tokens,
            source,
            prev.packed if prev is not None else self._no_prev,
            positions,
            rows,
            generated,
            page_tables,
            last_index,
            batch.ban_eos,
        )
        if cold:  # compiled in the call: the step (and every stream) waited for it
            log.info(
                "compiled the ragged-step program for %d decode + %d prefill tokens over %d pages on first use "
                "in %.1f s (serve --warmup-full compiles %d programs before SERVING)",
                decode, prefill, window, time.perf_counter() - t0, len(self.warm_programs(full=True)),
            )  # fmt: skip
        return StepOutput(packed, logits)

    def replica_of(self, row: int) -> int:
        """The data replica serving ``row`` (rows [r S/d, (r + 1) S/d) are replica r's)."""
        return row // self.rows_per_replica

    @property
    def max_request_tokens(self) -> int:
        """The most tokens one request may hold here: ``max_seq_len``, and no more than one
        replica's pool (a sequence's pages all come from its replica's)."""
        return min(self.ecfg.max_seq_len, self.pages_per_replica * self.ecfg.page_size)

    def empty_batch(self, decode_tokens: int, prefill_tokens: int) -> RaggedBatch:
        """All padding: ``replicas`` regions of ``decode_tokens`` + ``prefill_tokens`` tokens,
        every row sampling from its region's first token, page tables all page 0. The loop's
        batches and the builders below fill one in."""
        S, n = self.ecfg.num_slots, decode_tokens + prefill_tokens
        N = self.replicas * n
        return RaggedBatch(
            tokens=np.zeros(N, np.int32),
            positions=np.full(N, -1, np.int32),
            rows=np.full(N, -1, np.int32),
            source=np.zeros(N, np.int32),
            generated=np.zeros(N, bool),
            last_index=(np.arange(S, dtype=np.int32) // self.rows_per_replica * n).astype(np.int32),
            ban_eos=np.zeros(S, bool),
            page_tables=np.zeros((S, self.max_pages), np.int32),
            num_real=0,
            max_position=-1,
            decode_tokens=decode_tokens,
        )

    def prompt_batch(self, ids: list[int], row: int = 0) -> RaggedBatch:
        """One prompt's first chunk alone: ``ids`` (at most the largest prefill bucket) at
        positions 0.. in ``row``, over pages 0, 1, ... (a fresh pool's), sampling at its last
        token. For tests and benchmarks; the loop builds its batches from plans.

        Raises:
            ValueError: more ids than a step's prefill region holds.
        """
        n, D = len(ids), self.decode_buckets[0]
        if not 1 <= n <= self.prefill_buckets[-1]:
            raise ValueError(f"{n} ids: a prompt batch holds 1 to {self.prefill_buckets[-1]}")
        b = self.empty_batch(D, self.prefill_bucket(-(-n // self.seq_block) * self.seq_block))
        start = self.replica_of(row) * len(b.tokens) // self.replicas + D
        b.tokens[start : start + n], b.positions[start : start + n], b.rows[start : start + n] = ids, np.arange(n), row
        b.last_index[row] = start + n - 1
        b.page_tables[row] = np.arange(self.max_pages) % self.pages_per_replica
        return dataclasses.replace(b, num_real=n, max_position=n - 1, prefill_max_position=n - 1)

    def idle_batch(self, decode_tokens: int, prefill_tokens: int, max_position: int) -> RaggedBatch:
        """A batch with regions of ``decode_tokens`` and ``prefill_tokens``, all padding but one
        token of row 0 at ``max_position``, the prefill region's first (the decode region's
        without one), page table all page 0: for warm-up (it writes one position of page 0,
        which no sequence has yet). Its window is ``max_position``'s."""
        b = self.empty_batch(decode_tokens, prefill_tokens)
        real = decode_tokens if prefill_tokens else 0
        b.positions[real], b.rows[real] = max_position, 0
        return dataclasses.replace(
            b, num_real=1, max_position=max_position, prefill_max_position=max_position if prefill_tokens else -1
        )

    def warm_programs(self, full: bool = False) -> list[tuple[int, int, int]]:
        """The (decode bucket, prefill bucket, window pages) programs ``warmup`` compiles: every
        decode and prefill bucket at the smallest window (new prompts while sequences are short),
        and, unless decode tokens attend natively (``kernels.native``: then a step's window
        covers its prefill region only, and decode-only steps are one program per decode
        bucket), decode-only steps at every window up to ``WARM_WINDOW`` tokens (sequences
        growing); with ``full``, every prefill bucket and window with all rows decoding, and
        decode-only steps of every decode bucket and window."""
        ps = self.ecfg.page_size
        D, P, W = self.decode_buckets, self.prefill_buckets, self.window_buckets
        if full and self.kernels.native:
            return [(d, p, W[0]) for d in D for p in P] + [(D[-1], p, w) for p in P[1:] for w in W[1:]]
        if full:
            return [(D[-1], p, w) for p in P for w in W] + [(d, 0, w) for d in D[:-1] for w in W]
        # Decode tokens attending natively need no window: decode-only steps are one program each.
        warm = [] if self.kernels.native else [w for w in W[1:] if w * ps <= WARM_WINDOW]
        return [(d, p, W[0]) for d in D for p in P] + [(d, 0, w) for d in D for w in warm]

    def warmup(self, full: bool = False, also: Collection[tuple[int, int, int]] = ()) -> float:
        """Compile (and run once) ``warm_programs(full)`` and the programs ``also`` names; the rest
        compile on first use. Returns the seconds spent."""
        t0 = time.perf_counter()
        programs = list(dict.fromkeys([*self.warm_programs(full), *also]))
        for decode, prefill, window in programs:
            # The window's last position, or max_seq_len's: the largest window's last page may
            # reach past it (a max_seq_len that is not whole pages) and holds the same pages.
            position = min(window * self.ecfg.page_size, self.ecfg.max_seq_len) - 1
            self.step(self.idle_batch(decode, prefill, position)).host()
        elapsed = time.perf_counter() - t0
        log.info("warm-up compiled %d ragged-step programs in %.1f s", len(programs), elapsed)
        self.warmed = True
        return elapsed

    # ---- layout switch -----------------------------------------------------------------------
    def warmup_to_replace(self, old: PagedEngine) -> float:
        """Before this engine takes over from ``old`` (a live switch): compile the programs
        ``warmup`` does and ``replacement_programs(old)``, so traffic like ``old``'s compiles
        nothing after the switch. Returns the seconds spent."""
        return self.warmup(also=self.replacement_programs(old))

    def replacement_programs(self, old: PagedEngine) -> list[tuple[int, int, int]]:
        """The programs here that serve the steps ``old`` has compiled: each of its (decode,
        prefill, window) buckets as this engine's buckets take it (sizes past the largest
        clipped to it), and, where this engine has fewer data replicas, also the regions that
        hold ``old``'s replicas' tokens together (sizes x old replicas / these)."""
        fit = lambda n, buckets: pick_bucket(min(n, buckets[-1]), buckets)  # noqa: E731
        D, P, W = self.decode_buckets, self.prefill_buckets, self.window_buckets
        scales = [1] if old.replicas <= self.replicas else [1, -(-old.replicas // self.replicas)]
        return list(dict.fromkeys((fit(d * k, D), fit(p * k, P), fit(w, W)) for d, p, w in old._fns for k in scales))

    def relayout(self, layout: Layout, devices: list[jax.Device], params: Any = None) -> PagedEngine:
        """A new engine with these weights on ``layout``'s mesh over ``devices`` (as
        ``Engine.relayout``); its pool is empty until ``adopt_state``."""
        return PagedEngine(
            self.cfg, self.graphdef, self.params if params is None else params, layout, self.ecfg, devices
        )

    def adopt_state(self, old: PagedEngine) -> None:
        """Take over ``old``'s token history and sampling state (moved to this mesh) and, when
        both have as many data replicas, its pages: the page numbers stay, so the scheduler's
        tables remain valid. With another replica count the pages are not taken (each replica's
        pool is another range of them): the scheduler must have recomputed every sequence
        (``PagedScheduler.repartition``). Call between two steps."""
        if old.replicas == self.replicas:
            self.cache = jax.device_put(old.cache, self._cache_sh)
        self.history = jax.device_put(old.history, self.repl)
        self._sp = {k: v.copy() for k, v in old._sp.items()}
        self._sp_device = None

    # ---- facts -------------------------------------------------------------------------------
    def packed_bytes_on(self, devices: list[jax.Device]) -> int:
        """Bytes of the packed weight copy a ``relayout`` onto ``devices`` (its mesh's devices)
        would add beside the weights, without building it: the float32 panels where
        ``packs_panels``, else 0. Same weights, so a same-device relayout's equals
        ``panel_bytes()``."""
        if not packs_panels(len(devices), devices[0].platform, self.ecfg, self.dtype):
            return 0
        return packed_bytes(nnx.merge(self.graphdef, self.params))

    def panel_bytes(self) -> int:
        """Bytes of the packed copies of the float32 weights (``panels``; 0 without them)."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.panels or {}))

    def weight_bytes_per_device(self) -> dict[str, int]:
        """Bytes of parameters held by each device, keyed by device id string."""
        return bytes_per_device(self.params)


def packs_panels(num_devices: int, platform: str, engine_cfg: EngineConfig, dtype: Any) -> bool:
    """Whether a paged engine on ``num_devices`` devices of ``platform`` packs its float32
    matmul weights for the native panel kernel (``PagedEngine.panels``): one CPU device,
    ``matmul="auto"``, float32 weights, the kernel built."""
    one_cpu = num_devices == 1 and platform == "cpu"
    return one_cpu and engine_cfg.matmul == "auto" and jnp.dtype(dtype) == jnp.float32 and cpu_matmul.available()


def _set_history_row(history: TokenHistory, slot: jax.Array, counts: jax.Array, in_prompt: jax.Array) -> TokenHistory:
    """``history`` with row ``slot`` replaced: counts [V] int32, in_prompt [V] bool."""
    return TokenHistory(
        counts=jax.lax.dynamic_update_slice_in_dim(history.counts, counts[None], slot, 0),
        in_prompt=jax.lax.dynamic_update_slice_in_dim(history.in_prompt, in_prompt[None], slot, 0),
    )


def _per_replica(
    step: Any,
    replicas: int,
    cache: PagedKVCache,
    tokens: jax.Array,
    positions: jax.Array,
    rows: jax.Array,
    page_tables: jax.Array,
    last_index: jax.Array,
) -> tuple[jax.Array, PagedKVCache]:
    """``step`` (``ragged_step`` with its static arguments bound) run by each data replica on its
    own region, rows and pool, as one ``jax.vmap`` over a leading replica axis that the SPMD
    partitioner keeps on the ``data`` mesh axis (``spmd_axis_name``), so no replica reads
    another's pages.

    Args: as ``ragged_step``'s, for the whole flat batch (``RaggedBatch``'s layout): tokens,
        positions, rows [N] (rows global, N = replicas x n), page_tables [S, max_pages]
        (pages numbered within each replica's pool), last_index [S] (global indices), cache
        [L, P, ...] (replica r's pool: pages [r P/d, (r + 1) P/d)).

    Returns:
        logits [S, V] and the cache, as ``ragged_step``'s.
    """
    d, S = replicas, page_tables.shape[0]
    n, S_r = tokens.shape[0] // d, S // d
    replica = jnp.arange(d, dtype=jnp.int32)[:, None]
    split = lambda a: a.reshape(d, a.shape[0] // d, *a.shape[1:])  # noqa: E731
    local_rows = jnp.where(split(rows) >= 0, split(rows) - replica * S_r, -1)
    local_last = split(last_index) - replica * n

    def pages(a: jax.Array) -> jax.Array:  # [L, P, ...] -> [L, d, P/d, ...]
        return a.reshape(a.shape[0], d, a.shape[1] // d, *a.shape[2:])

    def one(k, v, tokens, positions, rows, tables, last):  # type: ignore[no-untyped-def]
        logits, c = step(PagedKVCache(k=k, v=v), tokens, positions, rows, tables, last)
        return logits, c.k, c.v

    logits, k, v = jax.vmap(one, in_axes=(1, 1, 0, 0, 0, 0, 0), out_axes=(0, 1, 1), spmd_axis_name="data")(
        pages(cache.k), pages(cache.v), split(tokens), split(positions), local_rows, split(page_tables), local_last
    )
    whole = lambda a: a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])  # noqa: E731
    return logits.reshape(S, logits.shape[-1]), PagedKVCache(k=whole(k), v=whole(v))
