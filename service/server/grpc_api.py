"""The gRPC API: ``meshserve.v1.Generation`` (``Generate``, server-streaming, and
``GetModelInfo``) over the gateway.

Status codes, in one place:
    INVALID_ARGUMENT   a malformed or out-of-range field (the message names it), or request bytes
                       that do not parse (a string field that is not UTF-8), on any RPC
    RESOURCE_EXHAUSTED the waiting queue is full (checked before the prompt is tokenized, and
                       again, authoritatively, when the request is queued)
    UNAVAILABLE        the model is still loading/compiling, the engine loop died or stalled,
                       or the server is shutting down; also ends in-flight streams of a pool
                       whose loop died or stalled (failed by the watchdog within about
                       ``stall_timeout_s`` + 2 x ``watchdog_interval_s``) and streams still
                       running when the shutdown grace period ends
    CANCELLED / DEADLINE_EXCEEDED  set by gRPC when the client cancels or its deadline passes;
                       the request's rows are freed within one engine step
(The HTTP API's statuses for the same cases: ``service/server/http_api.py``.)
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc

from protos.meshserve.v1 import meshserve_pb2 as pb
from protos.meshserve.v1 import meshserve_pb2_grpc as pb_grpc
from service.server.gateway import Gateway
from service.server.generation import Refusal, Refused, StreamFailed
from service.server.logs import log
from service.server.pools import Pool
from service.server.startup import pool_weight_bytes
from service.server.validation import InvalidRequest, ValidatedRequest, validate
from sharding.plan import make_plan

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "meshserve.v1.Generation"
GRPC_CODES = {
    Refusal.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Refusal.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


class GenerationServicer(pb_grpc.GenerationServicer):
    """The Generation servicer over one gateway."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    def count_undecodable(self, method: str) -> None:
        """Metrics for a Generate call whose bytes did not parse (``service.server.wire``)."""
        if method.endswith("/Generate"):
            self.gateway.count_malformed()

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        """The model's facts, and the current layout of the pool ``request.layout`` names (default
        pool when empty) as the engine resolves it for this model (``sharding.plan.make_plan``)."""
        g = self.gateway
        if g.facts is None or g.tokenizer is None or not g.pools:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        assert g.facts is not None and g.tokenizer is not None
        try:
            pool = g.find_pool(request.layout)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        facts, ecfg, mcfg = g.facts, g.cfg.engine, g.facts.cfg
        layout, device = pool.layout, pool.devices[0]
        return pb.ModelInfo(
            name=facts.name,
            architecture=mcfg.architecture,
            vocab_size=mcfg.vocab_size,
            num_layers=mcfg.num_layers,
            hidden_size=mcfg.hidden_size,
            intermediate_size=mcfg.intermediate_size,
            num_heads=mcfg.num_heads,
            num_kv_heads=mcfg.num_kv_heads,
            head_dim=mcfg.head_dim,
            context_length=mcfg.max_position_embeddings,
            max_seq_len=g.max_request_tokens,  # the enforced limit: a smaller pool lowers --max-seq-len's
            num_slots=ecfg.num_slots,
            eos_token_ids=sorted(g.tokenizer.eos_ids),
            dtype=ecfg.dtype,
            num_parameters=mcfg.param_count(),
            model_path=str(facts.path),
            kv_cache="paged",
            kv_cache_pages=ecfg.num_pages,
            kv_cache_tokens=ecfg.num_pages * ecfg.page_size,
            page_size=ecfg.page_size,
            weights=facts.weights,
            weight_formats=facts.formats,
            weight_bytes=pool_weight_bytes(pool.loop.runner),  # this pool's, as now laid out
            tie_word_embeddings=mcfg.tie_word_embeddings,
            pool=pool.name,
            layout=layout.name,
            layout_data=layout.data,
            layout_model=layout.model,
            attention=make_plan(layout, mcfg).attention,
            platform=device.platform,
            device_kind=device.device_kind,
        )

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        g = self.gateway
        rid = request.request_id or uuid.uuid4().hex[:16]

        def route() -> Pool:
            try:
                return g.find_pool(request.layout)
            except InvalidRequest as exc:
                raise Refused(Refusal.INVALID_ARGUMENT, str(exc)) from None

        def prepare(tok) -> ValidatedRequest:  # type: ignore[no-untyped-def]
            cfg = g.cfg
            return validate(request, tok, g.max_request_tokens, cfg.default_max_tokens, cfg.max_queue)

        try:
            generation = await g.open(rid, route, prepare)
        except Refused as exc:
            await context.abort(GRPC_CODES[exc.code], exc.message)
        try:
            async for index, chunk in generation:
                resp = pb.GenerateResponse(text=chunk.text, token_ids=chunk.token_ids, request_id=rid, index=index)
                for lp in chunk.logprobs:
                    resp.logprobs.add(
                        token_id=lp.token_id,
                        logprob=lp.logprob,
                        top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                    )
                if chunk.finish_reason is not None:
                    resp.finish_reason = chunk.finish_reason.value  # type: ignore[assignment]  # the stubs type it as the enum; its values are ints
                    resp.usage.prompt_tokens = chunk.prompt_tokens
                    resp.usage.completion_tokens = chunk.completion_tokens
                    resp.usage.cached_tokens = chunk.cached_tokens
                    resp.usage.accepted_draft_tokens = chunk.accepted_draft_tokens
                    resp.usage.rejected_draft_tokens = chunk.rejected_draft_tokens
                    log.info(
                        "request %s: sequence %d finished %s, %d tokens",
                        rid, index, chunk.finish_reason.name, chunk.completion_tokens,
                    )  # fmt: skip
                yield resp
        except StreamFailed as exc:
            log.warning("request %s: failed: %s", rid, exc)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.CancelledError:  # grpc.aio cancels the handler: the client went away
            log.info("request %s: cancelled (by the client, its deadline, or the server stopping)", rid)
            raise
        finally:
            # After the last message was written (grpc.aio resumes the handler once it is sent):
            # the request leaves the in-flight set that a drain waits on. Frees the rows of a
            # client that went away.
            generation.close()
