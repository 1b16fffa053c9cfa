"""Decode steps replayed from CUDA graphs, one graph per batch size, captured before the worker says ready.

A decode step of a small batch is bound by launching its kernels, not by running them: the fused path is
six Triton launches per layer, each several microseconds of Python, more than the GPU needs for a small model.
A graph replays the whole step in one call. Which batch sizes get a graph, and whether a batch may be padded
up to the next one, is `cuda_graph_config` as TensorRT-LLM reads it (hpc.engine_args.cuda_graphs).

Each graph reads its inputs from one static device buffer (token, position and cache slot per row) and writes
its logits to a static tensor, so `run` copies a step's inputs in (one host-to-device copy) and replays.
Padded rows are token 0 at position 0 in a spare cache slot that no sequence owns. The step must be graph-safe:
no host syncs and no shapes that depend on values (the fused decode path is: its attention covers the whole
cache and reads positions from device memory).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from typing import Callable, ContextManager, Protocol, cast

import numpy as np
import torch

from hpc.engine_args.cuda_graphs import GraphSizes

log = logging.getLogger(__name__)

Step = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # tokens [B,1], positions [B,1], slots [B]
Pick = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits [B, V], temperatures [B] -> tokens [B]
Outputs = torch.Tensor | tuple[torch.Tensor, ...]
# capture(fn) -> (replay, output): after replay() the output tensor(s) hold what fn() would return now
Capture = Callable[[Callable[[], Outputs]], tuple[Callable[[], None], Outputs]]
# temperatures ride in the long input buffer as fixed point: one staged copy a step for all of a step's inputs
TEMPERATURE_SCALE = 1 << 24
INPUT_ROWS = 5  # a row's token, position, cache slot, temperature and source (DecodeGraphs.inputs)
# several steps a replay only where the largest batch's one-step replay is shorter than this: there the host's work
# for a step (0.1-0.3 ms at 64 rows on the GPU machines' CPUs) bounds the step, and a replay of several takes it
# once for them all; a model whose step is longer keeps one step a replay (a row joining waits for the replay in
# flight, and its tokens would come in bursts for nothing)
SEVERAL_STEPS_BELOW_S = 0.5e-3
# and no more steps than keep the largest batch's replay of several within this (four steps of the slowest step
# that gets several): a row joining waits for the replay in flight
SEVERAL_STEPS_REPLAY_S = 2e-3


def steps_for(one_step_s: float, most: int) -> int:
    """Decode steps a replay runs, at most `most`, given the largest batch's one-step replay: one where the device
    bounds the step (SEVERAL_STEPS_BELOW_S), else as many as fit in SEVERAL_STEPS_REPLAY_S, at least two."""
    if one_step_s >= SEVERAL_STEPS_BELOW_S:
        return 1
    return min(most, max(2, int(SEVERAL_STEPS_REPLAY_S / max(one_step_s, 1e-9))))


class StepPaths(Protocol):
    """The ways a decode step of some rows may run (fused_decode.FusedDecoder): paths_for(rows) names them, and a
    step run inside path(name) takes that one."""

    def paths_for(self, rows: int) -> tuple[str, ...]: ...

    def path(self, name: str) -> ContextManager[None]: ...


def replay_seconds(replay: Callable[[], None], times: int = 20) -> float:
    """The device's time for one replay, from `times` queued back to back (a replay's launch is microseconds:
    the device, not the host, sets their pace)."""
    replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(times):
        replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / times


def cuda_capture(device: torch.device) -> Capture:
    """Real CUDA graphs sharing one memory pool (captured largest first, the smaller ones reuse its blocks).

    No garbage collection during a capture: a cycle collected there that held CUDA resources (pinned memory, an
    earlier engine's graphs in the same process: an engine is a reference cycle) frees them inside the capture,
    which voids it — and a capture that fails to end leaves the device's default random generator in capture
    mode, so that every later draw raises 'Offset increment outside graph capture': the likely cause of that
    error in the GPU run of a test that builds engines one after another. What garbage there is now is
    collected first."""
    gc.collect()
    pool = torch.cuda.graph_pool_handle()

    def capture(fn: Callable[[], Outputs]) -> tuple[Callable[[], None], Outputs]:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # one eager run first: lazy allocations and library handles, not captured
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        collecting = gc.isenabled()
        gc.disable()
        try:
            # thread_local: another thread's CUDA call (an event loop opening a KV handoff) must not void it.
            # stream: torch.cuda.graph's default capture stream is made once per process on the device current
            # then, so a second engine on another GPU would capture on the first one's (an empty graph).
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                out = fn()
        finally:
            if collecting:
                gc.enable()
        return graph.replay, out

    return capture


class DecodeGraphs:
    def __init__(self, step: Step, sizes: GraphSizes, scratch_slot: int, device: torch.device,
                 pick: Pick | None = None, copies_in_graph: bool = False, steps: int = 1) -> None:
        """`pick`: each row's token from the step's logits at its temperature, captured with the step
        (run_picking). `copies_in_graph`: the staged inputs' copy to the device and the picks' copy to the host
        are captured in the graphs too (one graph per size and staging buffer), so a step is one replay: the
        engine's default (torch_engine.decode_graph_copies: false turns it off), a fifth of a c=64 step's host
        time on an H200.
        `steps` > 1 (with a pick and the copies captured): a second graph per size and buffer runs that many decode
        steps in one replay, each step's picks the next one's tokens (run_picking's `steps`): the host's work of
        a step — staging, the launch, the next step's rows — once per `steps` tokens a row."""
        self.step = step
        self.pick = pick
        self.copies_in_graph = copies_in_graph
        self.steps = steps if pick is not None and copies_in_graph else 1
        self.sizes = sizes
        self.scratch_slot = scratch_slot
        self.device = device
        largest = sizes.batch_sizes[-1]
        # rows 0-4: token, position, cache slot, temperature (x TEMPERATURE_SCALE) and source of each row of the
        # step — a row's index in the step before when its token is that step's pick (`picks`), else -1
        self.inputs = torch.zeros(INPUT_ROWS, largest, dtype=torch.long, device=device)
        self.inputs[2].fill_(scratch_slot)
        self.inputs[4].fill_(-1)
        self._input_tokens = self.inputs[0]
        # the picks of the last replay that picked, on the device: an overlapped step's rows that go on take their
        # tokens from here inside the graph, so the host stages no gather of them (run_picking's `sources`)
        self.picks = torch.zeros(largest, dtype=torch.long, device=device)
        # the host side of each step's inputs, pinned, two in turn: a copy from pageable memory would first wait
        # for the steps already queued (an overlapped step's is queued behind the one running; overlap.py), and a
        # buffer is written again only after the step that read it has been read back
        pinned = device.type == "cuda"
        self._staging = [torch.zeros(INPUT_ROWS, largest, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        for staged in self._staging:
            staged[2].fill_(scratch_slot)
            staged[4].fill_(-1)
        self._host = [staged.numpy() for staged in self._staging]  # the same memory
        # with copies_in_graph: each staging buffer's step writes its picks here (a row per step of a replay), and
        # an event after its replay
        self._host_picks = [torch.zeros(self.steps, largest, dtype=torch.long, pin_memory=pinned) for _ in range(2)] \
            if copies_in_graph else []
        self._host_first = [picks[0] for picks in self._host_picks]  # a one-step replay's row, a view made once
        self._copied = [torch.cuda.Event() for _ in range(2)] if copies_in_graph and pinned else []
        self.last_host_copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._turn = 0
        self._views: dict[tuple[int, int, bool], torch.Tensor] = {}  # (id of a static tensor, rows, columns) -> view
        # by (batch size, staging buffer), the buffer None unless the copies are captured; _multi: `steps` a replay
        self._graphs: dict[tuple[int, int | None], tuple[Callable[[], None], Outputs]] = {}
        self._multi: dict[tuple[int, int | None], tuple[Callable[[], None], Outputs]] = {}
        self.replays = 0
        self.timings: dict[int, dict[str, float]] = {}  # where a size had a choice: each path's seconds a replay
        self.one_step_s: float | None = None  # the largest batch's one-step replay, timed where `steps` > 1

    def capture(self, capture: Capture, paths: StepPaths | None = None,
                timer: Callable[[Callable[[], None]], float] = replay_seconds) -> None:
        """A graph per batch size (and staging buffer). Where `paths` offers a size more than one way to step, each
        is captured and replayed (`timer`: seconds a replay) and the faster one's graphs are kept. Then, with
        `steps` > 1, a graph of several steps per size and buffer where the host bounds a step, as many as
        `steps_for` allows (by `timer`; the CPU's stand-in graphs are not timed but by a timer given), else
        `steps` becomes 1."""
        largest_first = sorted(self.sizes.batch_sizes, reverse=True)
        for size in largest_first:
            turns = (0, 1) if self.copies_in_graph else (None,)
            options = paths.paths_for(size) if paths is not None else ()
            if len(options) > 1 and paths is not None:
                graphs = {}
                for name in options:
                    with paths.path(name):
                        graphs[name] = capture(self._step_of(size, turns[0]))
                self.timings[size] = {name: timer(graph[0]) for name, graph in graphs.items()}
                self._graphs[(size, turns[0])] = graphs[self.paths[size]]
                del graphs  # the slower one's graph: its memory goes back to the pool
            with self._kept_path(paths, size):
                for turn in turns:
                    if (size, turn) not in self._graphs:
                        self._graphs[(size, turn)] = capture(self._step_of(size, turn))
        if self.steps > 1 and (self.device.type == "cuda" or timer is not replay_seconds):  # a timer to ask
            self.one_step_s = timer(self.kept(largest_first[0]))
            self.steps = steps_for(self.one_step_s, self.steps)
            if self.steps == 1:
                log.info("decode: one step a replay (the largest batch's takes %.2f ms on the device)",
                         self.one_step_s * 1e3)
        for size in largest_first if self.steps > 1 else ():
            with self._kept_path(paths, size):
                for turn in (0, 1):
                    self._multi[(size, turn)] = capture(self._step_of(size, turn, self.steps))
        log.info("decode CUDA graphs for batch sizes %s (padding %s%s%s)%s", list(self.sizes.batch_sizes),
                 "on" if self.sizes.padding else "off", ", copies captured" if self.copies_in_graph else "",
                 f", {self.steps} steps a replay where the rows allow" if self.steps > 1 else "",
                 f", each size's faster path: {self.paths}" if self.paths else "")

    def _kept_path(self, paths: StepPaths | None, size: int) -> ContextManager[None]:
        """Where `size` had a choice of paths, the faster one's (captures inside it take that path)."""
        return paths.path(self.paths[size]) if size in self.timings and paths is not None \
            else contextlib.nullcontext()

    @property
    def paths(self) -> dict[int, str]:
        """The path each size's graphs took, where there was a choice: the faster one."""
        return {size: min(seconds, key=seconds.__getitem__) for size, seconds in self.timings.items()}

    def replay_seconds(self, size: int, times: int = 100) -> float:
        """The device's time for one replay of the graph kept for `size` rows (benchmarks/decode_graph_paths.py)."""
        return replay_seconds(self.kept(size), times)

    def kept(self, size: int) -> Callable[[], None]:
        """The replay of the graph kept for `size` rows (the benchmarks time it and trace its kernels)."""
        return self._graphs[(size, 0 if self.copies_in_graph else None)][0]

    def _step_of(self, size: int, turn: int | None, steps: int = 1) -> Callable[[], Outputs]:
        """A replay's work: `steps` decode steps, each from the one before's picks at the next position (padded
        rows too: position j of the spare slot)."""
        tokens, positions, slots, temperatures, sources = (self.inputs[i, :size] for i in range(INPUT_ROWS))
        picks = self.picks

        def step() -> Outputs:
            if turn is not None:  # read from the pinned buffer at each replay, not at capture
                self.inputs.copy_(self._staging[turn], non_blocking=True)
            carried = torch.where(sources >= 0, picks[sources.clamp(min=0)], tokens)
            for j in range(steps):
                logits = self.step(carried[:, None], (positions + j if j else positions)[:, None], slots)
                if self.pick is None:
                    return logits
                carried = self.pick(logits, temperatures.float() / TEMPERATURE_SCALE)
                if turn is not None:
                    self._host_picks[turn][j, :size].copy_(carried, non_blocking=True)
            picks[:size].copy_(carried)
            return logits, carried
        return step

    def covers(self, rows: int) -> bool:
        """Is there a graph for a step of `rows` (padded or not)?"""
        size = self.sizes.size_for(rows)
        return size is not None and (size, 0 if self.copies_in_graph else None) in self._graphs

    def covers_steps(self, rows: int) -> bool:
        """Is there a graph that runs `steps` steps of `rows` in one replay?"""
        size = self.sizes.size_for(rows)
        return size is not None and (size, 0) in self._multi

    def run(self, tokens: list[int], positions: list[int], slots: list[int],
            device_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [rows, V] of one decode step, or None when no graph fits (the caller runs it eagerly).
        `device_tokens` [rows]: the tokens are already on the device (an overlapped step's input) and `tokens`
        is ignored.

        The logits are a view of the graph's output: read them before the next run."""
        replayed = self.run_picking(tokens, positions, slots, None, device_tokens)
        return None if replayed is None else replayed[0]

    def run_picking(self, tokens: list[int], positions: list[int], slots: list[int],
                    temperatures: list[float] | None, device_tokens: torch.Tensor | None = None,
                    sources: list[int] | None = None,
                    steps: int = 1) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """run(), and with `temperatures` (one a row) each row's next token [rows] picked inside the graph at its
        temperature (0: greedy): a step's tokens without the sampling kernels launched from the host one by one
        (seven launches, each a release and re-take of the GIL that the worker's event loop contends for). The
        picks are None without temperatures or a `pick`; the whole is None when no graph fits.
        `sources` (one a row): a row's index in the last replay that picked, whose pick is its token (that step's
        tokens never come to the host first), or -1 for the token in `tokens` — an overlapped step's kept rows
        without the gather, index staging and copy the host launched for them, a seventh of a decode engine's
        scheduler time at c=64 on an H200.
        `steps` > 1 (with temperatures; covers_steps): that many steps in one replay, each row's token of each
        step picked inside it; the picks returned are the last step's, `last_host_copy` holds all [steps, rows].
        The caller makes sure each row has the cache positions for them."""
        rows = len(positions)
        if not self.covers(rows):
            return None
        graphs = self._graphs
        if steps > 1:
            if temperatures is None or not self.covers_steps(rows) or steps != self.steps:
                raise ValueError(f"no graph for {steps} steps of {rows} rows picked inside it")
            graphs = self._multi
        size = self.sizes.size_for(rows)
        if size is None:  # covers() said it fits
            return None
        turn = self._turn
        staged, host = self._staging[turn], self._host[turn]
        self._turn ^= 1
        if device_tokens is not None and self.copies_in_graph:  # the graph copies its inputs itself: these go
            self.picks[:rows].copy_(device_tokens)                # in as the picks each row takes by index
            device_tokens, sources = None, list(range(rows))
        # filled through numpy: no torch call, so no release and re-take of the GIL (each torch call is one, and
        # the worker's event loop takes the GIL in between)
        if device_tokens is None:
            host[0, :rows] = tokens
        host[1, :rows] = positions
        host[2, :rows] = slots
        # numpy's rounding is Python's round(): half to even
        host[3, :rows] = np.rint(np.multiply(temperatures, TEMPERATURE_SCALE)) if temperatures is not None else 0
        host[4, :rows] = sources if sources is not None else -1
        if size > rows:  # padded rows: token 0 at position 0 in the spare slot, whatever an earlier step left
            host[0:2, rows:size] = 0  # (slices: an index list, host[[0, 1, 3]], cost a 64-row step 4 %)
            host[3, rows:size] = 0
            host[2, rows:size] = self.scratch_slot
            host[4, rows:size] = -1
        if self.copies_in_graph:
            replay, out = graphs[(size, turn)]
            replay()
            done = None
            if self._copied:
                done = self._copied[turn]
                done.record()
            # its picks, once `done`: [rows], or [steps, rows] for a replay of several steps
            self.last_host_copy = (self._rows_of(self._host_first[turn], rows) if steps == 1 else
                                   self._rows_of(self._host_picks[turn], rows, columns=True), done)
        else:
            self.inputs.copy_(staged, non_blocking=True)  # the whole buffer: one contiguous copy
            if device_tokens is not None:
                self._tokens_of(rows).copy_(device_tokens)
            replay, out = self._graphs[(size, None)]
            replay()
        self.replays += 1
        if self.pick is None:
            return cast(torch.Tensor, out)[:rows], None
        logits, picked = cast("tuple[torch.Tensor, torch.Tensor]", out)  # step() with a pick returns both
        return self._rows_of(logits, rows), (self._rows_of(picked, rows) if temperatures is not None else None)

    def _tokens_of(self, rows: int) -> torch.Tensor:
        return self._rows_of(self._input_tokens, rows)

    def _rows_of(self, tensor: torch.Tensor, rows: int, columns: bool = False) -> torch.Tensor:
        """tensor[:rows] (with `columns`, tensor[:, :rows]) of a tensor this object keeps, made once: a view is a
        few microseconds of torch, and a step took three."""
        key = (id(tensor), rows, columns)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = tensor[:, :rows] if columns else tensor[:rows]
        return view
