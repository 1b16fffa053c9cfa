"""Argument types the commands share: a malformed value is argparse's one-line error (exit 2), never a run with it."""

from __future__ import annotations

import argparse
from typing import Callable


def bounded_int(low: int, high: int, why: str = "") -> Callable[[str], int]:
    """A whole number from `low` to `high` (`why`: what a value out of range would do, for the message)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text[:40]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low:,} to {high:,}{f' ({why})' if why else ''}")
        return value
    return parse
