"""Mixed steps: a prompt's tokens and the decoding rows in one forward pass (TensorRT-LLM's in-flight batching
runs context and generation requests in one forward of the model engine; Sarathi-Serve's stall-free batching).

A decode step of the 8B shape reads every weight (16 GB, about 5 ms on an H200) for one token a row; a prefill
pass of a 1,024-token prompt reads them once too, but is bound by its FLOPs (about 30 ms). Run apart, the decode
rows wait for every prefill and pay their own read after it; together, the decoding rows' tokens ride on the
prefill's read of the weights at the cost of their attention. With enable_chunked_prefill and a small
max_num_tokens this is Sarathi's policy: every step a chunk of prompt beside every decoding row.

A part of TorchEngine: it works on the engine's core (core.py) and uses the context steps' inputs and
bookkeeping (context_steps.py) and the decode steps' settling of the tokens left on the device (decode_steps.py).
"""

from __future__ import annotations

import logging
import time

from hpc.runtime.engine.models.llama import StepRows
from hpc.runtime.engine.torch.context_steps import ContextSteps, outweighs_launches
from hpc.runtime.engine.torch.core import EngineCore
from hpc.runtime.engine.torch.decode_steps import DecodeSteps
from hpc.runtime.engine.torch.sampling import on_device
from hpc.runtime.engine.torch.sequence import PrefillGroup, Seq, chunkable, fresh_first
from hpc.runtime.engine.types import DisaggregationMode, FinishReason

log = logging.getLogger(__name__)


class MixedSteps:
    def __init__(self, core: EngineCore, context: ContextSteps, decode: DecodeSteps, enabled: bool) -> None:
        self.core, self.context, self.decode = core, context, decode
        # one rank and one stage (followers step by broadcast kinds that have no mixed one); an aggregated engine
        # is the only one with both prompts and decoding rows
        self.enabled = enabled and core.mode is DisaggregationMode.AGGREGATED and core.alone

    def takes(self, groups: tuple[PrefillGroup, ...], decoding: int) -> bool:
        """Whether this step's prompt work goes in a mixed step beside `decoding` rows: plain prompts (no media,
        no prompt logprobs), and unless a prefill graph would run it, or its work is large enough that one eager
        pass beats the graphs' replays (the torch path's rule, outweighs_launches): on the tiny model graphs win."""
        work = [item for group in groups for item in group]
        if not (self.enabled and decoding and work and all(chunkable(seq.request) for seq, _ in work)):
            return False
        fresh = not any(seq.length for seq, _ in work)
        tokens = sum(n for _, n in work)
        return self.core.prefill_graphs is None or not fresh or outweighs_launches(tokens, self.core.matmul_params)

    def run(self, groups: tuple[PrefillGroup, ...], running: list[Seq]) -> list[Seq]:
        """The groups' tokens and a decode step of `running` in one pass; the rows that decode on (the running
        ones, then the prompts whose first token this step picked). A failed step ends its rows with the error."""
        core = self.core
        self.decode.settle()  # the rows' last tokens on the host: a step in flight read first
        decoding = [seq for seq in running if core.still_running(seq)]
        if not decoding:
            return self.context.run(groups)
        group = fresh_first(tuple(item for one in groups for item in one))
        try:
            return self._step(group, decoding)
        except Exception as exc:
            log.exception("mixed step failed")
            for seq in [*decoding, *(seq for seq, _ in group)]:
                if seq.slot >= 0:
                    core.finish(seq, FinishReason.ERROR, error=str(exc))
            return []

    def _step(self, group: PrefillGroup, decoding: list[Seq]) -> list[Seq]:
        core, t0 = self.core, time.perf_counter()
        seqs = [seq for seq, _ in group]
        parts = self.context.prompt_parts(group)
        tokens = on_device([[seq.last_token] for seq in decoding], core.device)
        decode = StepRows(core.model.embed(tokens), on_device([[seq.length] for seq in decoding], core.device),
                          on_device([seq.slot for seq in decoding], core.device),
                          window=max(seq.length for seq in decoding) + 1)
        logits = core.model.forward_mixed(decode, parts, core.cache)
        for seq in decoding:
            seq.length += 1
        done = self.context.advance(group)
        core.counters["decode_steps"] += 1
        core.counters["prefill_steps"] += 1
        core.count("mixed_steps")
        core.count("mixed_prompt_tokens", sum(n for _, n in group))
        finished = [seqs[i] for i in done]
        rows = list(range(len(decoding))) + [len(decoding) + i for i in done]
        if len(rows) < logits.shape[0]:  # chunks that end mid-prompt pick nothing
            logits = logits[on_device(rows, logits.device)]
        picked = core.picker.pick_rows([*decoding, *finished], logits, core.sampler)
        going = []
        with core.emitter:
            for seq, (token, logprob) in zip(decoding, picked):
                if core.emit_token(seq, token, logprob):
                    going.append(seq)
            for seq, (token, logprob) in zip(finished, picked[len(decoding):]):
                if core.first_token(seq, token, logprob):
                    going.append(seq)
        core.clocked("mixed_seconds_total", t0)
        return going
