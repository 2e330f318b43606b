"""The OpenAI-compatible HTTP API: a FastAPI app served by uvicorn in the gRPC server's event loop,
on the same engine pools (``service.server.gateway.Gateway.open``).

Endpoints: ``GET /v1/models`` (and ``/v1/models/{id}``), ``POST /v1/completions``,
``POST /v1/chat/completions`` (streamed as server-sent events ending with ``data: [DONE]``, or one
JSON body), ``GET /health`` (200 while health is SERVING, else 503) and ``GET /metrics`` (the
server's Prometheus registry, as on ``--metrics-port``). Request bodies are
``service.server.openai_api``'s pydantic models.

Errors are OpenAI's JSON shape, ``{"error": {"message", "type", "param", "code"}}``:

    400 invalid_request_error  a malformed, out-of-range or refused field (``param`` names it),
                               or a body that is not JSON of the right types
    404 invalid_request_error  an unknown model id (code ``model_not_found``) or path
    405 invalid_request_error  a known path with another method (code ``method_not_allowed``)
    413 invalid_request_error  a body over ``max_body_bytes`` (code ``request_too_large``), refused
                               before it is read whole (``BodyLimit``)
    429 rate_limit_error       the waiting queue is full (code ``queue_full``)
    503 server_error           loading, shutting down, or the pool's engine loop died or stalled;
                               a stream that fails after it started ends with this body as a
                               ``data:`` event, then ``data: [DONE]``

A client that goes away (a closed connection, mid-stream or while a non-streamed answer is being
generated) cancels every sequence of its request, which frees their rows within one engine step,
as gRPC's cancel does; the request is logged as 499 (client closed request) and counted
``cancelled``.

Library choice: FastAPI for the routes and the pydantic request models, uvicorn as the ASGI server
(its ``httptools`` parser, or ``h11`` where httptools is missing: :func:`http_parser`), both run
as tasks of the asyncio loop that runs grpc.aio, so one process serves both APIs from the same
pools without threads between them. The events are ``data: <compact JSON>``
lines (``openai_api.sse_event``; a token's chunk is written from a prefix built once per request,
``Responses.event_bytes``) written through Starlette's ``StreamingResponse``: a FastAPI generator
endpoint (``EventSourceResponse``) would commit to status 200 before the request is admitted, where
a refusal must still be answered with its own status; and ``StreamingResponse`` listens for the
client's disconnect while it streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.server.generation import Generation, Refusal, Refused, StreamFailed
from service.server.logs import log
from service.server.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    Responses,
    chat_request,
    completion_request,
    sse_event,
    tool_names,
)
from service.server.validation import ValidatedRequest

if TYPE_CHECKING:
    from model.text.tokenizer import Tokenizer
    from service.server.gateway import Gateway
    from service.server.pools import Pool


HTTP_STATUS = {
    Refusal.INVALID_ARGUMENT: 400,
    Refusal.NOT_FOUND: 404,
    Refusal.RESOURCE_EXHAUSTED: 429,
    Refusal.UNAVAILABLE: 503,
}
_ERROR_KIND = {  # status -> (OpenAI's error type, code)
    400: ("invalid_request_error", "invalid_value"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "unavailable"),
}
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by the client
_FIELD = re.compile(r"^([A-Za-z_][\w.\[\]]*): ")  # the field an InvalidRequest message starts with


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for ``status``; a 400's ``param`` defaults to the field the message
    starts with."""
    kind, default_code = _ERROR_KIND.get(status, ("invalid_request_error", None))
    if param is None and status == 400:
        m = _FIELD.match(message)
        param = m.group(1) if m else None
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


class OpenAIError(Exception):
    """Answered as OpenAI's error body with ``status``."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
# The largest body a request may send: 1 MiB plus 1 KiB per token of the length limit. A prompt
# the limit admits is a few bytes of text per token (at most the longest token's bytes, 81 for
# SmolLM2, and 6 bytes of JSON per byte when every character is escaped), so no request that
# could be served is refused, while a body of gigabytes is never buffered and parsed.
BODY_BASE_BYTES = 2**20
BODY_BYTES_PER_TOKEN = 1024


def max_body_bytes(max_request_tokens: int) -> int:
    """The most bytes a request body may hold on a server whose requests are held to
    ``max_request_tokens`` tokens (``BODY_BASE_BYTES`` + ``BODY_BYTES_PER_TOKEN`` per token)."""
    return BODY_BASE_BYTES + BODY_BYTES_PER_TOKEN * max_request_tokens


class BodyLimit:
    """ASGI middleware: a request body over ``most`` bytes is answered 413 in OpenAI's error shape
    without being read whole: at once when its Content-Length says so, else as soon as the bytes
    received pass ``most`` (the app's handler answers the ``HTTPException`` raised from
    ``receive``: FastAPI passes an ``HTTPException`` from reading a body on, where it turns any
    other error into a 400).

    Args:
        app: the ASGI app.
        most: bytes.
        rejected: called once per refused body (the rejection counter).
    """

    def __init__(self, app: Any, most: int, rejected: Callable[[], None]):
        self.app = app
        self.most = most
        self.rejected = rejected

    def message(self, size: int, whole: bool) -> str:
        return (
            f"body: {'' if whole else 'at least '}{size} bytes, more than the {self.most} this server takes "
            f"({BODY_BASE_BYTES} plus {BODY_BYTES_PER_TOKEN} per token of its length limit)"
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # Only completion requests count as rejected requests (the counter's meaning); any path
        # gets the 413.
        generation = scope.get("method") == "POST" and scope.get("path") in GENERATION_PATHS
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.most:
            if generation:
                self.rejected()
            response = JSONResponse(
                error_body(413, self.message(int(declared), True), param="body"),
                status_code=413,
                headers={"Connection": "close"},  # else the server would read the declared bytes to discard them
            )
            await response(scope, receive, send)
            return
        received = 0

        async def counted() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.most:
                    if generation:
                        self.rejected()
                    raise StarletteHTTPException(413, self.message(received, False), headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read: nothing else can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _field_of(error: Any, body: Any) -> str:
    """The field a pydantic error's ``loc`` points at, spelled as ``InvalidRequest`` messages spell
    it (``messages[0].content``). Only the steps that index into the body are kept: pydantic puts
    the union member it tried into ``loc`` too (``stop.str``, ``prompt.list[int]``), which names
    nothing the client sent."""
    loc = [x for x in error.get("loc", ()) if x != "body"]
    field, value = "", body
    for i, x in enumerate(loc):
        if isinstance(value, dict) and isinstance(x, str) and (x in value or i == len(loc) - 1):
            field, value = f"{field}.{x}" if field else x, value.get(x)  # a missing field is named too
        elif isinstance(value, list) and isinstance(x, int) and 0 <= x < len(value):
            field, value = f"{field}[{x}]", value[x]
    return field or "body"


def model_ids(gateway: Gateway) -> list[tuple[str, Pool]]:
    """(model id, pool) per pool: the default pool answers the served model's name, the others
    their pool names."""
    assert gateway.facts is not None
    return [(gateway.facts.name if p.is_default else p.name, p) for p in gateway.pools]


def find_model(gateway: Gateway, model: str | None) -> Pool:
    """The pool a request's ``model`` selects: its id in ``/v1/models``, or a pool's name or its
    layout's name (as gRPC's ``layout`` field); empty or absent = the default pool.

    Raises:
        Refused: NOT_FOUND for any other name (the message lists the ids); UNAVAILABLE while the
            model is loading.
    """
    if gateway.facts is None or not gateway.pools:
        raise Refused(Refusal.UNAVAILABLE, "the model is still loading")
    if not model:
        return gateway.pools[0]
    ids = model_ids(gateway)
    for name, pool in ids:
        if model == name:
            return pool
    for pool in gateway.pools:
        if model in (pool.name, pool.layout.name):
            return pool
    aliases = sorted({p.name for p in gateway.pools} | {p.layout.name for p in gateway.pools})
    raise Refused(
        Refusal.NOT_FOUND,
        f"model: {model!r} is not served; models: {', '.join(n for n, _ in ids)} "
        f"(or a pool or layout name: {', '.join(aliases)})",
    )


def create_app(gateway: Gateway) -> FastAPI:
    """The FastAPI app of ``gateway`` (see the module docstring)."""
    app = FastAPI(title="meshserve OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    started = int(time.time())

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(error_body(exc.status, exc.message, code=exc.code), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI's servers answer 400, naming the field.
        first = exc.errors()[0]
        gateway.count_malformed()
        if first.get("type") == "json_invalid":  # its loc is ("body", offset): no field to name
            why = first.get("ctx", {}).get("error", first.get("msg", "invalid"))
            return JSONResponse(error_body(400, f"body: not valid JSON: {why}", param="body"), status_code=400)
        kind = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in kind.lower():
            # FastAPI parses only a JSON content type (against CSRF): name that, not the body's type.
            message = f"body: send it as JSON with Content-Type: application/json (got {kind or 'none'!r})"
            return JSONResponse(error_body(400, message, param="body"), status_code=400)
        field = _field_of(first, exc.body)
        return JSONResponse(error_body(400, f"{field}: {first.get('msg', 'invalid')}", param=field), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        detail = str(exc.detail)
        if exc.status_code == 400:  # FastAPI's "There was an error parsing the body" (bytes that are not UTF-8 JSON)
            detail = f"body: {detail} (it must be UTF-8 JSON)"
        param = "body" if exc.status_code in (400, 413) else None
        body = error_body(exc.status_code, detail, param=param, code=code)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug still answers OpenAI's shape (Starlette's default is a text/plain 500), so that
        # clients parse it as an error; Starlette logs the traceback after this.
        return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        serving = gateway.serving
        return JSONResponse({"status": "SERVING" if serving else "NOT_SERVING"}, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_object(name: str, pool: Pool) -> dict[str, Any]:
        assert gateway.facts is not None
        return {
            "id": name,
            "object": "model",
            "created": started,
            "owned_by": "meshserve",
            "root": gateway.facts.name,
            "max_model_len": gateway.max_request_tokens,
            "pool": pool.name,
            "layout": pool.layout.name,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        if gateway.facts is None:
            raise OpenAIError(503, "the model is still loading")
        return {"object": "list", "data": [model_object(name, pool) for name, pool in model_ids(gateway)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """OpenAI's "retrieve model": the object ``/v1/models`` lists for the pool that ``model``
        selects in a request (its id, or a pool or layout name); 404 ``model_not_found`` else."""
        try:
            pool = find_model(gateway, model)
        except Refused as exc:
            raise OpenAIError(HTTP_STATUS[exc.code], exc.message) from None
        return next(model_object(name, p) for name, p in model_ids(gateway) if p is pool)

    async def admit(
        request: Request, model: str | None, prepare: Callable[[Tokenizer], ValidatedRequest]
    ) -> tuple[str, Generation]:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        try:
            return rid, await gateway.open(rid, lambda: find_model(gateway, model), prepare)
        except Refused as exc:
            raise OpenAIError(HTTP_STATUS[exc.code], exc.message) from None

    async def answer(
        request: Request, generation: Generation, responses: Responses, stream: bool, include_usage: bool
    ) -> Response:
        if stream:
            return _EventStream(
                generation,
                _events(generation, responses, include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _collect(request, generation, responses)

    async def respond(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prepare: Callable[[Tokenizer], ValidatedRequest],
        chat: bool,
        logprobs: bool,
        tools: set[str] | None = None,
    ) -> Response:
        """Admit ``body`` (``prepare`` validates it with the tokenizer) and answer it, streamed or
        whole: chat completion objects if ``chat``, else text completions; ``logprobs``: the body
        asks for log-probabilities; ``tools``: the names of the tools whose calls are parsed
        out of the answer (``Responses``).

        Raises:
            OpenAIError: the request was refused (its HTTP status and message).
        """
        rid, generation = await admit(request, body.model, prepare)
        try:
            responses = Responses(
                chat, rid, _model_id(gateway, generation), generation.n, generation.prompt_tokens, logprobs,
                _tokenizer(gateway), tools,
            )  # fmt: skip
            return await answer(request, generation, responses, bool(body.stream), body.include_usage)
        except BaseException:
            generation.close()  # no response will close it
            raise

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        cfg = gateway.cfg
        return await respond(
            request,
            body,
            lambda tok: completion_request(body, tok, gateway.max_request_tokens, cfg.max_queue),
            chat=False,
            logprobs=body.logprobs is not None,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        cfg = gateway.cfg
        return await respond(
            request,
            body,
            lambda tok: chat_request(body, tok, gateway.max_request_tokens, cfg.default_max_tokens, cfg.max_queue),
            chat=True,
            logprobs=bool(body.logprobs),
            tools=tool_names(body),
        )

    return app


def _tokenizer(gateway: Gateway) -> Tokenizer:
    assert gateway.tokenizer is not None  # open() admitted the request
    return gateway.tokenizer


def _model_id(gateway: Gateway, generation: Generation) -> str:
    return next(name for name, pool in model_ids(gateway) if pool.name == generation.pool)


class _Closing(Response):
    """A response that closes its ``Generation`` once its last byte is handed to the connection,
    or its sending was cut (the client went away, or the server stopped): until then the request
    is in flight (``Gateway.inflight``), so a drain waits for the end of the stream, not only
    for the engine's last token."""

    def __init__(self, generation: Generation, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)  # the response class after this one in the MRO
        self.generation = generation

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


class _EventStream(_Closing, StreamingResponse):
    """The SSE response of ``generation`` (``_events``)."""


class _Whole(_Closing, JSONResponse):
    """The JSON body of a non-streamed ``generation`` (``_collect``)."""


async def _events(generation: Generation, responses: Responses, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body: one event per chunk, the usage event when asked, then ``[DONE]``; a sequence
    that failed (its pool's loop died or stalled, or the drain's grace period ended) ends it with
    an error event before ``[DONE]``. The response (``_EventStream``) closes the generation."""
    rid = generation.request_id
    try:
        async for index, chunk in generation:
            yield responses.event_bytes(index, chunk, include_usage)
        if include_usage:
            yield sse_event(responses.usage_event())
        log.info("request %s: finished, %d tokens", rid, responses.completion_tokens)
    except StreamFailed as exc:
        log.warning("request %s: failed: %s", rid, exc)
        yield sse_event(error_body(503, str(exc)))
    except asyncio.CancelledError:
        log.info("request %s: %d, the client closed the stream", rid, CLIENT_CLOSED)
        raise
    yield sse_event("[DONE]")


async def _collect(request: Request, generation: Generation, responses: Responses) -> Response:
    """Run a non-streamed request to its end, or until the client goes away (then every sequence
    is cancelled at once); the response (``_Whole``) closes the generation after its body."""
    rid = generation.request_id

    async def run() -> None:
        async for index, chunk in generation:
            responses.add(index, chunk)

    work = asyncio.ensure_future(run())
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            generation.close()  # the client went away (or the handler was cancelled): free the rows now
    if not work.done() or work.cancelled():
        log.info("request %s: %d, the client closed the connection", rid, CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    try:
        work.result()
    except StreamFailed as exc:
        log.warning("request %s: failed: %s", rid, exc)
        return _Whole(generation, error_body(503, str(exc)), status_code=503)
    log.info("request %s: finished, %d tokens", rid, responses.completion_tokens)
    return _Whole(generation, responses.completion())


# ---- the uvicorn server ------------------------------------------------------------------------------
class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its signal handling: ``serve_forever`` owns SIGTERM and SIGINT (uvicorn's
    ``capture_signals`` would replace them, and re-raise them after it stops)."""

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (SO_REUSEADDR, no SO_REUSEPORT, as gRPC binds here),
    bound before uvicorn starts so that a busy port is this process's error, not uvicorn's exit.

    The socket is made with ``proto=IPPROTO_TCP`` (``socket.create_server`` leaves it 0): asyncio
    turns Nagle's algorithm off (TCP_NODELAY) only on the connections of a socket whose ``proto``
    says TCP, and with Nagle on, a streamed event written while the previous one is unacknowledged
    waits for the client's delayed ACK (40 ms on Linux).

    Raises:
        OSError: the address cannot be bound (``errno.EADDRINUSE``: the port is held).
    """
    bare = host.strip("[]")
    family = socket.AF_INET6 if ":" in bare else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as socket.create_server
        sock.bind((bare, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def http_parser() -> str:
    """uvicorn's HTTP/1.1 implementation: ``httptools`` (a dependency; llhttp, in C) where it
    imports, else ``h11`` (pure Python, uvicorn's own dependency), as uvicorn's "auto" picks; named
    here so that the log says which one served."""
    return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"


class HttpServer:
    """The app on a bound socket, served by uvicorn as a task of the running event loop.

    Args:
        gateway: the gateway whose pools the app serves.
        sock: from :func:`bind`.
    """

    def __init__(self, gateway: Gateway, sock: socket.socket):
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self.parser = http_parser()
        self.max_body_bytes = max_body_bytes(gateway.max_request_tokens)
        config = uvicorn.Config(
            BodyLimit(create_app(gateway), self.max_body_bytes, gateway.count_malformed),
            http=self.parser,
            log_config=None,  # keep the server's logging configuration
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,  # in-flight streams are drained (or failed) before stop()
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start serving; returns once uvicorn listens.

        Raises:
            RuntimeError: uvicorn stopped during its startup.
        """
        self._task = asyncio.create_task(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                raise RuntimeError(f"the HTTP server stopped at startup: {self._task.exception()!r}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop accepting, let responses in progress end (1 s at most), close the socket."""
        if self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await self._task
        self.sock.close()
