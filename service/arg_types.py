"""argparse ``type=`` callables for numeric flags with a lower bound, so a bad value is a usage
error naming the bound ("--batch: must be >= 1, got -4") instead of a nonsense result later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def at_least(minimum: float, kind: type[int] | type[float] = int, strict: bool = False) -> Callable[[str], float]:
    """A parser of ``kind`` (int or float) values >= ``minimum`` (> it when ``strict``).

    Raises (from the returned callable):
        argparse.ArgumentTypeError: not a number of that kind, not finite, or below the bound
            (argparse turns it into a usage error, exit status 2).
    """
    word = "an integer" if kind is int else "a number"
    bound = f"> {minimum:g}" if strict else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {word}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = at_least(1)
nonnegative_int = at_least(0)
positive_float = at_least(0.0, float, strict=True)
nonnegative_float = at_least(0.0, float)


def port_number(text: str) -> int:
    """A TCP port flag: an integer from 0 (any free port, or off where the flag says so) to 65535.

    Raises:
        argparse.ArgumentTypeError: not an integer, or out of that range.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 to 65535, got {text}")
    return value
