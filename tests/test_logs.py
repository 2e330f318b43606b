"""What a client sends reaches the log bounded (``service/server/logs.py``): a 10,000-character
request id went into it whole, and a newline in one would forge a log line."""

from __future__ import annotations

import logging

import pytest

from service.server.client import Client, make_request
from service.server.logs import LIMIT, bounded


def test_long_text_is_cut_and_marked_with_its_length() -> None:
    assert bounded("abc") == "abc" and bounded(7) == 7 and bounded(None) is None
    cut = bounded("x" * 10_000)
    assert cut == "x" * LIMIT + "... (10000 characters)"
    assert bounded(ValueError("y" * 300)) == "y" * LIMIT + "... (300 characters)"


def test_control_characters_are_escaped_and_other_text_kept() -> None:
    assert bounded("id\nFORGED line\r\x1b[31m") == "id\\nFORGED line\\r\\x1b[31m"
    assert bounded("你好 café") == "你好 café"


def test_a_huge_request_id_is_logged_bounded(tiny_server, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    rid = "r" * 10_000 + "\nFORGED: request served"
    client = Client(tiny_server.address)
    try:
        with caplog.at_level(logging.INFO, logger="meshserve"):
            chunks = list(client.stream(make_request(prompt="hi", max_tokens=2, temperature=0.0, request_id=rid), 60))
    finally:
        client.close()
    assert chunks and all(c.request_id == rid for c in chunks)  # the client gets its own id back whole
    lines = [r.getMessage() for r in caplog.records if r.name == "meshserve"]
    mine = [m for m in lines if m.startswith("request rrrr")]
    assert mine, lines
    for m in mine:
        assert len(m) < LIMIT + 200 and "(10023 characters)" in m and "\n" not in m
