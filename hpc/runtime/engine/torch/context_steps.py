"""How the torch engine admits requests and prefills: each admitted prompt waits in the scheduler's prefilling
list until its tokens are in the KV cache; each iteration prefills what fits the step's token budget
(sequence.context_work: max_num_tokens less a token per decoding row, TensorRT-LLM's micro-batch scheduler), then
the decode step runs over the others. With enable_chunked_prefill a prompt longer than what is left is prefilled a
chunk per iteration, so the decoding rows keep stepping between its chunks instead of waiting for the whole
prompt. A part of TorchEngine: it works on the engine's core (core.py) and is given its work (plan, run)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.guided import Automaton
from hpc.runtime.engine.models.llama import StepRows
from hpc.runtime.engine.torch.core import EngineCore, drop_pending
from hpc.runtime.engine.torch.sampling import make_generator, on_device, prompt_logprobs
from hpc.runtime.engine.torch.sequence import (PrefillGroup, Seq, context_work, fresh_first, prefill_groups,
                                               remaining, wanted_prompt_logprobs)
from hpc.runtime.engine.torch.tp import gather_kvs, scatter_kv
from hpc.runtime.engine.types import DisaggregatedParams, DisaggregationMode, FinishReason, TokenLogprob

log = logging.getLogger(__name__)

# work past the largest prefill graph goes in one eager step once its matmuls are this many GFLOP: then they
# outweigh the launches graphs save. H200 (benchmarks/reference_engine.py, session 42): the 8B shape's 64 x 64
# prompts took 130 ms in one eager step against 174 ms in two graphed ones (16 x 256: 127 against 171); the tiny
# model's 64 x 64 took 11.5 ms eagerly against 8.5 ms graphed, its steps all launches
EAGER_MIN_GFLOP = 1000.0


def outweighs_launches(tokens: int, matmul_params: int) -> bool:
    """Whether this much prompt work's matmuls outweigh the launches a prefill graph saves (EAGER_MIN_GFLOP)."""
    return 2 * matmul_params * tokens >= EAGER_MIN_GFLOP * 1e9


def one_eager_step(tokens: int, largest_graph: int, matmul_params: int) -> bool:
    """Whether this much prompt work goes in one eager step rather than graphed steps of the largest size."""
    return tokens > largest_graph and outweighs_launches(tokens, matmul_params)


Picked = tuple[int, TokenLogprob | None]


class OnDevice:
    """A prompt's first token, picked and left on the device (overlap.FirstTokens)."""


ON_DEVICE = OnDevice()


@dataclass(slots=True)
class Admitted:
    """Arrivals given a slot (ContextSteps.admit): `decoding` took their KV from a prefill worker and decode from
    the next step, `prompts` wait for their prefill; `no_slot` found none and wait for a step to free one."""
    decoding: list[Seq] = field(default_factory=list)
    prompts: list[Seq] = field(default_factory=list)
    no_slot: list[Seq] = field(default_factory=list)


class ContextSteps:
    def __init__(self, core: EngineCore, handoffs: kvpack.HeldKv, self_address: str) -> None:
        self.core = core
        self.handoffs = handoffs  # a prefill worker's KV, kept for its decode workers
        self.self_address = self_address  # where they ask for it (DisaggregatedParams.prefill_address)

    def admit(self, seqs: list[Seq]) -> Admitted:
        """A slot for each; KV handed over from a prefill worker goes in as it is (the ones shared over CUDA IPC
        copied together first), prompts wait for their prefill."""
        core, admitted, taken = self.core, Admitted(), []
        for seq in seqs:
            if seq.cancelled:
                drop_pending(seq)
                continue
            if not core.slots.free:
                admitted.no_slot.append(seq)
                continue
            seq.slot = core.slots.free.pop()
            core.counters["requests"] += 1
            # from its arrival at the engine (a decode worker's KV fetch included) to a slot; the part in the inbox
            now = time.perf_counter()
            core.counters["queue_seconds_total"] += now - seq.started
            core.counters["inbox_seconds_total"] += now - seq.queued
            taken.append(seq)
        for seq in self._copy_shared_kvs(taken):
            try:
                seq.gen = make_generator(seq.request.sampling)
                if seq.request.sampling.guide is not None:
                    automaton = Automaton.from_guide(seq.request.sampling.guide)
                    seq.guide = (automaton, automaton.initial)
                if seq.imported_kv is not None:
                    self._import(seq)
                    admitted.decoding.append(seq)
                    continue
                self._start_prompt(seq)
            except Exception as exc:
                log.exception("admission failed")
                core.finish(seq, FinishReason.ERROR, error=str(exc))
                continue
            admitted.prompts.append(seq)
        return admitted

    def _copy_shared_kvs(self, seqs: list[Seq]) -> list[Seq]:
        """The KVs shared over CUDA IPC among these arrivals copied in one go (kv.take_all), into their slots where
        they fit; the sequences whose admission goes on (all, unless the copy failed: those end with its error)."""
        pending = [seq for seq in seqs if isinstance(seq.imported_kv, kvpack.PendingCopy)]
        if not pending:
            return seqs
        shared, whole = [seq.imported_kv for seq in pending], self.core.cache.whole
        # straight into the slots when one rank holds every head in the KV's dtype; else each through a buffer
        # that _import scatters (a TP decode engine broadcasts it to its ranks)
        into_slots = self.core.world.size == 1 and all(kvpack.fits_slot(kv.meta, whole) for kv in shared)
        try:
            taken = kvpack.take_all(shared, whole, [seq.slot for seq in pending]) if into_slots \
                else kvpack.take_all(shared)
            for seq, kv in zip(pending, taken):
                seq.imported_kv = kv
        except Exception as exc:
            log.exception("copying handed-over KV failed")
            for seq in pending:
                self.core.finish(seq, FinishReason.ERROR, error=f"copying its KV failed: {exc}")
            return [seq for seq in seqs if seq.slot >= 0]
        return seqs

    def _start_prompt(self, seq: Seq) -> None:
        """The prompt's leading blocks from the prefix cache, if it holds them: its prefill starts after them. Image
        tokens look alike whatever the image; the prompt's logprobs need the logits of every position."""
        core, ids = self.core, seq.request.token_ids
        core.counters["prompt_tokens"] += len(ids)
        prefix = core.prefix
        seq.reuse = prefix is not None and seq.media is None and wanted_prompt_logprobs(seq.request) is None
        if prefix is not None and seq.reuse:
            blocks = prefix.match(ids)
            prefix.load(blocks, seq.slot)
            seq.cached = seq.length = len(blocks) * prefix.block
        core.counters["prompt_tokens_cached"] += seq.cached
        core.counters["prompt_tokens_computed"] += len(ids) - seq.cached

    def _import(self, seq: Seq) -> None:
        core = self.core
        if isinstance(seq.imported_kv, kvpack.InSlot):  # copied into its slot as it was admitted (kv.take_all)
            length = seq.imported_kv.length
        else:
            kvpack.arrived(seq.imported_kv)  # its copy may still run on the handoff stream (kv.copy_shared)
            kv = seq.imported_kv.to(core.device, core.dtype)  # [layers, 2, all kv heads, T, d]
            scatter_kv(core.tp, core.cache, seq.slot, kv)
            length = kv.shape[3]
        seq.length = length
        params = seq.request.disaggregated_params
        if params is None:  # a request with imported KV came from a prefill worker, which sets them
            raise ValueError(f"request {seq.request.request_id}: imported KV without disaggregated_params")
        seq.last_token = params.first_token_id
        seq.generated = 1  # the prefill worker produced the first token
        seq.counts = {params.first_token_id: 1}
        if seq.guide is not None:  # the prefill worker's guided first token, replayed
            automaton, state = seq.guide
            seq.guide = (automaton, automaton.feed(state, core.picker.token_texts()[params.first_token_id] or "")
                         or state)
        seq.imported_kv = None
        core.counters["prompt_tokens"] += length

    def plan(self, prefilling: list[Seq], decoding: int) -> tuple[PrefillGroup, ...]:
        """This iteration's prompt tokens (whole prompts and chunks) beside `decoding` rows, in forward passes
        together where their padded width allows: within max_num_tokens and, with prefill graphs, within the
        largest unless the work needs more than one replay and is large enough for its matmuls to outweigh the
        launches (one_eager_step)."""
        core = self.core
        limits = core.limits
        work = context_work(prefilling, core.token_budget - decoding, limits.chunking, limits.tokens_per_block)
        budget = core.token_budget
        if core.prefill_graphs is not None:
            largest, tokens = core.prefill_graphs.token_counts[-1], sum(n for _, n in work)
            # graphed steps of the largest size are packed rows under a block mask: for a large model one eager
            # step (SDPA's fused causal kernel) beats several of them; for a small one the launches they save win
            if not one_eager_step(tokens, largest, core.matmul_params):
                budget = largest
        return tuple(tuple(group) for group in prefill_groups(work, budget, pipeline=core.pipeline.size > 1))

    def run(self, groups: tuple[PrefillGroup, ...]) -> list[Seq]:
        """Prefill each group; a prompt whose last token is in picks its first new token and decodes (the rows
        returned: they join this iteration's decode step) or, on a prefill worker, is handed over."""
        core, joined = self.core, []
        for group in map(fresh_first, groups):  # the order of the prompt rows' logits (prompt_parts)
            stored_before = set(core.slots.unstored)
            try:
                picked = self._prefill(group)
            except Exception as exc:
                log.exception("prefill failed")
                for slot in set(core.slots.unstored) - stored_before:  # the failed group's KV is not worth keeping
                    del core.slots.unstored[slot]
                for seq, _ in group:
                    core.finish(seq, FinishReason.ERROR, error=str(exc))
                continue
            if core.mode is DisaggregationMode.PREFILL:
                t0 = time.perf_counter()
                with core.emitter:  # the group's answers leave together
                    self._hand_over([(seq, *first) for (seq, _), first in zip(group, picked)
                                     if isinstance(first, tuple)])
                core.clocked("prefill_answer_seconds_total", t0)
                continue
            for (seq, _), first in zip(group, picked):
                if first is ON_DEVICE:  # joins the next decode step; its first token is sent as that launches
                    joined.append(seq)
                elif isinstance(first, tuple) and core.first_token(seq, *first):  # decodes from its first token
                    joined.append(seq)
        return joined

    def _keep_for_handoff(self, seqs: list[Seq]) -> None:
        """A prefill worker keeps each prompt's KV for its decode worker (every rank's heads, so that a decode of
        any TP can take it), all of a step's under one event, queued before the step's first tokens are read: that
        read waits for the copies too, so the KV is complete when the answer leaves (and can go with it: the
        worker's PrefillHandler shares it over CUDA IPC in the answer, sparing the decode worker a FetchKv)."""
        kvs = []
        by_length: dict[int, list[Seq]] = {}
        for seq in seqs:
            seq.handoff = uuid.uuid4().hex
            by_length.setdefault(seq.length, []).append(seq)
        for length, alike in by_length.items():
            kept = gather_kvs(self.core.tp, self.core.cache, [seq.slot for seq in alike], length)
            kvs += zip([seq.handoff for seq in alike], kept)
        self.handoffs.put_all(kvs)  # before any answer: a decode worker may ask for its KV at once

    def _hand_over(self, done: list[tuple[Seq, int, TokenLogprob | None]]) -> None:
        """Answer each prompt a prefill worker prefilled with its first token and where its KV waits."""
        for seq, first, logprob in done:
            self.core.counted_first(seq)
            params = DisaggregatedParams(request_handle=seq.handoff, prefill_address=self.self_address,
                                         first_token_id=first, prompt_length=seq.length)
            seq.hold(first, logprob)
            self.core.finish(seq, FinishReason.LENGTH, params=params)

    def _keeps_first_on_device(self, seqs: list[Seq], want: int | None) -> bool:
        """May these prompts' first tokens stay on the device for the next decode step (FirstTokens)? Overlapped
        steps, rows the device can pick for, and a next step for each (not its last token, room in the cache)."""
        core = self.core
        if not core.overlap or want is not None or core.mode is DisaggregationMode.PREFILL or core.first.full():
            return False
        return all(s.batchable and s.request.sampling.max_tokens > 1
                   and s.length + 2 < core.max_len for s in seqs)

    def _prefill(self, group: PrefillGroup) -> list[Picked | OnDevice | None]:
        """One forward pass over the next `n` prompt tokens of each sequence, from the first one not in the cache:
        replayed from a prefill graph (packed in one row) when every one starts at position 0, else eagerly,
        right-padded to the longest (a padded token's K/V lands past its row's end, where the next chunk or
        decode step writes before it reads). A prompt whose last token is in picks its first new token from its
        own last position's logits; a chunk that ends mid-prompt picks nothing (None)."""
        core = self.core
        seqs = [seq for seq, _ in group]
        first = seqs[0]
        want = wanted_prompt_logprobs(first.request)  # such a prompt is prefilled alone
        rows = [seq.request.token_ids[seq.length:seq.length + n] for seq, n in group]
        t0 = time.perf_counter()
        logits = core.prefill_graphs.run(rows, [seq.slot for seq in seqs]) if core.prefill_graphs is not None \
            and want is None and first.media is None and not any(seq.length for seq in seqs) else None
        if logits is None:
            logits = self._padded_prefill(group, last_only=want is None)
        t0 = core.clocked("prefill_launch_seconds_total", t0)
        core.counters["prefill_steps"] += 1
        if want is not None:  # [1, T, V]: position i's logits score token i + 1
            first.prompt_lp = prompt_logprobs(logits[0, :-1], first.request.token_ids[1:], want)
            logits = logits[:, -1]
        done = self.advance(group)
        if core.mode is DisaggregationMode.PREFILL:
            self._keep_for_handoff([seqs[i] for i in done])
            t0 = core.clocked("prefill_keep_kv_seconds_total", t0)
        picked: list[Picked | OnDevice | None] = [None] * len(group)
        if done:
            rows_done = logits if len(done) == len(group) else logits[on_device(done, logits.device)]
            done_seqs = [seqs[i] for i in done]
            if self._keeps_first_on_device(done_seqs, want):
                core.first.hold(done_seqs, core.picker.pick_on_device(done_seqs, rows_done, core.sampler))
                core.count("first_tokens_left_on_device", len(done_seqs))
                for i in done:
                    picked[i] = ON_DEVICE
                return picked
            for i, result in zip(done, core.picker.pick_rows(done_seqs, rows_done, core.sampler)):
                picked[i] = result
            core.clocked("prefill_pick_seconds_total", t0)
        return picked

    def advance(self, group: PrefillGroup) -> list[int]:
        """After a pass over the group's tokens: each prompt's cache length moved on; the indices of those whose
        last token is in (their blocks wait for the prefix cache: SlotBook.store)."""
        core, done = self.core, []
        for i, (seq, n) in enumerate(group):
            seq.length += n
            if remaining(seq):
                core.count("prefill_chunks")
                continue
            done.append(i)
        if core.prefix is not None:  # the prompts' new blocks go into the pool once they are answered
            core.slots.unstored.update((group[i][0].slot, group[i][0].request.token_ids) for i in done
                                       if group[i][0].reuse)
        return done

    def _padded_prefill(self, group: PrefillGroup, last_only: bool) -> torch.Tensor:
        """The eager prefill, each row from its first token not in the cache. One rank's takes the mixed steps'
        pass without decode rows (prompt_parts; their fused element-wise kernels on a GPU); else the rows
        right-padded to the longest in one batch."""
        core = self.core
        if last_only and core.alone:
            return core.model.forward_mixed(None, self.prompt_parts(group), core.cache)
        prompts = self.padded_inputs(group)
        return core.forward("prefill", prompts.embeds, prompts.positions, prompts.slots, last_only=last_only,
                            last=prompts.last if len(group) > 1 else None)

    def prompt_parts(self, group: PrefillGroup) -> list[StepRows]:
        """A group's rows as forward_mixed's parts, in the group's order (fresh_first's): the fresh prompts
        right-padded together (one causal attention), each prompt going on from its cache alone (a causal
        attention over its cache; rows of several lengths going on together took the masked path, SDPA's math
        kernel in fp32, which made chunked prefill slower than whole prompts)."""
        assert list(group) == list(fresh_first(group)), "a group's fresh prompts come first"
        fresh = [(seq, n) for seq, n in group if not seq.length]
        return ([self.padded_inputs(fresh)] if fresh else []) + [self.padded_inputs([(seq, n)])
                                                                 for seq, n in group if seq.length]

    def padded_inputs(self, group: PrefillGroup | list[tuple[Seq, int]]) -> StepRows:
        """A prefill's inputs, rows right-padded to the longest, each from its first token not in the cache
        (embeds [B, T, H], positions [B, T], slots [B], each row's last real token [B])."""
        core = self.core
        seqs = [seq for seq, _ in group]
        rows = [seq.request.token_ids[seq.length:seq.length + n] for seq, n in group]
        first = seqs[0]
        width = max(map(len, rows))
        # staged as the decode steps' are (pinned): a chunk runs between overlapped decode steps without
        # waiting for the one in flight
        token_tensor = on_device([row + [0] * (width - len(row)) for row in rows], core.device)
        embeds = core.model.embed(token_tensor)
        vision = core.cfg.vision
        if first.media is not None and vision:  # a prompt with media is prefilled alone, whole
            mask = token_tensor[0] == vision["image_token_id"]
            count = int(mask.sum())
            if count != first.media.shape[0]:
                raise ValueError(f"prompt has {count} image tokens but the image gave {first.media.shape[0]}")
            embeds[0, mask] = first.media.to(core.device, core.dtype)
        positions = on_device([[min(seq.length + j, core.max_len - 1) for j in range(width)] for seq in seqs],
                              core.device)
        slots = on_device([seq.slot for seq in seqs], core.device)
        return StepRows(embeds, positions, slots, window=max(seq.length + len(row) for seq, row in zip(seqs, rows)),
                        fresh=not any(seq.length for seq in seqs),
                        last=on_device([len(row) - 1 for row in rows], core.device))
