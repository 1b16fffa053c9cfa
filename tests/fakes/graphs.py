"""A CUDA graph stood in for on the CPU: the contract of torch.cuda.CUDAGraph that the engine relies on (inputs read
from static buffers at replay, the output written in place into the tensor the capture returned)."""

from __future__ import annotations

import torch


class RecordedGraph:
    """capture(fn) -> (replay, output); replay recomputes fn into the same output tensor."""

    def __init__(self) -> None:
        self.captured: list[int] = []  # each capture's output rows, in capture order

    def __call__(self, fn):
        out = fn()  # a tensor, or a tuple of them
        outs = out if isinstance(out, tuple) else (out,)
        self.captured.append(outs[0].shape[0])

        def replay() -> None:
            with torch.inference_mode():  # as the engine's steps run
                again = fn()
                for old, new in zip(outs, again if isinstance(again, tuple) else (again,)):
                    old.copy_(new)
        return replay, out
