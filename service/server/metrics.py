"""Prometheus metrics of one server (``meshserve_*``), on a registry of its own.

Each ``Metrics`` owns a fresh ``CollectorRegistry`` so several servers in one process (tests,
benchmarks) never clash; ``service/server/app.py`` serves it over HTTP on ``metrics_port``.

Every metric, with its labels (``pool`` = the engine pool's name, "default" without ``--pool``):

Per request, recorded once when it ends:
    meshserve_time_to_first_token_seconds{pool}      histogram: arrival -> first generated token (any
                                                     request that got one)
    meshserve_time_per_output_token_seconds{pool}    histogram: (finish - first token) / (sampled
                                                     tokens - 1), completed requests
    meshserve_e2e_request_latency_seconds{pool}      histogram: arrival -> finish, completed requests
                                                     (finish_reason length, eos, stop_string)
    meshserve_queue_time_seconds{pool}               histogram: arrival -> its first prefill chunk
                                                     starts (observed then)
    meshserve_prompt_tokens_total{pool}              counter: prompt tokens in the KV cache when a request ends,
                                                     prefilled or found in the prefix cache
    meshserve_generation_tokens_total{pool}          counter: generated ids (EOS excluded, as in
                                                     usage.completion_tokens)
    meshserve_requests_total{pool,finish_reason}     counter: requests that reached an engine, by how
                                                     they ended; finish_reason is one of
                                                       length       max_tokens or the end of the context
                                                       eos          the model produced an EOS id, or a
                                                                    constraint's grammar is complete
                                                       stop_string  a stop string matched
                                                       cancelled    the client cancelled or its deadline passed
                                                       grammar_dead_end  the constraint allows no next token
                                                       error        failed with UNAVAILABLE: the pool's engine
                                                                    loop died or stalled, or the server shut
                                                                    down before it finished
    meshserve_requests_rejected_total{pool,code}     counter: Generate calls and HTTP completion requests
                                                     refused before reaching an engine, by reason
                                                     (invalid_argument, not_found: an HTTP model id
                                                     that names no pool, resource_exhausted,
                                                     unavailable); pool is the pool the request was
                                                     for, or "" when it was refused before a pool was
                                                     chosen (model still loading, server shutting
                                                     down, unknown layout or model, request bytes or
                                                     an HTTP body that do not parse)
    (A request with n sequences counts once here when refused, and n times in the per-request
    metrics above when admitted: each sequence is a request to the engine.)

Per pool, read when scraped (the step histograms when each step ends):
    meshserve_active_slots{pool}                     gauge: rows holding a request
    meshserve_queue_depth{pool}                      gauge: requests waiting for a row
    meshserve_num_slots{pool}                        gauge: rows (``--slots``)
    meshserve_kv_cache_usage_ratio{pool}             gauge: pages held by a sequence / pages in the pool
    meshserve_kv_cache_pages{pool,state}             gauge: pages by state: used (held by a sequence),
                                                     cached (unreferenced, kept for prefix hits,
                                                     evictable), free
    meshserve_prefix_cache_queried_tokens_total{pool}  counter: prompt tokens looked up in the prefix cache
    meshserve_prefix_cache_hit_tokens_total{pool}    counter: of those, tokens found cached (not prefilled)
    meshserve_preemptions_total{pool}                counter: sequences preempted for pages (recomputed later)
    meshserve_spec_decode_draft_tokens_total{pool,proposer}     counter: draft ids speculative
                                                     decoding verified (proposer: ngram, draft)
    meshserve_spec_decode_accepted_tokens_total{pool,proposer}  counter: of those, the ids kept
    meshserve_spec_decode_verify_steps_total{pool}   counter: steps that verified draft ids (their
                                                     share: over engine_step_seconds' count)
    meshserve_spec_decode_acceptance_length{pool}    histogram: draft ids kept per verified proposal
    meshserve_engine_step_seconds{pool}              histogram: one engine step
    meshserve_engine_step_tokens{pool}               histogram: tokens one step ran (decode tokens plus
                                                     prefill chunk tokens)
    meshserve_engine_host_seconds_per_token{pool}    histogram: the engine loop's own time (schedule,
                                                     build, dispatch, postprocess, emit; not its
                                                     wait for the device) per id it brought to the
                                                     host, one observation per loop iteration
    meshserve_pool_layout_info{pool,layout,data,model,attention}  info: the pool's current layout
    meshserve_compiles_after_serving_total{pool,path}  counter: ragged-step programs compiled after
                                                     the pool's warm-up, by path: background (off
                                                     the steps' path: a new shape, whose steps ran
                                                     in a larger compiled program meanwhile, or a
                                                     live switch's programs) or step (a step, and
                                                     every stream, waited for it)
    meshserve_steps_in_larger_program_total{pool}    counter: steps run in a larger compiled program
                                                     while their own compiled

Server (process-wide, no pool label):
    meshserve_model_weights_info{weights,formats}    info: how the weights are held: "stored" (GGUF
                                                     blocks, formats e.g. "embed=q8_0,wqkv=q4_1"),
                                                     "int8" (Q8_0 blocks quantized at load) or the
                                                     float dtype (formats "")
    meshserve_serving                                gauge: 1 while grpc.health.v1 reports SERVING, else 0
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

NAMESPACE = "meshserve"
# Values of requests_total's label.
FINISH_REASONS = ("length", "eos", "stop_string", "cancelled", "grammar_dead_end", "error")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HOST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ACCEPTED_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)
POOL = ("pool",)


class Compiles(Protocol):
    """A pool's compile counts (``service.engine.runner.CompileCounts``)."""

    ahead: int
    in_step: int
    widened_steps: int


class CompileCollector(Collector):
    """The compile counters, read from each pool's engine at scrape time (a background compile
    ends between steps, so a count kept by the step hook would lag)."""

    def __init__(self) -> None:
        self.pools: dict[str, Callable[[], Compiles]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        compiles = CounterMetricFamily(
            f"{NAMESPACE}_compiles_after_serving",
            "Ragged-step programs compiled after the pool's warm-up: in the background or in a step (which waited).",
            labels=["pool", "path"],
        )
        larger = CounterMetricFamily(
            f"{NAMESPACE}_steps_in_larger_program",
            "Steps run in a larger compiled program while their own compiled.",
            labels=["pool"],
        )
        for pool, counts in list(self.pools.items()):
            c = counts()
            compiles.add_metric([pool, "background"], c.ahead)
            compiles.add_metric([pool, "step"], c.in_step)
            larger.add_metric([pool], c.widened_steps)
        yield compiles
        yield larger


class Metrics:
    """The metric objects of one server. Every method is thread-safe (engine threads call them)."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()

        def make(kind: type, name: str, doc: str, labels: Sequence[str] = POOL, **kw: Any) -> Any:
            return kind(name, doc, list(labels), namespace=NAMESPACE, registry=self.registry, **kw)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return make(Histogram, name, doc, buckets=buckets)

        self.ttft = hist(
            "time_to_first_token_seconds",
            "Seconds from a request's arrival to its first generated token.",
            LATENCY_BUCKETS,
        )
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean seconds per generated token after the first, per completed request.",
            TPOT_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Seconds from a request's arrival to its last token, per completed request.",
            LATENCY_BUCKETS,
        )
        self.queue_time = hist(
            "queue_time_seconds", "Seconds a request waited from arrival until its prefill started.", LATENCY_BUCKETS
        )
        self.step_time = hist("engine_step_seconds", "Seconds per engine step.", STEP_BUCKETS)
        self.host_per_token = hist(
            "engine_host_seconds_per_token",
            "The engine loop's host time (not its wait for the device) per sampled id, per loop iteration.",
            HOST_BUCKETS,
        )
        self.step_tokens = hist(
            "engine_step_tokens", "Tokens per engine step (decode tokens plus prefill chunk tokens).", TOKEN_BUCKETS
        )
        self.kv_pages = make(Gauge, "kv_cache_pages", "Pages of the paged KV cache by state.", ("pool", "state"))
        self.prefix_queried = make(
            Counter, "prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = make(
            Counter, "prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache (not prefilled)."
        )
        self.preemptions = make(Counter, "preemptions", "Sequences preempted for pages.")
        self.draft_tokens = make(
            Counter, "spec_decode_draft_tokens", "Draft ids speculative decoding verified.", ("pool", "proposer")
        )
        self.accepted_tokens = make(
            Counter, "spec_decode_accepted_tokens", "Draft ids verified and kept.", ("pool", "proposer")
        )
        self.verify_steps = make(Counter, "spec_decode_verify_steps", "Engine steps that verified draft ids.")
        self.acceptance_length = hist(
            "spec_decode_acceptance_length", "Draft ids kept per verified proposal.", ACCEPTED_BUCKETS
        )
        self.prompt_tokens = make(
            Counter,
            "prompt_tokens",
            "Prompt tokens in the KV cache when a request ends, prefilled or found in the prefix cache.",
        )
        self.generation_tokens = make(Counter, "generation_tokens", "Generated token ids (EOS excluded).")
        self.requests = make(
            Counter, "requests", "Requests that reached an engine, by how they ended.", ("pool", "finish_reason")
        )
        self.rejected = make(
            Counter,
            "requests_rejected",
            "Generate calls and HTTP completion requests refused before reaching an engine, by pool (empty "
            "before one was chosen) and reason.",
            ("pool", "code"),
        )
        self.active_slots = make(Gauge, "active_slots", "Rows holding a request.")
        self.queue_depth = make(Gauge, "queue_depth", "Requests waiting for a row.")
        self.num_slots = make(Gauge, "num_slots", "Rows of the pool's batch.")
        self.kv_usage = make(Gauge, "kv_cache_usage_ratio", "Fraction of the KV pool's pages held by a sequence.")
        self.layout = make(Info, "pool_layout", "The pool's current mesh layout.")
        self.weights = make(Info, "model_weights", "How the served weights are held.", ())
        self.serving = make(Gauge, "serving", "1 while health reports SERVING, else 0.", ())
        self._layouts: dict[str, dict[str, str]] = {}
        self._compiles = CompileCollector()
        self.registry.register(self._compiles)

    def track_pool(
        self,
        pool: str,
        num_slots: int,
        active_slots: Callable[[], float],
        queue_depth: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        """Register a pool's gauges; the callables are read at scrape time (any thread)."""
        self.num_slots.labels(pool=pool).set(num_slots)
        self.active_slots.labels(pool=pool).set_function(active_slots)
        self.queue_depth.labels(pool=pool).set_function(queue_depth)
        self.kv_usage.labels(pool=pool).set_function(kv_usage)
        for reason in FINISH_REASONS:
            self.requests.labels(pool=pool, finish_reason=reason)  # export zeros from the start
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e, self.queue_time):
            metric.labels(pool=pool)  # export zeros from the start
        self.step_time.labels(pool=pool)
        self.step_tokens.labels(pool=pool)
        self.host_per_token.labels(pool=pool)

    def track_compiles(self, pool: str, counts: Callable[[], Compiles]) -> None:
        """Register a pool's compile counts, ``counts()`` read at scrape time (any thread)."""
        self._compiles.pools[pool] = counts

    def track_pages(self, pool: str, pages: Callable[[], dict[str, int]]) -> None:
        """Register a paged pool's page gauges: ``pages()`` gives {"used", "cached", "free"}
        counts, read at scrape time (any thread)."""

        def count(state: str) -> Callable[[], float]:
            return lambda: pages()[state]

        for state in ("used", "cached", "free"):
            self.kv_pages.labels(pool=pool, state=state).set_function(count(state))
        for metric in (self.prefix_queried, self.prefix_hits, self.preemptions):
            metric.labels(pool=pool)  # export zeros from the start

    def track_speculation(self, pool: str, proposer: str) -> None:
        """Export a speculating pool's counters from zero (``proposer``: its label)."""
        self.draft_tokens.labels(pool=pool, proposer=proposer)
        self.accepted_tokens.labels(pool=pool, proposer=proposer)
        self.verify_steps.labels(pool=pool)
        self.acceptance_length.labels(pool=pool)

    def set_weights(self, weights: str, formats: dict[str, str]) -> None:
        """Publish how the weights are held ("stored" or a float dtype; stored parameters' formats)."""
        self.weights.info({"weights": weights, "formats": ",".join(f"{k}={v}" for k, v in sorted(formats.items()))})

    def set_layout(self, pool: str, layout: str, data: int, model: int, attention: str) -> None:
        """Publish a pool's current layout (cheap when unchanged)."""
        value = {"layout": layout, "data": str(data), "model": str(model), "attention": attention}
        if self._layouts.get(pool) != value:
            self._layouts[pool] = value
            self.layout.labels(pool=pool).info(value)
