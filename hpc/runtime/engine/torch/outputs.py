"""How outputs leave the torch engine's scheduler thread for the requests' event loops."""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Iterator

from hpc.runtime.engine.types import GenerateOutput


def _deliver(items: list[tuple[asyncio.Queue, GenerateOutput]]) -> None:
    for outputs, out in items:
        outputs.put_nowait(out)


def rows_tokens(keys: list, tokens: list[int], steps: int) -> Iterator[tuple[Any, list[int]]]:
    """Each row's tokens of a decode step (`steps` > 1: a replay of several steps, a row's `steps` tokens in turn)
    as (key, tokens): one output for them, one frontend chunk, instead of one for each token (at c=64 on two H200
    the frontend's processes were 72 % busy, most of it with a chunk a token: py-spy, session 26)."""
    if steps == 1:
        return ((key, [token]) for key, token in zip(keys, tokens))
    return ((key, tokens[i * steps:(i + 1) * steps]) for i, key in enumerate(keys))


class Direct:
    """In place of a request's queue (TorchEngine.stream): each output goes straight to a callback on the loop."""

    __slots__ = ("put_nowait",)

    def __init__(self, put: Callable[[GenerateOutput], None]) -> None:
        self.put_nowait = put


class Emitter:
    """Outputs from the scheduler thread to the requests' event loops. Inside a decode step they are batched:
    one wake-up of each loop per step, not one per row (call_soon_threadsafe writes to the loop's self-pipe)."""

    def __init__(self) -> None:
        self.batch: dict[asyncio.AbstractEventLoop, list] | None = None

    def send(self, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue, out: GenerateOutput) -> None:
        if self.batch is None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)
        else:
            self.batch.setdefault(loop, []).append((outputs, out))

    def send_tokens(self, seqs: list, tokens: list[int], steps: int) -> None:
        """A decode step's bare tokens (DecodeSteps._emit_inflight), `steps` a row: a row's as one output, as
        send_held makes it."""
        for seq, row in rows_tokens(seqs, tokens, steps):
            seq.emit(seq.bare(row))

    def __enter__(self) -> "Emitter":
        self.batch = {}
        return self

    def __exit__(self, *exc: Any) -> None:
        batch, self.batch = self.batch or {}, None
        for loop, items in batch.items():
            loop.call_soon_threadsafe(_deliver, items)
