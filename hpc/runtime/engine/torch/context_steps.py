"""How the torch engine prefills: each admitted prompt waits in `_prefilling` until its tokens are in the KV
cache; each scheduler iteration prefills what fits the step's token budget (sequence.context_work: max_num_tokens
less a token per decoding row, TensorRT-LLM's micro-batch scheduler), then the decode step runs over the others.
With enable_chunked_prefill a prompt longer than what is left is prefilled a chunk per iteration, so the decoding
rows keep stepping between its chunks instead of waiting for the whole prompt. A part of TorchEngine, apart for
size; it uses the engine's model, cache, prefix cache, graphs, picker and counters."""

from __future__ import annotations

import logging
import time
import uuid

import torch

from hpc.engine_args.scheduling import max_num_tokens, tokens_per_block
from hpc.runtime.engine.kv import pack as kvpack
from hpc.runtime.engine.guided import Automaton
from hpc.runtime.engine.torch.kv_records import KvRecord, publish_each
from hpc.runtime.engine.torch.prefix_cache import PrefixCache
from hpc.runtime.engine.torch.sampling import make_generator, on_device, prompt_logprobs
from hpc.runtime.engine.torch.sequence import Seq, context_work, prefill_groups, remaining, wanted_prompt_logprobs
from hpc.runtime.engine.torch.tp import gather_kvs, scatter_kv
from hpc.runtime.engine.types import DisaggregatedParams, DisaggregationMode, TokenLogprob

log = logging.getLogger(__name__)

# work past the largest prefill graph goes in one eager step once its matmuls are this many GFLOP: then they
# outweigh the launches graphs save. H200 (benchmarks/reference_engine.py, session 42): the 8B shape's 64 x 64
# prompts took 130 ms in one eager step against 174 ms in two graphed ones (16 x 256: 127 against 171); the tiny
# model's 64 x 64 took 11.5 ms eagerly against 8.5 ms graphed, its steps all launches
EAGER_MIN_GFLOP = 1000.0


def one_eager_step(tokens: int, largest_graph: int, matmul_params: int) -> bool:
    """Whether this much prompt work goes in one eager step rather than graphed steps of the largest size."""
    return tokens > largest_graph and 2 * matmul_params * tokens >= EAGER_MIN_GFLOP * 1e9


Picked = tuple[int, TokenLogprob | None]
ON_DEVICE = object()  # a prompt's first token, picked and left on the device (overlap.FirstTokens)
STORE_AFTER_PROMPTS = 64  # a busy prefill worker stores its prompts at the latest once this many wait (_store_due)


class ContextSteps:
    matmul_params: int  # this rank's weights a step multiplies by (TorchEngine sets it at load)

    def _admit(self, seqs: list[Seq], running: list[Seq]) -> None:
        """A slot for each; KV handed over from a prefill worker goes in as it is (the ones shared over CUDA IPC
        copied together first), prompts wait for their prefill."""
        admitted = []
        for seq in seqs:
            if seq.cancelled:
                self._drop_pending(seq)
                continue
            if not self.free_slots:
                self._inbox.put(seq)  # retry next iteration, after a decode step frees slots
                self._counters["waiting"] += 1
                continue
            seq.slot = self.free_slots.pop()
            self._counters["requests"] += 1
            # from its arrival at the engine (a decode worker's KV fetch included) to a slot; the part in the inbox
            now = time.perf_counter()
            self._counters["queue_seconds_total"] += now - seq.started
            self._counters["inbox_seconds_total"] += now - seq.queued
            admitted.append(seq)
        for seq in self._copy_shared_kvs(admitted):
            try:
                seq.gen = make_generator(seq.request.sampling)
                if seq.request.sampling.guide is not None:
                    automaton = Automaton.from_guide(seq.request.sampling.guide)
                    seq.guide = (automaton, automaton.initial)
                if seq.imported_kv is not None:
                    self._import(seq)
                    running.append(seq)
                    continue
                self._start_prompt(seq)
            except Exception as exc:
                log.exception("admission failed")
                self._finish(seq, "error", error=str(exc))
                continue
            self._prefilling.append(seq)

    def _copy_shared_kvs(self, seqs: list[Seq]) -> list[Seq]:
        """The KVs shared over CUDA IPC among these arrivals copied in one go (kv.take_all), into their slots where
        they fit; the sequences whose admission goes on (all, unless the copy failed: those end with its error)."""
        pending = [seq for seq in seqs if isinstance(seq.imported_kv, kvpack.PendingCopy)]
        if not pending:
            return seqs
        shared, whole = [seq.imported_kv for seq in pending], self.cache.whole
        # straight into the slots when one rank holds every head in the KV's dtype; else each through a buffer
        # that _import scatters (a TP decode engine broadcasts it to its ranks)
        into_slots = self.world.size == 1 and all(kvpack.fits_slot(kv.meta, whole) for kv in shared)
        try:
            taken = kvpack.take_all(shared, whole, [seq.slot for seq in pending]) if into_slots \
                else kvpack.take_all(shared)
            for seq, kv in zip(pending, taken):
                seq.imported_kv = kv
        except Exception as exc:
            log.exception("copying handed-over KV failed")
            for seq in pending:
                self._finish(seq, "error", error=f"copying its KV failed: {exc}")
            return [seq for seq in seqs if seq.slot >= 0]
        return seqs

    def _start_prompt(self, seq: Seq) -> None:
        """The prompt's leading blocks from the prefix cache, if it holds them: its prefill starts after them. Image
        tokens look alike whatever the image; the prompt's logprobs need the logits of every position."""
        ids = seq.request.token_ids
        self._counters["prompt_tokens"] += len(ids)
        seq.reuse = self.prefix is not None and seq.media is None and wanted_prompt_logprobs(seq.request) is None
        if seq.reuse:
            blocks = self.prefix.match(ids)
            self.prefix.load(blocks, seq.slot)
            seq.cached = seq.length = len(blocks) * self.prefix.block
        self._counters["prompt_tokens_cached"] += seq.cached
        self._counters["prompt_tokens_computed"] += len(ids) - seq.cached

    def _import(self, seq: Seq) -> None:
        if isinstance(seq.imported_kv, kvpack.InSlot):  # copied into its slot as it was admitted (kv.take_all)
            length = seq.imported_kv.length
        else:
            kvpack.arrived(seq.imported_kv)  # its copy may still run on the handoff stream (kv.copy_shared)
            kv = seq.imported_kv.to(self.device, self.dtype)  # [layers, 2, all kv heads, T, d]
            scatter_kv(self.tp, self.cache, seq.slot, kv)
            length = kv.shape[3]
        seq.length = length
        params = seq.request.disaggregated_params
        seq.last_token = params.first_token_id
        seq.generated = 1  # the prefill worker produced the first token
        seq.counts = {params.first_token_id: 1}
        if seq.guide is not None:  # the prefill worker's guided first token, replayed
            automaton, state = seq.guide
            seq.guide = (automaton, automaton.feed(state, self.picker.token_texts()[params.first_token_id] or "")
                         or state)
        seq.imported_kv = None
        self._counters["prompt_tokens"] += length

    def _context_step(self, running: list[Seq]) -> None:
        """This iteration's prompt tokens (whole prompts and chunks), prefilled together where their padded width
        allows: within max_num_tokens and, with prefill graphs, within the largest unless the work needs more than
        one replay and is large enough for its matmuls to outweigh the launches (one_eager_step). A prompt whose last token is in picks its first new token and decodes (or, on a prefill worker, is
        handed over)."""
        self._prefilling = [s for s in self._prefilling if self._still_running(s)]
        work = context_work(self._prefilling, self._token_budget() - len(running), self.chunking, self.chunk_unit)
        budget = self._token_budget()
        if self.prefill_graphs is not None:
            largest, tokens = self.prefill_graphs.token_counts[-1], sum(n for _, n in work)
            # graphed steps of the largest size are packed rows under a block mask: for a large model one eager
            # step (SDPA's fused causal kernel) beats several of them; for a small one the launches they save win
            if not one_eager_step(tokens, largest, self.matmul_params):
                budget = largest
        for group in prefill_groups(work, budget, pipeline=self.pipeline.size > 1):
            stored_before = set(self._unstored)
            try:
                picked = self._prefill(group)
            except Exception as exc:
                log.exception("prefill failed")
                for slot in set(self._unstored) - stored_before:  # the failed group's KV is not worth keeping
                    del self._unstored[slot]
                for seq, _ in group:
                    self._finish(seq, "error", error=str(exc))
                continue
            if self.mode is DisaggregationMode.PREFILL:
                t0 = time.perf_counter()
                with self.emitter:  # the group's answers leave together
                    self._hand_over([(seq, *first) for (seq, _), first in zip(group, picked) if first is not None])
                self._clocked("prefill_answer_seconds_total", t0)
            else:
                for (seq, _), first in zip(group, picked):
                    if first is ON_DEVICE:  # joins the next decode step; its first token is sent as that launches
                        running.append(seq)
                    elif first is not None and self._first_token(seq, *first):  # decodes from its first token
                        running.append(seq)
        self._prefilling = [s for s in self._prefilling if s.slot >= 0 and remaining(s)]

    def _store_due(self, running: list[Seq]) -> bool:
        """Whether the prompts prefilled so far go into the prefix cache now, at the end of this iteration. An
        aggregated engine's do, after the decode step whose launch sends their first tokens. A prefill worker's
        wait until nothing does: no request waiting (the engine's link looked at again), or no free slot (the
        stored prompts' slots are held until then), or STORE_AFTER_PROMPTS of them; its arrivals then no longer
        wait behind the hashes, the pool copy and the KV events of the step before theirs."""
        if self.mode is not DisaggregationMode.PREFILL or running or self._prefilling or self._deferred:
            return True
        if len(self._unstored) >= STORE_AFTER_PROMPTS or not self.free_slots:
            return True
        if self.intake is not None:
            self.intake(0.0)  # requests in the link to the worker come into the inbox
        return self._inbox.empty()

    def _store_prompts(self) -> None:
        """The blocks of the prefilled prompts into the prefix cache, after their first tokens went out
        (TorchEngine._schedule, when _store_due): a prefill worker's answers, an aggregated engine's decode step
        whose launch sends them, neither waits for the hashes, the pool copy and the KV events (two fifths of a
        prefill worker's step at c=64 on an H200). Queued on the engine's stream before the next prefill over any
        of their slots (a released one is held until now), the pool copy reads each slot before anything later
        writes it; decode steps write past the prompt's whole blocks."""
        prompts = [(tokens, slot) for slot, tokens in self._unstored.items()]
        self._unstored = {}
        if self.prefix is not None and prompts:
            self.prefix.store_all(prompts)  # its records leave together (_kv_events_out)
        self.free_slots += self._held_slots
        self._held_slots = []

    def _prefix_cache(self) -> PrefixCache | None:
        """Prefix reuse as TensorRT-LLM's kv_cache_config sets it: on unless enable_block_reuse is false, blocks
        of tokens_per_block (32), a pool of max_tokens (8 x max_seq_len). Prefill and aggregated workers of one
        rank only: a decode worker takes its KV from prefill, and the ranks of a parallel worker would all have
        to copy the same blocks."""
        kv = self.args.get("kv_cache_config") or {}
        if kv.get("enable_block_reuse") is False or self.world.size > 1 or self.mode not in (
                DisaggregationMode.AGGREGATED, DisaggregationMode.PREFILL):
            return None
        block = tokens_per_block(self.args)
        capacity = int(kv.get("max_tokens") or 8 * self.max_len) // block
        return PrefixCache(block, max(1, capacity), self.cache, on_events=self._kv_events_out)

    def _kv_events_out(self, records: list[KvRecord]) -> None:
        """A prefill step's records, from the scheduler thread to whoever listens: all at once to on_kv_events, on
        this thread (an engine process's link: one message, as they are); else each to on_kv_event (the worker's
        NATS publisher) in TensorRT-LLM's form, made on its event loop, in one wake-up."""
        if self.on_kv_events is not None:
            self.on_kv_events(records)
            return
        listener, loop = self.on_kv_event, self._event_loop
        if listener is not None and loop is not None:
            loop.call_soon_threadsafe(publish_each, listener, records)

    def _token_budget(self) -> int:
        """Tokens one step may process (max_num_tokens)."""
        return max_num_tokens(self.args)

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
            kept = gather_kvs(self.tp, self.cache, [seq.slot for seq in alike], length)
            kvs += zip([seq.handoff for seq in alike], kept)
        self.handoffs.put_all(kvs)  # before any answer: a decode worker may ask for its KV at once

    def _hand_over(self, done: list[tuple[Seq, int, TokenLogprob | None]]) -> None:
        """Answer each prompt a prefill worker prefilled with its first token and where its KV waits."""
        for seq, first, logprob in done:
            self._counted_first(seq)
            params = DisaggregatedParams(request_handle=seq.handoff, prefill_address=self.self_address,
                                         first_token_id=first, prompt_length=seq.length)
            seq.hold(first, logprob)
            self._finish(seq, "length", params=params)

    def _counted_first(self, seq: Seq) -> None:
        self._counters["first_tokens"] += 1  # from its arrival at the engine to its first token read
        self._counters["first_token_seconds_total"] += time.perf_counter() - seq.started

    def _first_token(self, seq: Seq, token: int, logprob: TokenLogprob | None) -> bool:
        """Send a prompt's first token (here or once read from the device); False when it ended the request."""
        self._counted_first(seq)
        return self._emit_token(seq, token, logprob)

    def _keeps_first_on_device(self, seqs: list[Seq], want: int | None) -> bool:
        """May these prompts' first tokens stay on the device for the next decode step (FirstTokens)? Overlapped
        steps, rows the device can pick for, and a next step for each (not its last token, room in the cache)."""
        if not self.overlap or want is not None or self.mode is DisaggregationMode.PREFILL or self._first.full():
            return False
        return all(s.batchable and s.request.sampling.max_tokens > 1
                   and s.length + 2 < self.max_len for s in seqs)

    def _prefill(self, group: list[tuple[Seq, int]]) -> list[Picked | object | None]:
        """One forward pass over the next `n` prompt tokens of each sequence, from the first one not in the cache:
        replayed from a prefill graph (packed in one row) when every one starts at position 0, else eagerly,
        right-padded to the longest (a padded token's K/V lands past its row's end, where the next chunk or
        decode step writes before it reads). A prompt whose last token is in picks its first new token from its
        own last position's logits; a chunk that ends mid-prompt picks nothing (None)."""
        seqs = [seq for seq, _ in group]
        first = seqs[0]
        want = wanted_prompt_logprobs(first.request)  # such a prompt is prefilled alone
        rows = [seq.request.token_ids[seq.length:seq.length + n] for seq, n in group]
        t0 = time.perf_counter()
        logits = self.prefill_graphs.run(rows, [seq.slot for seq in seqs]) if self.prefill_graphs is not None \
            and want is None and first.media is None and not any(seq.length for seq in seqs) else None
        if logits is None:
            logits = self._padded_prefill(seqs, rows, last_only=want is None)
        t0 = self._clocked("prefill_launch_seconds_total", t0)
        self._counters["prefill_steps"] += 1
        if want is not None:  # [1, T, V]: position i's logits score token i + 1
            first.prompt_lp = prompt_logprobs(logits[0, :-1], first.request.token_ids[1:], want)
            logits = logits[:, -1]
        done = []
        for i, (seq, n) in enumerate(group):
            seq.length += n
            if remaining(seq):
                self._counters["prefill_chunks"] = self._counters.get("prefill_chunks", 0) + 1
                continue
            done.append(i)
        if self.prefix is not None:  # the prompts' new blocks go into the pool once they are answered
            self._unstored.update((seqs[i].slot, seqs[i].request.token_ids) for i in done if seqs[i].reuse)
        if self.mode is DisaggregationMode.PREFILL:
            self._keep_for_handoff([seqs[i] for i in done])
            t0 = self._clocked("prefill_keep_kv_seconds_total", t0)
        picked: list[Picked | object | None] = [None] * len(group)
        if done:
            rows_done = logits if len(done) == len(group) else logits[on_device(done, logits.device)]
            done_seqs = [seqs[i] for i in done]
            if self._keeps_first_on_device(done_seqs, want):
                self._first.hold(done_seqs, self.picker.pick_on_device(done_seqs, rows_done, self.sampler))
                self._counters["first_tokens_left_on_device"] = \
                    self._counters.get("first_tokens_left_on_device", 0) + len(done_seqs)
                for i in done:
                    picked[i] = ON_DEVICE
                return picked
            for i, result in zip(done, self.picker.pick_rows(done_seqs, rows_done, self.sampler)):
                picked[i] = result
            self._clocked("prefill_pick_seconds_total", t0)
        return picked

    def _clocked(self, counter: str, since: float) -> float:
        """Adds the time since `since` to a counter of the scheduler clock's prefill phases; returns now."""
        now = time.perf_counter()
        self._counters[counter] = self._counters.get(counter, 0.0) + now - since
        return now

    def _padded_prefill(self, seqs: list[Seq], rows: list[list[int]], last_only: bool) -> torch.Tensor:
        """The eager prefill: rows right-padded to the longest, each from its first token not in the cache."""
        first = seqs[0]
        width = max(map(len, rows))
        # staged as the decode steps' are (pinned): a chunk runs between overlapped decode steps without
        # waiting for the one in flight
        token_tensor = on_device([row + [0] * (width - len(row)) for row in rows], self.device)
        embeds = self.model.embed(token_tensor)
        if first.media is not None and self.cfg.vision:  # a prompt with media is prefilled alone, whole
            mask = token_tensor[0] == self.cfg.vision["image_token_id"]
            count = int(mask.sum())
            if count != first.media.shape[0]:
                raise ValueError(f"prompt has {count} image tokens but the image gave {first.media.shape[0]}")
            embeds[0, mask] = first.media.to(self.device, self.dtype)
        positions = on_device([[min(seq.length + j, self.max_len - 1) for j in range(width)] for seq in seqs],
                              self.device)
        slots = on_device([seq.slot for seq in seqs], self.device)
        last = on_device([len(row) - 1 for row in rows], self.device) if len(seqs) > 1 else None
        return self._forward("prefill", embeds, positions, slots, last_only=last_only, last=last)
