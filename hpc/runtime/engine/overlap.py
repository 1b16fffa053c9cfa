"""Overlapped decode steps: step N+1 is launched before step N's tokens are read on the host.

TensorRT-LLM's overlap scheduler (on unless `disable_overlap_scheduler`; PyExecutor._executor_loop_overlap in
tensorrt_llm/_torch/pyexecutor/py_executor.py) keeps the GPU busy while the host emits the previous step's tokens,
checks stops and stages the next step: the tokens a step picks stay on the device and are the next step's input.
Here a chain of such steps runs while the batch stays the same; it breaks (the step in flight is read first, then
the next one is staged from the host) when a request arrives or ends, or when a row needs its token on the host
before the next step (penalties, guides, seeds, logprobs: TokenPicker.batchable). A row that stops on a token
the host reads later (EOS, a stop token) has one more token computed in the step already in flight, never sent.
A row that ends by count or by the cache's length is known in advance: no step is launched past it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hpc.runtime.engine.sequence import Seq


@dataclass
class InflightStep:
    rows: list["Seq"]
    tokens: torch.Tensor  # [rows] on the device: what the step picked, the input of the next
    host: torch.Tensor  # their copy on the host, complete once `done` is
    done: Any = None  # a CUDA event after the copy (None on the CPU: the copy is done)

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()  # waits for this step only, not the one launched after it
        return self.host.tolist()


class HostCopies:
    """Two pinned host buffers, used in turn: a step's tokens are read while the next step's are being copied.
    Made on first use, in the scheduler thread: pinning memory sets up CUDA on the thread's current device, which
    only the engine's own threads make the engine's GPU."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows, self.device = rows, device
        self.buffers: list[torch.Tensor] = []
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.device.type != "cuda":
            return tokens, None
        if not self.buffers:
            self.buffers = [torch.empty(self.rows, dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self.buffers[self.turn][:tokens.shape[0]]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done


def chainable(step: InflightStep | None, running: list["Seq"], max_len: int, batchable) -> bool:
    """May the next step be launched from `step`'s device tokens before they are read? The same rows, each
    batchable, and none ending by count or cache length when its token in flight is emitted (that is known now;
    the next step then fits, and a stop by length is found exactly where the step-by-step path finds it)."""
    if step is None or len(step.rows) != len(running) or any(a is not b for a, b in zip(step.rows, running)):
        return False
    for seq in running:
        p = seq.request.sampling
        if not batchable(p) or seq.generated + 1 >= p.max_tokens or seq.length + 2 >= max_len:
            return False
    return True


def startable(running: list["Seq"], max_len: int, batchable) -> bool:
    """May a chain start with this step? Its rows batchable, and their next token not their last by count or
    cache length (a step launched after it would be wasted on every row)."""
    for seq in running:
        p = seq.request.sampling
        if not batchable(p) or seq.generated + 2 >= p.max_tokens or seq.length + 2 >= max_len:
            return False
    return True
