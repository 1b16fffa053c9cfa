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

import itertools
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hpc.runtime.engine.host_wait import finish

if TYPE_CHECKING:
    from hpc.runtime.engine.torch.sequence import Seq


@dataclass
class InflightStep:
    rows: list["Seq"]
    tokens: torch.Tensor  # [rows] on the device: what the step picked, the input of the next
    host: torch.Tensor  # their copy on the host, complete once `done` is
    done: Any = None  # a CUDA event after the copy (None on the CPU: the copy is done)
    replay: int | None = None  # picked inside the decode graphs' replay of this number (DecodeGraphs.picks)
    # a replay of several steps (DecodeGraphs' `steps`): `host` is [steps, rows], `tokens` the last step's picks,
    # and `positions` each row's first position in it (where its cache length stood, for the tokens' ends)
    steps: int = 1
    positions: list[int] | None = None

    def read(self) -> list:
        """The tokens: one a row, or for a replay of several steps a list a step."""
        finish(self.done)  # this step only, not the one launched after it
        return self.host.tolist()


class HostCopies:
    """Pinned host buffers (two by default), used in turn: a step's tokens are read while the next step's are being
    copied.
    Made on first use, in the scheduler thread: pinning memory sets up CUDA on the thread's current device, which
    only the engine's own threads make the engine's GPU."""

    def __init__(self, rows: int, device: torch.device, buffers: int = 2) -> None:
        self.rows, self.device, self.count = rows, device, buffers
        self.buffers: list[torch.Tensor] = []
        # an event per buffer, recorded again as its buffer is: a step's copy was read before its buffer comes round
        # again (as the buffer's values must be), and a new event a step cost a creation and a destruction
        self.events: list[torch.cuda.Event] = []
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if self.device.type != "cuda":
            return tokens, None
        if not self.buffers:
            self.buffers = [torch.empty(self.rows, dtype=torch.long, pin_memory=True) for _ in range(self.count)]
            self.events = [torch.cuda.Event() for _ in range(self.count)]
        turn, self.turn = self.turn, (self.turn + 1) % self.count
        host = self.buffers[turn][:tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        done = self.events[turn]
        done.record()
        return host, done


_batchable = operator.attrgetter("batchable")


def carry_over(step: InflightStep | None, running: list["Seq"], max_len: int,
               steps: int = 1) -> tuple[list[int], list["Seq"]] | None:
    """The next step's rows while `step` is in flight, as TensorRT-LLM's overlap scheduler forms them: the rows
    of `step` that go on past its token (their indices in it: their input is its device tokens), then the rows
    that joined since (handed over or prefilled here: their token on the host, or still on the device where the
    prefill picked it, FirstTokens). A row whose token in flight ends it by count or cache length (known now)
    sits the step out; its token is emitted as the step launches. None when a row needs its token on the host
    before its next step (penalties, guides, seeds, logprobs). `steps`: the next launch's steps (a replay of
    several); a row goes on only with the cache positions for them all, and `step`'s own steps count ahead."""
    if not all(map(_batchable, running)):
        return None
    ahead = step.steps if step is not None else 1
    room = max_len - steps
    # each row's index in the step (None: joined since), looked up in C: a 64-row step's host time went ~40 %
    # to this function and the emission of the step before (benchmarks/decode_host_step.py)
    index = dict(zip(map(id, step.rows), itertools.count())) if step is not None else {}
    kept: list[int] = []
    joined: list["Seq"] = []
    for seq, i in zip(running, map(index.get, map(id, running))):
        if i is None:
            if seq.length >= room:
                return None
            joined.append(seq)
        elif seq.generated + ahead < seq.max_tokens and seq.length + 1 < room:
            kept.append(i)
    return kept, joined


def _gathered(step: InflightStep, indices: list[int], stage) -> torch.Tensor:
    return step.tokens if indices == list(range(len(step.rows))) else step.tokens[stage(indices)]


def next_inputs(step: InflightStep | None, kept: list[int], joined: list["Seq"], first: "FirstTokens",
                stage) -> tuple[list["Seq"], torch.Tensor]:
    """The rows of the step after `step` (carry_over's) and their input tokens on the device: the kept rows'
    from `step`, the joined rows' from the prefill steps that picked their first token on the device, the
    others' from the host (`stage`: a host list to the device without waiting for it)."""
    rows = [step.rows[i] for i in kept] if step is not None else []
    parts = [_gathered(step, kept, stage)] if kept and step is not None else []
    from_host: list["Seq"] = []
    by_prefill: dict[int, tuple[InflightStep, list[int], list["Seq"]]] = {}
    for seq in joined:
        where = first.rows.get(id(seq))
        if where is None:
            from_host.append(seq)
        else:
            _, indices, seqs = by_prefill.setdefault(id(where[0]), (where[0], [], []))
            indices.append(where[1])
            seqs.append(seq)
    for prefill, indices, seqs in by_prefill.values():
        parts.append(_gathered(prefill, indices, stage))
        rows += seqs
    if from_host:
        parts.append(stage([seq.last_token for seq in from_host]))
        rows += from_host
    return rows, parts[0] if len(parts) == 1 else torch.cat(parts)


class FirstTokens:
    """First tokens a prefill picked on the device and nobody has read yet (TensorRT-LLM's overlap scheduler keeps a
    context request's first token on the device too): the rows join the next decode step with them as input,
    and they are read and sent as that step launches — an aggregated engine under load prefills at nearly
    every step, and reading each prefill's tokens back at once drained the device before every such step."""

    LIMIT = 4  # steps held at most (host buffers in turn); one more is read first

    def __init__(self, rows: int, device: torch.device) -> None:
        self.copies = HostCopies(rows, device, buffers=2 * self.LIMIT)
        self.steps: list[InflightStep] = []
        self.rows: dict[int, tuple[InflightStep, int]] = {}  # id(seq) -> (its prefill's picks, its index there)

    def hold(self, seqs: list["Seq"], tokens: torch.Tensor) -> None:
        step = InflightStep(list(seqs), tokens, *self.copies.start(tokens))
        self.steps.append(step)
        for i, seq in enumerate(seqs):
            self.rows[id(seq)] = (step, i)

    def full(self) -> bool:
        return len(self.steps) >= self.LIMIT

    def take(self) -> list[InflightStep]:
        steps, self.steps, self.rows = self.steps, [], {}
        return steps


def startable(running: list["Seq"], max_len: int, steps: int = 1) -> bool:
    """May a chain start with this step (of `steps` steps)? Its rows batchable and none at the cache's end (a row
    whose next token is its last by count just sits out the step after, carry_over)."""
    room = max_len - steps - 1
    return all(seq.batchable and seq.length < room for seq in running)
