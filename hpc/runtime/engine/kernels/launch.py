"""Launching a Triton kernel, typed as Triton runs it."""

from __future__ import annotations

from typing import Any, Callable


def launch(kernel: Any, grid: Any) -> Callable[..., None]:
    """`kernel[grid]`: a call that takes the kernel's arguments and Triton's launch options (num_warps, num_stages,
    launch_pdl). Triton types `kernel[grid]` as the kernel function itself, whose parameters are its constexpr
    annotations and no launch options, so every typed launch would be an error to the type checker."""
    return kernel[grid]
