"""The torch engine's warm-up: every kind of step it will serve, run before it says ready."""

from __future__ import annotations

import logging
import time

import torch

from hpc.runtime.engine.kernels import fused_decode
from hpc.runtime.engine.torch.core import EngineCore
from hpc.runtime.engine.torch.decode_graphs import cuda_capture
from hpc.runtime.engine.torch.sampling import prompt_logprobs, sample_rows
from hpc.runtime.engine.types import SamplingParams

log = logging.getLogger(__name__)

WARMUP_PROMPT = 16  # tokens of the warm-up's prompts


def warm_up(core: EngineCore) -> tuple[list[tuple[str, int]], float]:
    """Run every kind of step the engine will serve before it says ready (load() runs before the worker
    registers): Triton compiles and autotunes, cuBLAS and the attention backends pick their kernels, here
    and not in the first users' requests. Decode steps have no new shapes after this: every batch size runs
    the same Triton attention over the whole cache (see fused_decode). Every TP rank runs the same steps
    in its own load(), so their collectives pair up. Returns what ran, and its seconds."""
    t0 = time.perf_counter()
    device, model, cache = core.device, core.model, core.cache
    if device.type == "cuda":
        # Batched prefills and prefills after a reused prefix attend through a mask; SDPA would take cuDNN
        # there, which builds a plan per (batch, length) shape — 30-500 ms each time a new mix of prompts
        # is prefilled together, all through the first sweep after a launch. Its flash and memory-efficient
        # kernels need no plans.
        torch.backends.cuda.enable_cudnn_sdp(False)
    n = min(WARMUP_PROMPT, core.max_len - 1)
    rows_prefill = min(2, core.max_batch)
    ids = torch.full((rows_prefill, n), 2, device=device)
    for b in sorted({1, rows_prefill}):  # one prompt from scratch (causal), two together (masked)
        model.forward_step(model.embed(ids[:b]), torch.arange(n, device=device)[None].expand(b, n),
                           torch.arange(b, dtype=torch.long, device=device), cache)
    warmed: list[tuple[str, int]] = [("prefill", n)]
    # 1 and 2 rows: Triton specializes integer arguments equal to 1, so 2 compiles the other variant
    for rows in sorted({1, min(core.max_batch, 2), min(core.max_batch, fused_decode.MAX_BATCH + 1),
                        core.max_batch}):
        tokens = torch.full((rows, 1), 2, device=device)
        model.forward_step(model.embed(tokens), torch.full((rows, 1), n, device=device),
                           torch.arange(rows, device=device), cache)
        warmed.append(("decode", rows))
    _warm_sampling(core)
    warmed.append(("sampling", 2))
    if core.graphs is not None:
        core.graphs.capture(cuda_capture(device), model.fused_decode)
        warmed.append(("graphs", len(core.graphs.sizes.batch_sizes)))
    if core.prefill_graphs is not None:  # a pool of its own: its logits are read while decode graphs run
        core.prefill_graphs.capture(cuda_capture(device))
        warmed.append(("prefill graphs", len(core.prefill_graphs.token_counts)))
    if core.prefix is not None and device.type == "cuda":  # what one prefill step may store
        most = max(core.token_budget, core.prefill_graphs.token_counts[-1] if core.prefill_graphs else 0)
        core.prefix.capture_copies(cuda_capture(device), most // core.prefix.block)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    log.info("warmed up in %.2f s: %s", seconds, warmed)
    return warmed, seconds


def _warm_sampling(core: EngineCore) -> None:
    """The kernels that choose tokens, on 1 and 2 rows: sampled with temperature alone and with top-k/top-p,
    greedy, and logprobs. On a GPU each kernel's first launch loads its module (CUDA's lazy loading): the
    first sampled request of a launch paid some 25 ms for it, in its TTFT on prefill and again in decode."""
    vocab = core.cfg.vocab_size
    for rows in sorted({1, min(core.max_batch, 2)}):
        logits = torch.zeros(rows, vocab, device=core.device, dtype=core.dtype)
        for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)):
            sample_rows(logits, [params] * rows, core.sampler).tolist()
        logits.argmax(-1).tolist()
        prompt_logprobs(logits, [0] * rows, 2)
