"""argparse ``type=`` callables for numeric flags with a lower bound, so a bad value is a usage
error naming the bound ("--batch: must be >= 1, got -4") instead of a nonsense result later."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# A request's seed: uint64 (gRPC) or int64 (OpenAI's clients), [lo, hi); negatives wrap mod 2**64.
SEED_RANGE = (-(2**63), 2**64)


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
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        if value < minimum or (strict and value == minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    return parse


positive_int = at_least(1)
nonnegative_int = at_least(0)
positive_float = at_least(0.0, float, strict=True)
nonnegative_float = at_least(0.0, float)


def int_in(lo: int, hi: int, what: str) -> Callable[[str], int]:
    """A parser of integers in [lo, hi] (``what`` names the range in the message, e.g. "uint32").

    Raises (from the returned callable):
        argparse.ArgumentTypeError: not an integer, or out of range.
    """

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in [{lo}, {hi}] ({what}), got {text}")
        return value

    return parse


uint32 = int_in(0, 2**32 - 1, "uint32")  # a request's uint32 field (min_tokens, logprobs)


def seed_value(text: str) -> int:
    """A sampling seed: any 64-bit integer, signed or not; a negative one is taken modulo 2**64,
    as the HTTP API takes it (the gRPC field is uint64).

    Raises:
        argparse.ArgumentTypeError: not an integer, or outside [-2**63, 2**64).
    """
    return int_in(SEED_RANGE[0], SEED_RANGE[1] - 1, "64 bits")(text) % 2**64


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


BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def byte_size(text: str) -> int:
    """A size in bytes: an integer with an optional unit (B, KB, MB, GB, KiB, MiB, GiB; any
    case), e.g. "4GiB", "512 MiB", "1000000"; fractional values allowed with a unit ("1.5GiB").

    Raises:
        argparse.ArgumentTypeError: not a number and unit of that form, or below 1 byte.
    """
    stripped = text.strip()
    number = stripped.rstrip("bBkKmMgGiI ")
    unit = stripped[len(number) :].strip().upper()
    if unit not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"unknown unit {unit!r} in {text!r}; use B, KB, MB, GB, KiB, MiB or GiB")
    try:
        value = float(number) * BYTE_UNITS[unit] if unit else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB or 1000000, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text}")
    return int(value)
