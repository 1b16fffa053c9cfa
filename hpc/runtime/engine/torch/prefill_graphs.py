"""Prefill steps replayed from CUDA graphs, one graph per token count, captured before the worker says ready.

Under sustained load a step admits one or two new prompts. Run eagerly, their prefill is a hundred small
launches (~2 ms for the tiny model on an H100, twice the graphed decode step beside it), so launching, not
computing, bounded how fast the engine took in new requests. As TensorRT-LLM's piecewise CUDA graphs do (see
hpc.engine_args.cuda_graphs), a step's prompts are packed into one row of tokens and padded up to the next
captured count; unlike them, attention is inside the graph too: every prompt starts at position 0 (nothing
from the prefix cache) and attends only to its own tokens, causally, through a mask built on the device from
each token's prompt index.

The graphs read one static device buffer (token, position, cache slot, prompt index of each token, then each
prompt's last-token index) and write each prompt's logits to a static tensor. Padded tokens go to the spare
cache slot that no sequence owns; padded logit rows read token 0.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, cast

import numpy as np
import torch

from hpc.runtime.engine.torch.decode_graphs import Capture
from hpc.runtime.engine.torch.sampling import stage_into

log = logging.getLogger(__name__)

# tokens, positions, slots, prompt index [N] each and the prompts' last tokens [R] -> logits [R, V]
PackedStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
_TOKEN, _POSITION, _SLOT, _PROMPT, _LAST = range(5)


class PrefillGraphs:
    def __init__(self, step: PackedStep, token_counts: tuple[int, ...], max_prompts: int, scratch_slot: int,
                 max_len: int, device: torch.device) -> None:
        self.step = step
        self.token_counts = token_counts  # ascending
        self.max_prompts = max_prompts
        self.scratch_slot = scratch_slot
        self.max_len = max_len
        self.inputs = torch.zeros(5, token_counts[-1], dtype=torch.long, device=device)
        self.inputs[_SLOT].fill_(scratch_slot)
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}  # step() returns one tensor
        self.replays = 0

    def prompts_for(self, count: int) -> int:
        """How many prompts the graph of `count` tokens takes (each prompt is at least one token)."""
        return min(count, self.max_prompts)

    def capture(self, capture: Capture) -> None:
        for count in sorted(self.token_counts, reverse=True):  # largest first: the others reuse its memory
            rows = self.inputs[:_LAST, :count]
            last = self.inputs[_LAST, :self.prompts_for(count)]
            graph = capture(lambda r=rows, i=last: self.step(r[_TOKEN], r[_POSITION], r[_SLOT], r[_PROMPT], i))
            self._graphs[count] = cast("tuple[Callable[[], None], torch.Tensor]", graph)
        log.info("prefill CUDA graphs for %s tokens", list(self.token_counts))

    def run(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor | None:
        """Logits [prompts, V] of each prompt's last token, each prefilled from position 0 into its slot; None
        when no graph holds them (the caller runs the step eagerly). Read the logits before the next run."""
        total = sum(map(len, prompts))
        count = next((n for n in self.token_counts if n >= total), None)
        if count is None or count not in self._graphs or len(prompts) > self.prompts_for(count):
            return None
        pad = count - total
        lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        ends = np.cumsum(lengths)
        # built with numpy, only the graph's own columns: Python lists of every token took a tenth of a prefill
        # worker's step at c=64 (a list of every column of the largest graph, 3,072, took 2 ms)
        staged = np.zeros((5, count), dtype=np.int64)
        staged[_TOKEN, :total] = np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=total)
        staged[_POSITION, :total] = np.arange(total) - np.repeat(ends - lengths, lengths)
        staged[_POSITION, total:] = np.minimum(np.arange(pad), self.max_len - 1)
        staged[_SLOT, :total] = np.repeat(np.asarray(slots, dtype=np.int64), lengths)
        staged[_SLOT, total:] = self.scratch_slot
        staged[_PROMPT, :total] = np.repeat(np.arange(len(prompts)), lengths)
        staged[_PROMPT, total:] = -1  # padding: a prompt of its own
        staged[_LAST, :len(prompts)] = ends - 1
        stage_into(torch.from_numpy(staged), self.inputs[:, :count])  # one copy: a chunk or prompt admitted
        # between overlapped steps does not wait for the decode step in flight
        replay, logits = self._graphs[count]
        replay()
        self.replays += 1
        return logits[:len(prompts)]
