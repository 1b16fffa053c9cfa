"""A request's state while the torch engine's scheduler holds it, and which waiting prompts share a prefill step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from hpc.runtime.engine.types import GenerateOutput, GenerateRequest, TokenLogprob


@dataclass
class Seq:
    request: GenerateRequest
    emit: Callable[[GenerateOutput], None]
    slot: int = -1
    length: int = 0  # tokens in the KV cache
    last_token: int = -1
    generated: int = 0
    gen: Any = None
    cancelled: bool = False
    imported_kv: torch.Tensor | None = None
    media: torch.Tensor | None = None
    started: float = field(default_factory=time.perf_counter)
    counts: dict[int, int] = field(default_factory=dict)  # generated token -> times (for the penalties)
    guide: Any = None  # (automaton, state) while the request's output is constrained (sampling.guide)
    cached: int = 0  # prompt tokens taken from the prefix cache
    prompt_lp: list[TokenLogprob] | None = None  # the prompt's logprobs, sent with the first output


def prefill_groups(seqs: list[Seq], budget: int, pipeline: bool) -> Iterator[list[Seq]]:
    """Prompts prefilled in one forward pass, their padded tokens within `budget`. Alone: a prompt with media or
    asking for the prompt's logprobs, and every prompt of a pipeline (only its last stage holds the logits' rows)."""
    group: list[Seq] = []
    width = 0
    for seq in seqs:
        alone = seq.media is not None or seq.request.sampling.prompt_logprobs is not None or pipeline
        n = len(seq.request.token_ids)
        if group and (alone or max(width, n) * (len(group) + 1) > budget):
            yield group
            group, width = [], 0
        if alone:
            yield [seq]
            continue
        group.append(seq)
        width = max(width, n)
    if group:
        yield group
