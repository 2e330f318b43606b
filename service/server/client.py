"""A small synchronous gRPC client for meshserve (used by the CLI, tests and benchmarks)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.meshserve.v1 import meshserve_pb2 as pb
from protos.meshserve.v1 import meshserve_pb2_grpc as pb_grpc


@dataclasses.dataclass
class StreamResult:
    """A finished stream: every chunk's text and ids, plus timings.

    Attributes:
        texts: text delta of each chunk, in order.
        token_ids: all generated ids, concatenated.
        finish_reason: name, e.g. "FINISH_REASON_EOS".
        ttft_s: seconds from sending the request to the first chunk with a token.
        total_s: seconds from sending the request to the last chunk.
    """

    texts: list[str]
    token_ids: list[int]
    chunk_ids: list[list[int]]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float
    total_s: float

    @property
    def text(self) -> str:
        return "".join(self.texts)


def make_request(
    prompt: str | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    **params: Any,
) -> pb.GenerateRequest:
    """Build a GenerateRequest; ``params`` are GenerateRequest fields (max_tokens, temperature,
    top_p, top_k, min_p, seed, stop, logprobs, n, the penalties, min_tokens, ignore_eos,
    prefix_cache, layout, request_id: docs/api.md); a None value leaves the field unset (the
    server's default)."""
    req = pb.GenerateRequest(**{k: v for k, v in params.items() if v is not None})
    if chat is not None:
        req.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in chat)
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    elif prompt is not None:
        req.prompt = prompt
    return req


class Client:
    """Blocking client. ``address`` is "host:port"."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def wait_serving(self, timeout_s: float = 300.0) -> None:
        """Poll grpc.health.v1 until SERVING. Raises TimeoutError after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not SERVING after {timeout_s:.0f} s")

    def stream(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> Iterator[pb.GenerateResponse]:
        """The raw response stream (raises grpc.RpcError on a non-OK status)."""
        return self.stub.Generate(request, timeout=timeout_s)

    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> StreamResult:
        """Run a request of one sequence to completion and collect the chunks.

        Raises:
            ValueError: the request asks for n > 1 sequences (use :meth:`generate_all`).
        """
        if request.HasField("n") and request.n > 1:
            raise ValueError(f"generate collects one sequence; this request asks for n = {request.n}: use generate_all")
        return self.generate_all(request, timeout_s)[0]

    def generate_all(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> list[StreamResult]:
        """Run a request to completion; one ``StreamResult`` per sequence, by ``index`` (its
        ``ttft_s`` and ``total_s`` are that sequence's first token and last chunk)."""
        t0 = time.perf_counter()
        n = request.n if request.HasField("n") and request.n > 0 else 1
        texts: list[list[str]] = [[] for _ in range(n)]
        chunk_ids: list[list[list[int]]] = [[] for _ in range(n)]
        ttft: list[float | None] = [None] * n
        total = [0.0] * n
        last = [pb.GenerateResponse() for _ in range(n)]
        for resp in self.stream(request, timeout_s):
            i = resp.index
            if ttft[i] is None and resp.token_ids:
                ttft[i] = time.perf_counter() - t0
            texts[i].append(resp.text)
            chunk_ids[i].append(list(resp.token_ids))
            last[i] = resp
            total[i] = time.perf_counter() - t0
        return [
            StreamResult(
                texts=texts[i],
                token_ids=[t for ids in chunk_ids[i] for t in ids],
                chunk_ids=chunk_ids[i],
                finish_reason=pb.FinishReason.Name(last[i].finish_reason),
                prompt_tokens=last[i].usage.prompt_tokens,
                completion_tokens=last[i].usage.completion_tokens,
                ttft_s=first if (first := ttft[i]) is not None else total[i],
                total_s=total[i],
            )
            for i in range(n)
        ]

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
