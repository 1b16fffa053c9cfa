"""Token sampling: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import torch

from hpc.runtime.engine.types import SamplingParams, TokenLogprob


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    gen.manual_seed(params.seed if params.seed is not None else torch.seed() % (2**63))
    return gen


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The model's own distribution at this step (before temperature and truncation, as OpenAI reports it)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logprobs, top) if top else None
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]),
                        top_ids=best.indices.tolist() if best is not None else [],
                        top_logprobs=best.values.tolist() if best is not None else [])


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits: [V] float32 on any device."""
    if params.temperature == 0 or gen is None:
        return int(torch.argmax(logits))
    logits = logits.float().cpu() / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))
