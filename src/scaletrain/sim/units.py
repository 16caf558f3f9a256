"""Counts as people write them on the command line: `15.6T` tokens, `300B`, `2.5e12`, `1,000,000`. Stdlib only."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
"""Decimal multipliers of a count's suffix (case-insensitive): thousand, million, billion (B or G), trillion, peta."""


def parse_count(text: str, what: str = "count") -> int:
    """The whole number `text` writes: a plain or scientific number (`300000000000`, `2.5e12`, `1,000`) or one with a
    decimal suffix K, M, B (or G), T, P (`15.6T` = 15.6e12, `300B`); ValueError naming `what` otherwise, or when the
    count is not a finite number >= 1."""
    raw = str(text).strip().replace(",", "").replace("_", "")
    scale = 1.0
    if raw and raw[-1].lower() in SUFFIXES:
        scale = SUFFIXES[raw[-1].lower()]
        raw = raw[:-1]
    try:
        value = float(raw) * scale
    except ValueError:
        raise ValueError(f"{what} {text!r}: expected a count such as 15.6T, 300B or 2.5e12") from None
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"{what} {text!r}: must be a finite count >= 1")
    return round(value)


def format_count(n: float) -> str:
    """`n` the way `parse_count` reads it back, to 4 significant digits: 15.6T, 300B, 1.5M, 999."""
    for suffix, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{suffix}"
    return f"{n:.4g}"


def count_flag(hi: float = 1e18) -> Callable[[str], int]:
    """An argparse `type` taking `parse_count`'s forms, up to `hi`; anything else is argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = parse_count(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).replace("count ", "", 1)) from None
        if value > hi:
            raise argparse.ArgumentTypeError(f"{text!r}: must be at most {hi:g}")
        return value

    parse.__name__ = "count"
    return parse


__all__ = ["parse_count", "format_count", "count_flag", "SUFFIXES"]
