"""service.server.validation.validate with the tiny model's byte-level BPE tokenizer (``tests/tiny_gguf.py``,
264 ids, ChatML template): every bad field is rejected with an InvalidRequest naming it, and unset
fields get the documented defaults."""

from __future__ import annotations

import math

import numpy as np
import pytest
from tiny_gguf import VOCAB_SIZE

from model.text.tokenizer import Tokenizer
from protos.meshserve.v1 import meshserve_pb2 as pb
from service.server.client import make_request
from service.server.validation import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    InvalidRequest,
    Params,
    ValidatedRequest,
    validate,
    validate_params,
)

MAX_SEQ_LEN = 1024
DEFAULT_MAX_TOKENS = 512


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer: Tokenizer) -> Tokenizer:
    return tiny_tokenizer


def check(
    req: pb.GenerateRequest, tokenizer: Tokenizer, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> ValidatedRequest:
    return validate(req, tokenizer, MAX_SEQ_LEN, default_max_tokens)


def rejected(req: pb.GenerateRequest, tokenizer: Tokenizer) -> str:
    with pytest.raises(InvalidRequest) as info:
        check(req, tokenizer)
    return str(info.value)


# ---- input ------------------------------------------------------------------------------------------


def test_no_input_is_rejected(tokenizer: Tokenizer) -> None:
    msg = rejected(pb.GenerateRequest(max_tokens=4), tokenizer)
    assert msg.startswith("input:")


def test_empty_prompt_is_rejected(tokenizer: Tokenizer) -> None:
    req = make_request(prompt="")
    assert req.WhichOneof("input") == "prompt"
    msg = rejected(req, tokenizer)
    assert msg.startswith("prompt:") and "0 tokens" in msg


def test_whitespace_prompt_is_accepted(tokenizer: Tokenizer) -> None:
    v = check(make_request(prompt="   ", max_tokens=4), tokenizer)
    assert v.prompt_ids == tokenizer.encode("   ") and len(v.prompt_ids) >= 1


def test_empty_token_ids_are_rejected(tokenizer: Tokenizer) -> None:
    req = pb.GenerateRequest()
    req.token_ids.SetInParent()
    assert req.WhichOneof("input") == "token_ids"
    assert rejected(req, tokenizer).startswith("token_ids:")


@pytest.mark.parametrize("bad", [VOCAB_SIZE, 10**6, -1])
def test_token_id_out_of_range_is_rejected(tokenizer: Tokenizer, bad: int) -> None:
    assert tokenizer.vocab_size == VOCAB_SIZE == 264
    msg = rejected(make_request(token_ids=[1, 2, bad, 3]), tokenizer)
    assert msg.startswith("token_ids:") and str(bad) in msg and "264" in msg


def test_token_ids_at_the_vocab_edges_are_accepted(tokenizer: Tokenizer) -> None:
    v = check(make_request(token_ids=[0, VOCAB_SIZE - 1], max_tokens=1), tokenizer)
    assert v.prompt_ids == [0, VOCAB_SIZE - 1]


def test_bad_chat_role_is_rejected(tokenizer: Tokenizer) -> None:
    msg = rejected(make_request(chat=[("user", "hi"), ("robot", "beep")]), tokenizer)
    assert msg.startswith("chat.messages[1].role:") and "robot" in msg


def test_empty_chat_is_rejected(tokenizer: Tokenizer) -> None:
    req = pb.GenerateRequest()
    req.chat.SetInParent()
    assert rejected(req, tokenizer).startswith("chat.messages:")


def test_chat_is_rendered_with_the_template(tokenizer: Tokenizer) -> None:
    v = check(make_request(chat=[("system", "Be brief."), ("user", "Hi")], max_tokens=4), tokenizer)
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], add_generation_prompt=True
    )
    assert v.prompt_ids == tokenizer.encode(rendered)
    assert v.prompt_ids[0] == 1  # <|im_start|>
    assert tokenizer.decode(v.prompt_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


# ---- lengths ----------------------------------------------------------------------------------------


def test_max_tokens_zero_is_rejected(tokenizer: Tokenizer) -> None:
    req = make_request(prompt="Hello", max_tokens=0)
    assert req.HasField("max_tokens")
    assert rejected(req, tokenizer).startswith("max_tokens:")


def test_prompt_plus_max_tokens_over_the_limit_is_rejected(tokenizer: Tokenizer) -> None:
    msg = rejected(make_request(token_ids=[5] * 1000, max_tokens=25), tokenizer)
    assert msg.startswith("max_tokens:")
    assert "1000" in msg and "25" in msg and "1025" in msg and str(MAX_SEQ_LEN) in msg
    # Exactly filling the sequence is fine.
    assert check(make_request(token_ids=[5] * 1000, max_tokens=24), tokenizer).max_tokens == 24


@pytest.mark.parametrize("n", [MAX_SEQ_LEN, MAX_SEQ_LEN + 7])
def test_prompt_at_or_over_max_seq_len_is_rejected(tokenizer: Tokenizer, n: int) -> None:
    for params in ({}, {"max_tokens": 1}):
        msg = rejected(make_request(token_ids=[5] * n, **params), tokenizer)
        assert msg.startswith("token_ids:") and str(n) in msg and str(MAX_SEQ_LEN) in msg  # the input's field
    chat = make_request(chat=[("user", "hello " * MAX_SEQ_LEN)])
    assert rejected(chat, tokenizer).startswith("chat.messages:")


def test_long_text_prompt_reports_its_token_count(tokenizer: Tokenizer) -> None:
    text = "hello " * (MAX_SEQ_LEN + 100)
    n = len(tokenizer.encode(text))
    assert n >= MAX_SEQ_LEN
    msg = rejected(make_request(prompt=text, max_tokens=8), tokenizer)
    assert msg.startswith("prompt:") and str(n) in msg and str(MAX_SEQ_LEN) in msg


def test_text_far_beyond_the_limit_is_refused_before_it_is_tokenized(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenizing megabytes stalled the server's event loop for seconds (1 s per MB), only to
    refuse the prompt afterwards: a text whose bytes alone are more tokens than the limit allows
    is refused untokenized. The bound is sound: every text encodes to at least its bytes /
    max_token_bytes tokens."""
    for text in ("hello world, " * 50, "🙂 naïve café 你好 " * 40, "".join(chr(i) for i in range(32, 2000))):
        assert len(tokenizer.encode(text)) * tokenizer.max_token_bytes >= len(text.encode("utf-8"))
    assert tokenizer.tokens_at_least(tokenizer.max_token_bytes * 7) == 7  # no normalizer: the exact bound
    bound = tokenizer.max_token_bytes * MAX_SEQ_LEN
    far = "x" * bound

    def no_encoding(text: str) -> list[int]:
        raise AssertionError("tokenized")

    monkeypatch.setattr(tokenizer, "encode", no_encoding)
    msg = rejected(make_request(prompt=far), tokenizer)
    assert msg.startswith("prompt:") and f"{bound} bytes of text" in msg and str(MAX_SEQ_LEN) in msg
    chat = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=far)]))
    assert rejected(chat, tokenizer).startswith("chat.messages:")
    monkeypatch.undo()
    near = "x" * (bound - 1)  # below the bound: tokenized, then refused by its exact count
    msg = rejected(make_request(prompt=near), tokenizer)
    assert str(len(tokenizer.encode(near))) in msg


# ---- sampling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-0.5, -1e-6, math.nan, math.inf])
def test_bad_temperature_is_rejected(tokenizer: Tokenizer, value: float) -> None:
    assert rejected(make_request(prompt="Hi", temperature=value), tokenizer).startswith("temperature:")


REP = "repetition_penalty: must be a finite number in [1e-30, 3.403e+38] (1 disables it), got"


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # JSON carries doubles: 1e308 is finite here but inf as the engine's float32 (a banned
        # id's -inf / inf is NaN); a logit / 1e-38 is inf (the draw then takes the first id).
        (Params(temperature=1e308), "temperature: must be a finite number >= 0 and <= 3.403e+38 (float32), got 1e+308"),
        (Params(repetition_penalty=1e300), f"{REP} 1e+300"),
        (Params(repetition_penalty=1e-38), f"{REP} 1e-38"),
    ],
)  # fmt: skip
def test_values_the_engines_float32_cannot_divide_by_are_rejected(params: Params, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_params([1, 2], params, 64, 8)
    assert str(info.value) == message
    edge = validate_params([1, 2], Params(temperature=3.4e38, repetition_penalty=1e-30), 64, 8).sampling
    assert np.isfinite(np.float32(edge.temperature)) and np.isfinite(
        np.float32(100.0) / np.float32(edge.repetition_penalty)
    )


@pytest.mark.parametrize("tiny", [1e-45, 1.2e-38, 5e-38, 9.9e-6])
def test_a_temperature_below_1e_5_is_greedy(tiny: float) -> None:
    """As vLLM takes it: logits / 1.2e-38 overflowed float32 and the draw answered " " and seven
    <|endoftext|> where greedy says " Berlin"."""
    assert validate_params([1, 2], Params(temperature=tiny), 64, 8).sampling.temperature == 0.0
    assert validate_params([1, 2], Params(temperature=1e-5), 64, 8).sampling.temperature == 1e-5


@pytest.mark.parametrize("value", [0.0, 1.5, math.nan, -0.1])
def test_bad_top_p_is_rejected(tokenizer: Tokenizer, value: float) -> None:
    assert rejected(make_request(prompt="Hi", top_p=value), tokenizer).startswith("top_p:")


@pytest.mark.parametrize("value", [-1, -50])
def test_negative_top_k_is_rejected(tokenizer: Tokenizer, value: int) -> None:
    msg = rejected(make_request(prompt="Hi", top_k=value), tokenizer)
    assert msg.startswith("top_k:") and str(value) in msg


def test_empty_stop_string_is_rejected(tokenizer: Tokenizer) -> None:
    msg = rejected(make_request(prompt="Hi", stop=["ok", ""]), tokenizer)
    assert msg.startswith("stop[1]:")


def test_stop_strings_are_bounded_in_number_and_length(tokenizer: Tokenizer) -> None:
    assert (MAX_STOP_STRINGS, MAX_STOP_CHARS) == (16, 256)  # as protos/meshserve/v1/meshserve.proto says
    v = check(make_request(prompt="Hi", stop=[f"s{i}" for i in range(16)]), tokenizer)
    assert len(v.stop) == 16
    msg = rejected(make_request(prompt="Hi", stop=[f"s{i}" for i in range(17)]), tokenizer)
    assert msg == "stop: at most 16 stop strings, got 17"
    assert (
        rejected(make_request(prompt="Hi", stop=["x"] * 10_000), tokenizer)
        == "stop: at most 16 stop strings, got 10000"
    )
    assert check(make_request(prompt="Hi", stop=["é" * 256]), tokenizer).stop == ("é" * 256,)  # characters, not bytes
    msg = rejected(make_request(prompt="Hi", stop=["ok", "x" * 257]), tokenizer)
    assert msg == "stop[1]: at most 256 characters per stop string, got 257"


def test_edge_values_are_accepted(tokenizer: Tokenizer) -> None:
    v = check(make_request(prompt="Hi", temperature=0.0, top_p=1.0, top_k=0, stop=["\n"], seed=7), tokenizer)
    assert v.sampling.temperature == 0.0 and v.sampling.top_p == 1.0 and v.sampling.top_k == 0
    assert v.sampling.seed == 7 and v.stop == ("\n",)
    v = check(make_request(prompt="Hi", top_p=1e-3, top_k=40, temperature=2.5), tokenizer)
    assert v.sampling.top_p == pytest.approx(1e-3) and v.sampling.top_k == 40 and v.sampling.temperature == 2.5


# ---- defaults ---------------------------------------------------------------------------------------


def test_defaults_apply_when_fields_are_unset(tokenizer: Tokenizer) -> None:
    req = make_request(prompt="Hello there")
    for field in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not req.HasField(field)
    v = check(req, tokenizer)
    assert v.prompt_ids == tokenizer.encode("Hello there")
    assert (DEFAULT_TEMPERATURE, DEFAULT_TOP_P, DEFAULT_TOP_K) == (1.0, 1.0, 0)
    assert v.sampling.temperature == 1.0 and v.sampling.top_p == 1.0 and v.sampling.top_k == 0
    assert v.max_tokens == DEFAULT_MAX_TOKENS
    assert v.stop == ()
    assert 0 <= v.sampling.seed < 2**63


def test_default_max_tokens_is_capped_by_the_room_left(tokenizer: Tokenizer) -> None:
    n = 1000
    assert check(make_request(token_ids=[5] * n), tokenizer).max_tokens == min(DEFAULT_MAX_TOKENS, MAX_SEQ_LEN - n)
    assert check(make_request(token_ids=[5] * n), tokenizer).max_tokens == 24
    # A default larger than the room left: the room wins; smaller: the default wins.
    assert check(make_request(prompt="Hi"), tokenizer, default_max_tokens=5000).max_tokens == MAX_SEQ_LEN - len(
        tokenizer.encode("Hi")
    )
    assert check(make_request(prompt="Hi"), tokenizer, default_max_tokens=3).max_tokens == 3


def test_unset_seeds_differ_between_requests(tokenizer: Tokenizer) -> None:
    seeds = {check(make_request(prompt="Hi"), tokenizer).sampling.seed for _ in range(8)}
    assert len(seeds) > 1


# ---- n, penalties, min_p, min_tokens, ignore_eos ---------------------------------------------------


def test_new_sampling_fields_default_to_off(tokenizer: Tokenizer) -> None:
    req = make_request(prompt="Hi")
    for field in (
        "n",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_p",
        "min_tokens",
        "ignore_eos",
    ):
        assert not req.HasField(field)
    v = check(req, tokenizer)
    assert (v.n, v.min_tokens, v.ignore_eos) == (1, 0, False)
    s = v.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.0, 0.0, 1.0, 0.0)


def test_new_sampling_fields_reach_the_validated_request(tokenizer: Tokenizer) -> None:
    v = check(
        make_request(
            prompt="Hi", max_tokens=8, n=16, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.5,
            min_p=1.0, min_tokens=8, ignore_eos=True,
        ),
        tokenizer,
    )  # fmt: skip
    assert (v.n, v.min_tokens, v.ignore_eos) == (16, 8, True)
    s = v.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (-2.0, 2.0, 1.5, 1.0)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"n": 0}, "n: must be in [1, 16] (at most 16), got 0"),
        ({"n": 17}, "n: must be in [1, 16] (at most 16), got 17"),
        ({"presence_penalty": 2.5}, "presence_penalty: must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -2.5}, "frequency_penalty: must be in [-2, 2], got -2.5"),
        ({"presence_penalty": math.nan}, "presence_penalty: must be in [-2, 2], got nan"),
        (
            {"repetition_penalty": 0.0},
            f"{REP} 0.0",
        ),
        (
            {"repetition_penalty": -1.0},
            f"{REP} -1.0",
        ),
        ({"min_p": 1.5}, "min_p: must be in [0, 1], got 1.5"),
        ({"min_p": -0.5}, "min_p: must be in [0, 1], got -0.5"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens: must be <= max_tokens (4), got 5"),
    ],
)
def test_new_sampling_fields_out_of_range_are_rejected(tokenizer: Tokenizer, params: dict, message: str) -> None:
    assert rejected(make_request(prompt="Hi", **params), tokenizer) == message


def test_n_is_bounded_by_the_queue_and_min_tokens_by_the_default_max_tokens(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(make_request(prompt="Hi", n=5), tokenizer, MAX_SEQ_LEN, DEFAULT_MAX_TOKENS, max_queue=4)
    assert str(info.value) == "n: must be in [1, 4] (at most 16 and at most the server's queue of 4), got 5"
    assert validate(make_request(prompt="Hi", n=4), tokenizer, MAX_SEQ_LEN, DEFAULT_MAX_TOKENS, max_queue=4).n == 4
    msg = rejected(make_request(token_ids=[5] * 1000, min_tokens=25), tokenizer)  # the default: 24 tokens of room
    assert msg == "min_tokens: must be <= max_tokens (24), got 25"
