"""argparse `type=` callables shared by the command lines: a bad value is a usage error (exit 2) naming
the option, not a traceback from deep inside the command. Only argparse is imported, like the cli modules."""

from __future__ import annotations

import argparse


def port(text: str) -> int:
    """A TCP port, 1-65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (1-65535)")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


def positive_int_list(text: str) -> list[int]:
    """Comma-separated counts, each at least 1 ("1,2,4,8"): sorted, each once."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must list counts of at least 1")
    return values


def int_between(low: int, high: int):
    """A whole number from `low` to `high` (both included)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} must be from {low} to {high}")
        return value

    return parse


def positive(text: str) -> float:
    """A number above 0 (a rate of 0 divided by zero; a negative duration sent nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number above 0")
    return value


def non_negative(text: str) -> float:
    """A number of 0 or more (where 0 means something: off, or sized automatically)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a number of 0 or more")
    return value


def retention_days(text: str) -> float:
    """A retention in days: above 0, at most MAX_RETENTION_DAYS (a cutoff further back overflows)."""
    from clora.config import MAX_RETENTION_DAYS

    value = positive(text)
    if value > MAX_RETENTION_DAYS:
        raise argparse.ArgumentTypeError(f"{text} days is more than {MAX_RETENTION_DAYS:,.0f} (some 270 years)")
    return value
