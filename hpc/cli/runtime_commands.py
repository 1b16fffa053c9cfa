"""Parsers of the commands that touch running jobs: status, logs, cancel, smoke, model, dev-cluster."""

from __future__ import annotations

import argparse


def add_parsers(sub: argparse._SubParsersAction) -> None:
    pass
