"""Overlapped decode steps: step N+1 is launched before step N's tokens are read on the host.

TensorRT-LLM's overlap scheduler (on unless `disable_overlap_scheduler`; PyExecutor._executor_loop_overlap in
tensorrt_llm/_torch/pyexecutor/py_executor.py) keeps the GPU busy while the host emits the previous step's tokens,
checks stops and stages the next step: the tokens a step picks stay on the device and are the next step's input.
Here steps chain while requests arrive and end: the next step takes the rows of the step in flight that go on
(their tokens gathered on the device) and the rows that joined since (their tokens from the host). The chain
breaks (the step in flight is read first, then the next one is staged from the host) only when a row needs its
token on the host before the next step (penalties, guides, seeds, logprobs: TokenPicker.batchable). A row that
stops on a token the host reads later (EOS, a stop token) has one more token computed in the step already in
flight, never sent. A row that ends by count or by the cache's length is known in advance: no step is launched
past it. Under load a request arrives or ends at nearly every step, so a chain that broke at each batch change
was read back step by step nearly all the time.
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


def carry_over(step: InflightStep, running: list["Seq"], max_len: int,
               batchable) -> tuple[list[int], list["Seq"]] | None:
    """The next step's rows while `step` is in flight, as TensorRT-LLM's overlap scheduler forms them: the rows
    of `step` that go on past its token (their indices in it: their input is its device tokens), then the rows
    that joined since (prefilled here or handed over, their token on the host). A row whose token in flight ends
    it by count or cache length (known now) sits the step out; its token is emitted as the step launches.
    None when a row needs its token on the host before its next step (penalties, guides, seeds, logprobs)."""
    index = {id(seq): i for i, seq in enumerate(step.rows)}
    kept: list[int] = []
    joined: list["Seq"] = []
    for seq in running:
        p = seq.request.sampling
        if not batchable(p):
            return None
        i = index.get(id(seq))
        if i is None:
            if seq.length + 1 >= max_len:
                return None
            joined.append(seq)
        elif seq.generated + 1 < p.max_tokens and seq.length + 2 < max_len:
            kept.append(i)
    return kept, joined


def next_tokens(step: InflightStep, kept: list[int], joined: list["Seq"], stage) -> torch.Tensor:
    """The device input of the step after `step` (carry_over's rows): its kept rows' tokens, still on the device,
    then the joined rows' from the host (`stage`: a host list to the device without waiting for it)."""
    if kept == list(range(len(step.rows))):
        carried = step.tokens
    else:
        carried = step.tokens[stage(kept)] if kept else None
    if not joined:
        return carried
    fresh = stage([seq.last_token for seq in joined])
    return fresh if carried is None else torch.cat([carried, fresh])


def startable(running: list["Seq"], max_len: int, batchable) -> bool:
    """May a chain start with this step? Its rows batchable and none at the cache's end (a row whose next token is
    its last by count just sits out the step after, carry_over)."""
    return all(batchable(seq.request.sampling) and seq.length + 2 < max_len for seq in running)
