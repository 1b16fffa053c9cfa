"""The torch engine's warm-up: every kind of step it will serve, run before it says ready (TorchEngine's mixin)."""

from __future__ import annotations

import logging
import time

import torch

from hpc.runtime.engine.kernels import fused_decode
from hpc.runtime.engine.torch.decode_graphs import cuda_capture
from hpc.runtime.engine.torch.sampling import prompt_logprobs, sample_rows
from hpc.runtime.engine.types import SamplingParams

log = logging.getLogger(__name__)


class WarmUp:
    """TorchEngine's warm-up (its model, cache, graphs and limits are the engine's)."""

    def warm_up(self) -> None:
        """Run every kind of step the engine will serve before it says ready (load() runs before the worker
        registers): Triton compiles and autotunes, cuBLAS and the attention backends pick their kernels, here
        and not in the first users' requests. Decode steps have no new shapes after this: every batch size runs
        the same Triton attention over the whole cache (see fused_decode). Every TP rank runs the same steps
        in its own load(), so their collectives pair up."""
        t0 = time.perf_counter()
        if self.device.type == "cuda":
            # Batched prefills and prefills after a reused prefix attend through a mask; SDPA would take cuDNN
            # there, which builds a plan per (batch, length) shape — 30-500 ms each time a new mix of prompts
            # is prefilled together, all through the first sweep after a launch. Its flash and memory-efficient
            # kernels need no plans.
            torch.backends.cuda.enable_cudnn_sdp(False)
        n = min(self.WARMUP_PROMPT, self.max_len - 1)
        rows_prefill = min(2, self.max_batch)
        ids = torch.full((rows_prefill, n), 2, device=self.device)
        for b in sorted({1, rows_prefill}):  # one prompt from scratch (causal), two together (masked)
            self.model.forward_step(self.model.embed(ids[:b]), torch.arange(n, device=self.device)[None].expand(b, n),
                                    torch.arange(b, dtype=torch.long, device=self.device), self.cache)
        self.warmed: list[tuple[str, int]] = [("prefill", n)]
        # 1 and 2 rows: Triton specializes integer arguments equal to 1, so 2 compiles the other variant
        for rows in sorted({1, min(self.max_batch, 2), min(self.max_batch, fused_decode.MAX_BATCH + 1),
                            self.max_batch}):
            tokens = torch.full((rows, 1), 2, device=self.device)
            self.model.forward_step(self.model.embed(tokens), torch.full((rows, 1), n, device=self.device),
                                    torch.arange(rows, device=self.device), self.cache)
            self.warmed.append(("decode", rows))
        self._warm_sampling()
        self.warmed.append(("sampling", 2))
        if self.graphs is not None:
            self.graphs.capture(cuda_capture(self.device), self.model.fused_decode)
            self.warmed.append(("graphs", len(self.graphs.sizes.batch_sizes)))
        if self.prefill_graphs is not None:  # a pool of its own: its logits are read while decode graphs run
            self.prefill_graphs.capture(cuda_capture(self.device))
            self.warmed.append(("prefill graphs", len(self.prefill_graphs.token_counts)))
        if self.prefix is not None and self.device.type == "cuda":  # what one prefill step may store
            most = max(self._token_budget(), self.prefill_graphs.token_counts[-1] if self.prefill_graphs else 0)
            self.prefix.capture_copies(cuda_capture(self.device), most // self.prefix.block)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t0
        log.info("warmed up in %.2f s: %s", self.warmup_s, self.warmed)

    def _warm_sampling(self) -> None:
        """The kernels that choose tokens, on 1 and 2 rows: sampled with temperature alone and with top-k/top-p,
        greedy, and logprobs. On a GPU each kernel's first launch loads its module (CUDA's lazy loading): the
        first sampled request of a launch paid some 25 ms for it, in its TTFT on prefill and again in decode."""
        vocab = self.cfg.vocab_size
        for rows in sorted({1, min(self.max_batch, 2)}):
            logits = torch.zeros(rows, vocab, device=self.device, dtype=self.dtype)
            for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)):
                sample_rows(logits, [params] * rows, self.sampler).tolist()
            logits.argmax(-1).tolist()
            prompt_logprobs(logits, [0] * rows, 2)
