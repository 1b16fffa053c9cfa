"""Waiting on the host for the device, without giving the GIL to a busy event loop: the scheduler waits for its
picks' copies, the KV's packing for its copy kernel."""

from __future__ import annotations

from typing import Any


def finish(event: Any) -> None:
    """Wait on the host for a CUDA event (or None) unless it has completed: `Event.synchronize` gives the GIL up even
    then (torch/csrc/cuda/Event.cpp releases it around the wait; `query` keeps it), and getting it back from a busy
    event loop can take Python's whole switch interval (5 ms)."""
    if event is not None and not event.query():
        event.synchronize()
