"""`hpc bench` (filled in by the benchmark issue)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    return None
