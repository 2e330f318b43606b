"""The server's logger, ``meshserve``, which holds what clients send only bounded.

Request ids, layout and model names, refusal messages that quote a field: a client chooses
them, so a record's arguments are cut to ``LIMIT`` characters (a 10,000-character
``request_id`` went into the log whole) and their control characters escaped (a newline in an
id would forge a log line). The client still gets its own text back in full; only the log
bounds it.
"""

from __future__ import annotations

import logging
from typing import Any

LIMIT = 256  # characters of one argument of a log record


def bounded(value: Any) -> Any:
    """``value`` as a log argument: numbers as they are; anything else as its text, control
    characters escaped, cut to ``LIMIT`` characters and marked with its length when longer."""
    if isinstance(value, int | float) or value is None:
        return value
    text = value if isinstance(value, str) else str(value)
    if len(text) > LIMIT:
        text = f"{text[:LIMIT]}... ({len(text)} characters)"
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text


class ClientText(logging.Filter):
    """Bounds every argument of the records it sees (``bounded``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(bounded(a) for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {k: bounded(v) for k, v in record.args.items()}
        return True


log = logging.getLogger("meshserve")
log.addFilter(ClientText())
