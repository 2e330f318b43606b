"""Validate a GenerateRequest and turn it into prompt ids plus engine parameters.

Every rejection is an ``InvalidRequest`` naming the field; the server maps it to
INVALID_ARGUMENT. Defaults for unset fields (explicit proto3 presence) are documented here
and in the README.
"""

from __future__ import annotations

import dataclasses
import math
import secrets

from model.tokenizer import Tokenizer
from protos.meshserve.v1 import meshserve_pb2 as pb
from service.engine import TOP_LOGPROBS
from service.request import SamplingOptions

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
CHAT_ROLES = ("system", "user", "assistant")
# Bounds of ``stop`` (protos/meshserve/v1/meshserve.proto): every stop string is matched against
# the text of every generated token, so their number and length are kept small.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


class InvalidRequest(ValueError):
    """A request field is malformed or out of range (gRPC INVALID_ARGUMENT)."""


@dataclasses.dataclass(frozen=True)
class ValidatedRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingOptions
    stop: tuple[str, ...]
    logprobs: int | None = None


def prompt_ids(req: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The prompt's token ids: raw text tokenized as is, chat rendered with the model's template,
    or token ids checked against the vocabulary."""
    which = req.WhichOneof("input")
    if which is None:
        raise InvalidRequest("input: one of prompt, chat or token_ids is required")
    if which == "prompt":
        ids = tokenizer.encode(req.prompt)
    elif which == "chat":
        if not req.chat.messages:
            raise InvalidRequest("chat.messages: at least one message is required")
        for i, m in enumerate(req.chat.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"chat.messages[{i}].role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
        messages = [{"role": m.role, "content": m.content} for m in req.chat.messages]
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    else:
        ids = list(req.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"token_ids: {len(bad)} id(s) outside [0, {tokenizer.vocab_size}), first {bad[0]}")
    if not ids:
        raise InvalidRequest(f"{which}: the prompt is empty (0 tokens)")
    return ids


def validate(
    req: pb.GenerateRequest, tokenizer: Tokenizer, max_seq_len: int, default_max_tokens: int
) -> ValidatedRequest:
    """Check every field and apply defaults.

    Limits policy: the prompt must leave room for at least one token (prompt < max_seq_len);
    an explicit ``max_tokens`` with prompt + max_tokens > max_seq_len is rejected (never
    silently truncated); an unset ``max_tokens`` means min(default_max_tokens,
    max_seq_len - prompt).

    Raises:
        InvalidRequest: naming the field, with the numbers involved.
    """
    ids = prompt_ids(req, tokenizer)
    n = len(ids)
    if n >= max_seq_len:
        raise InvalidRequest(
            f"prompt: {n} tokens leaves no room to generate within the max sequence length of {max_seq_len} tokens"
        )
    room = max_seq_len - n
    if req.HasField("max_tokens"):
        max_tokens = req.max_tokens
        if max_tokens == 0:
            raise InvalidRequest("max_tokens: must be >= 1 (leave it unset for the default)")
        if max_tokens > room:
            raise InvalidRequest(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"the max sequence length of {max_seq_len} tokens"
            )
    else:
        max_tokens = min(default_max_tokens, room)

    temperature = req.temperature if req.HasField("temperature") else DEFAULT_TEMPERATURE
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest(f"temperature: must be a finite number >= 0, got {temperature}")
    top_p = req.top_p if req.HasField("top_p") else DEFAULT_TOP_P
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest(f"top_p: must be in (0, 1], got {top_p}")
    top_k = req.top_k if req.HasField("top_k") else DEFAULT_TOP_K
    if top_k < 0:
        raise InvalidRequest(f"top_k: must be >= 0 (0 disables it), got {top_k}")
    seed = req.seed if req.HasField("seed") else secrets.randbits(63)
    if len(req.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}")
    for i, s in enumerate(req.stop):
        if not s:
            raise InvalidRequest(f"stop[{i}]: stop strings must be non-empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(f"stop[{i}]: at most {MAX_STOP_CHARS} characters per stop string, got {len(s)}")
    logprobs = None
    if req.HasField("logprobs"):
        logprobs = req.logprobs
        if logprobs > TOP_LOGPROBS:
            raise InvalidRequest(f"logprobs: at most {TOP_LOGPROBS} alternatives, got {logprobs}")
    return ValidatedRequest(
        prompt_ids=ids,
        max_tokens=max_tokens,
        sampling=SamplingOptions(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed),
        stop=tuple(req.stop),
        logprobs=logprobs,
    )
