"""How the torch engine runs a decode step: step by step (launch, read the tokens, emit them), or overlapped
(overlap.py: the next step launched from the tokens still on the device, the previous step's emitted meanwhile).
A part of TorchEngine: it works on the engine's core (core.py), keeps the step in flight, and is given the rows
to step (run)."""

from __future__ import annotations

import logging

import torch

from hpc.runtime.engine.torch.core import EngineCore
from hpc.runtime.engine.torch.overlap import HostCopies, InflightStep, carry_over, next_inputs, startable
from hpc.runtime.engine.torch.sampling import graph_temperatures, on_device
from hpc.runtime.engine.torch.sequence import Seq
from hpc.runtime.engine.types import FinishReason

log = logging.getLogger(__name__)


class DecodeSteps:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._inflight: InflightStep | None = None  # the overlapped step launched, its tokens not read yet
        self._host_copies = HostCopies(core.max_batch, core.device)

    def run(self, running: list[Seq]) -> bool:
        """A decode step; one that raises ends its batch with the error (False: none of them runs on), and the
        engine serves on."""
        try:
            self._decode_step(running)
            return True
        except Exception as exc:
            log.exception("decode step failed")
            self._inflight = None
            self.core.first.take()
            for s in running:
                self.core.finish(s, FinishReason.ERROR, error=str(exc))
            return False

    def settle(self) -> None:
        """Every token still on the device read and sent (a step's in flight, prefills' first ones): a mixed step
        (mixed_steps.py) takes its rows' tokens from the host."""
        self._emit_first_tokens()
        self._emit_inflight()

    @property
    def _steps_a_launch(self) -> int:
        """Decode steps an overlapped launch runs where its rows allow (DecodeGraphs' `steps`)."""
        return self.core.graphs.steps if self.core.graphs is not None else 1

    def _decode_step(self, running: list[Seq]) -> None:
        if self._inflight is not None or self.core.first.steps:  # tokens not read: a step's, prefills' first ones
            carried = carry_over(self._inflight, running, self.core.max_len, self._steps_a_launch)
            if carried is None or not (carried[0] or carried[1]):
                self._emit_first_tokens()  # a row needs its token on the host, or none goes on: read them first
                if self._inflight is not None:
                    self._emit_inflight()
                return
            kept, joined = carried
            if joined and self._inflight is not None:
                self.core.count("decode_rows_joined_in_flight", len(joined))
            steps = self._steps_a_launch  # carry_over kept the rows with the positions for them
            if self._inflight is not None and self._carries_in_graph(kept, joined):
                rows = [self._inflight.rows[i] for i in kept] + joined
                self._launch_overlapped(rows, None, sources=kept + [-1] * len(joined), steps=steps)
                return
            rows, tokens = next_inputs(self._inflight, kept, joined, self.core.first,
                                       lambda ids: on_device(ids, self.core.device))
            self._launch_overlapped(rows, tokens, steps=steps)
            return
        if self.core.overlap:
            # several steps a launch only where every row has the cache positions for them, else one
            several = self._steps_a_launch
            for steps in (several, 1) if several > 1 else (1,):
                if startable(running, self.core.max_len, steps):
                    self._launch_overlapped(running, None, steps=steps)
                    return
        self.core.counters["decode_steps"] += 1
        logits, _, _ = self._decode_launch(running, None)
        picked = self.core.picker.pick_rows(running, logits, self.core.sampler)
        with self.core.emitter:
            for s, (token, logprob) in zip(running, picked):
                self.core.emit_token(s, token, logprob)

    def _carries_in_graph(self, kept: list[int], joined: list[Seq]) -> bool:
        """May the next step's graph take its kept rows' tokens from the step in flight by index (DecodeGraphs.picks)?
        That step picked inside the graphs' last replay, no joined row's first token waits on the device
        (FirstTokens), and a graph covers the rows. A decode worker's steps are all like this: its rows join with
        their first token from the host."""
        step, graphs = self._inflight, self.core.graphs
        return step is not None and step.replay is not None and graphs is not None and step.replay == graphs.replays \
            and not any(id(seq) in self.core.first.rows for seq in joined) and graphs.covers(len(kept) + len(joined))

    def _decode_launch(self, running: list[Seq], device_tokens: torch.Tensor | None, pick: bool = False,
                       sources: list[int] | None = None, steps: int = 1,
                       positions: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One decode step's logits, each row's token from its last one (or `device_tokens`, on the device, or with
        `sources` the graphs' last picks for the rows that have one there); with `pick`, each row's next token too
        when the step's graph could pick them (else None). `steps` > 1: that many steps in one replay where a graph
        picks every row's tokens (else one); the steps it ran come last. `positions`: the rows' lengths, made."""
        if positions is None:
            positions = [s.length for s in running]
        slots = [s.slot for s in running]
        tokens = [s.last_token for s in running]
        replayed = None
        if self.core.graphs is not None:
            temperatures = graph_temperatures(running) if pick else None
            if steps > 1 and (temperatures is None or not self.core.graphs.covers_steps(len(running))):
                steps = 1
            replayed = self.core.graphs.run_picking(tokens, positions, slots, temperatures, device_tokens, sources,
                                               steps)
        if replayed is None and sources is not None:
            raise RuntimeError(f"no decode graph for {len(running)} rows whose tokens are the last step's picks")
        if replayed is None:  # no graph for this batch: eagerly, its inputs staged as the graphs' are (pinned)
            steps = 1
            token_tensor = device_tokens if device_tokens is not None else on_device(tokens, self.core.device)
            replayed = self.core.decode_logits(token_tensor[:, None], on_device(positions, self.core.device)[:, None],
                                           on_device(slots, self.core.device)), None
        for s in running:
            s.length += steps
        logits, picks = replayed
        return logits, picks, steps

    def _launch_overlapped(self, running: list[Seq], device_tokens: torch.Tensor | None,
                           sources: list[int] | None = None, steps: int = 1) -> None:
        """Launch a step (or `steps` in one replay, where a graph picks every row's tokens) whose tokens stay on the
        device, then emit the previous step's (overlap.py)."""
        self.core.counters["decode_steps"] += 1
        self.core.count("decode_steps_overlapped")
        positions = [s.length for s in running] if steps > 1 else None
        logits, tokens, steps = self._decode_launch(running, device_tokens, pick=True, sources=sources, steps=steps,
                                                    positions=positions)
        graphs, replay = self.core.graphs, None
        if tokens is None or graphs is None:  # (a graph's picks come only from a graph)
            tokens = self.core.picker.pick_on_device(running, logits, self.core.sampler)
        else:
            self.core.count("decode_steps_picked_in_graph")
            replay = graphs.replays
        if sources is not None:
            self.core.count("decode_steps_carried_in_graph")
        # the picks' copy to the host: made by the graph itself when it copies (DecodeGraphs.copies_in_graph)
        made = graphs.last_host_copy if replay is not None and graphs is not None and graphs.copies_in_graph \
            else None
        host_copy = made if made is not None else self._host_copies.start(tokens)
        if steps > 1:
            self.core.count("decode_launches_multi_step_total")
        previous, self._inflight = self._inflight, InflightStep(list(running), tokens, *host_copy, replay=replay,
                                                                steps=steps, positions=positions)
        if previous is not None:
            self._emit_inflight(previous)
        self._emit_first_tokens()

    def _emit_first_tokens(self) -> None:
        """Read and send the first tokens prefills picked on the device (ContextSteps: FirstTokens)."""
        for step in self.core.first.take():
            self._send_read(step, lambda seq, token: self.core.first_token(seq, token, None))

    def _emit_inflight(self, step: InflightStep | None = None) -> None:
        """Read a step's tokens (the one in flight by default) and send them. A row's token that neither ends it nor
        needs more than itself sent (Seq.plain, an output streamed already) leaves as a bare token: the emitter
        gets the step's all at once (Emitter.send_tokens; an engine process sends them as two lists of ints), the
        scheduler thread's cost of an output per row per step (EngineCore.emit_token) spared."""
        if step is None:
            step, self._inflight = self._inflight, None
        if step is None:
            return
        if step.steps > 1:
            self._emit_steps(step)
            return
        bare: list[Seq] = []
        tokens: list[int] = []
        max_len = self.core.max_len
        with self.core.emitter:
            for seq, token in zip(step.rows, step.read()):
                if seq.slot < 0:  # ended meanwhile (a stop token read after this step was launched, a cancel)
                    continue
                generated = seq.generated + 1
                # end_of's test of a plain row (no guide), inline: a call a row a step was a tenth of the step
                if seq.plain and seq.streamed and token not in seq.ends_on and \
                        generated < seq.max_tokens and seq.length + 1 < max_len:
                    seq.generated = generated
                    seq.last_token = token
                    bare.append(seq)
                    tokens.append(token)
                else:
                    self.core.emit_token(seq, token)
            if bare:
                self._send_bare(bare, tokens, 1)

    def _emit_steps(self, step: InflightStep) -> None:
        """Read and send the tokens of a replay of several steps, each row's in order. A row whose tokens all leave
        bare (the test of _emit_inflight, for each) sends them so; any other row sends each through emit_token up
        to its end, its cache length as it stood at that token (the rows' lengths have moved on with the launch
        after) — a row's tokens never split between the two, whose outputs the worker takes in separate passes.
        Tokens past a row's end were computed and are dropped."""
        bare: list[Seq] = []
        tokens: list[int] = []
        steps, positions = step.steps, step.positions
        assert positions is not None, "a replay of several steps records its rows' positions"
        max_len = self.core.max_len
        with self.core.emitter:
            for seq, row_tokens, position in zip(step.rows, zip(*step.read()), positions):
                if seq.slot < 0:  # ended meanwhile (a stop token read after this step was launched, a cancel)
                    continue
                if seq.plain and seq.streamed and seq.ends_on.isdisjoint(row_tokens) and \
                        seq.generated + steps < seq.max_tokens and position + steps + 1 < max_len:
                    seq.generated += steps
                    seq.last_token = row_tokens[-1]
                    bare.append(seq)
                    tokens += row_tokens
                    continue
                ahead = seq.length
                for i, token in enumerate(row_tokens):
                    seq.length = position + i + 1  # as it stood after this token's step: end_of's cache test
                    if not self.core.emit_token(seq, token):
                        break
                else:
                    seq.length = ahead
            if bare:
                self._send_bare(bare, tokens, steps)

    def _send_bare(self, seqs: list[Seq], tokens: list[int], steps: int) -> None:
        """Tokens that leave bare (Emitter.send_tokens), `steps` of each row in turn, counted."""
        self.core.counters["generated_tokens"] += len(tokens)
        self.core.count("decode_tokens_bare_total", len(tokens))
        self.core.emitter.send_tokens(seqs, tokens, steps)

    def _send_read(self, step: InflightStep, send) -> None:
        """Read tokens picked on the device and `send` each; rows that ended meanwhile (a stop token read after
        this step was launched, a cancel) are skipped."""
        with self.core.emitter:
            for seq, token in zip(step.rows, step.read()):
                if seq.slot >= 0:
                    send(seq, token)

