"""Token sampling: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import random
import threading
from typing import Any

import torch

from hpc.runtime.engine.host_wait import finish
from hpc.runtime.engine.types import SamplingParams, TokenLogprob


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    gen = torch.Generator()
    # not torch.seed(): it reseeds every device type, and on a build with XPU queues a lazy call that captures a
    # stack trace each time (a sixth of a worker's GIL time under load)
    gen.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return gen


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The model's own distribution at this step (before temperature and truncation, as OpenAI reports it)."""
    return prompt_logprobs(logits[None], [token], top)[0]


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's logprob under its row of logits [N, V] (a prompt: each position's logits score the next
    token), with the `top` most likely of each row."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    best = torch.topk(logprobs, top, dim=-1) if top else None
    return [TokenLogprob(token_id=t, logprob=lp, top_ids=best.indices[i].tolist() if best is not None else [],
                         top_logprobs=best.values[i].tolist() if best is not None else [])
            for i, (t, lp) in enumerate(zip(tokens, chosen))]


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """logits: [V] float32 on any device; one request with its own (seeded) CPU generator."""
    if params.temperature == 0 or gen is None:
        return int(torch.argmax(logits))
    return int(sample_rows(logits[None].float().cpu(), [params], gen)[0])


def on_device(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list on the device without waiting for the device: from pageable memory a copy first waits
    for the stream's queued work, which an overlapped step must not (a pinned copy is queued behind it)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return pinned_copy(host, device)


class _PinnedRing:
    """Pinned host buffers used in turn for small host-to-device copies, each written again only once the copy
    that last read it is done (its event): a pin_memory() per copy went through the caching host allocator, some
    0.3 ms a call under load on an H200 (a fifth of the prefill engine thread's wall time, py-spy)."""

    SLOTS, SLOT_BYTES = 32, 1 << 19  # a prefill graph's staged inputs: 5 x 8,192 tokens x 8 bytes
    made_by: list[str] = []  # the threads that made one, in order (tests)

    def __init__(self) -> None:
        self.made_by.append(threading.current_thread().name)
        self.buffers = [torch.empty(self.SLOT_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(self.SLOTS)]
        self.events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self.turn = 0

    def copy(self, host: torch.Tensor, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
        size = host.numel() * host.element_size()
        if size > self.SLOT_BYTES:
            pinned = host.pin_memory()
            return pinned.to(device, non_blocking=True) if into is None else into.copy_(pinned, non_blocking=True)
        i, self.turn = self.turn, (self.turn + 1) % self.SLOTS
        done = self.events[i]
        if done is None:
            done = self.events[i] = torch.cuda.Event()
        else:
            finish(done)  # long done, mostly: the ring comes round after dozens of copies
        staged = self.buffers[i][:size].view(host.dtype).view(host.shape)
        staged.copy_(host)
        out = staged.to(device, non_blocking=True) if into is None else into.copy_(staged, non_blocking=True)
        done.record(torch.cuda.current_stream(device))
        return out


_rings = threading.local()  # one ring per thread: each engine's scheduler stages its own copies


def pinned_copy(host: torch.Tensor, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
    """`host` (a small CPU tensor) on `device` through pinned memory, queued on the device's current stream: a new
    tensor, or written into `into` (a tensor of its shape on that device)."""
    return prepare_pinned_copies().copy(host, device, into)


def stage_into(host: torch.Tensor, into: torch.Tensor) -> None:
    """A static input buffer of a graph (`into`, on any device) filled from a host tensor of its shape: through
    pinned memory on a GPU (from pageable memory the copy would first wait for the step in flight)."""
    if into.is_cuda:
        pinned_copy(host, into.device, into=into)
    else:
        into.copy_(host)


def prepare_pinned_copies() -> _PinnedRing:
    """This thread's ring, made now if it is not yet (16 MB of pinned memory: a scheduler thread makes it as it
    starts, not in its first request)."""
    ring = getattr(_rings, "ring", None)
    if ring is None:
        ring = _rings.ring = _PinnedRing()
    return ring


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of logits [N, V] (temperature > 0), each row with its own temperature, top-k and
    top-p, in a few batched kernels on the logits' device: a decode step of 64 sampled rows costs one sync,
    not 64 host round trips."""
    temperatures = {p.temperature for p in params}
    # one temperature for every row (the usual case): a scalar, not a tensor staged and copied to the device each
    # step (6-11 % of the decode engine thread's wall time at c=64 on an H200, py-spy)
    rows = logits.float() / (next(iter(temperatures)) if len(temperatures) == 1 else
                             on_device([p.temperature for p in params], logits.device)[:, None])
    top_k = [p.top_k or rows.shape[-1] for p in params]
    top_p = [p.top_p for p in params]
    if max(top_p) < 1.0 or min(top_k) < rows.shape[-1]:
        rows = rows.masked_fill(~keep_mask(rows, top_k, top_p), float("-inf"))
    return draw(torch.softmax(rows, dim=-1), gen)


def pick_in_graph(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Each row's token inside a decode graph: drawn at its temperature (sample_rows without top-k/top-p), greedy
    where that is 0. Draws come from the device's default generator, the one a graph's replay advances."""
    tempered = logits.float() / temperatures.clamp_min(1e-6)[:, None]
    probs = torch.softmax(tempered, dim=-1)
    if logits.device.type != "cuda":
        return torch.where(temperatures > 0, draw(probs, None), logits.argmax(dim=-1))
    # one argmax for all rows, over a sampled row's race (draw's) and a greedy row's logits: an argmax over
    # [rows, V] took 15 µs of a 64-row step's 154 on an H200 (benchmarks/decode_graph_kernels.py), and there were two
    return torch.where(temperatures[:, None] > 0, _race(probs, None), logits.float()).argmax(dim=-1)


def graph_temperature(p: SamplingParams, vocab: int) -> float | None:
    """A row's temperature when pick_in_graph draws what sample_rows would (no top-k, no top-p), else None."""
    return None if (p.top_k and p.top_k < vocab) or p.top_p < 1.0 else p.temperature


def graph_temperatures(seqs: list[Any]) -> list[float] | None:
    """The rows' temperatures (Seq.graph_temperature) when a decode graph can pick every row's token, else None."""
    temperatures = [seq.graph_temperature for seq in seqs]
    return None if None in temperatures else temperatures


def draw(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One token per row of probabilities [N, V] (rows need not sum to 1).

    On a GPU: argmax of p / q with q ~ Exp(1), the same kernels and random stream as torch.multinomial(probs, 1)'s
    fast path (aten/src/ATen/native/Distributions.cpp multinomial_out) without the checks it runs first — a
    min/max/sum validity test that releases the host only once the step before it is done on the device
    (`.item()` in older builds, an async assert and four more kernels in newer ones), so an overlapped decode step
    could not run ahead of the device; and it runs inside a captured graph. On the CPU the V exponentials of each
    row cost more than the tiny model's whole decode step (3 ms for 16 rows of 8,192 tokens, against 0.06 ms for
    this): there, one uniform per row finds its token in the row's cumulative sum, the first whose sum passes
    it — never a token of probability 0 (its sum equals the one before it; a uniform in [0, 1), at most 1 - 2^-24,
    times the total rounds below the total)."""
    if probs.device.type == "cuda":
        return _race(probs, gen).argmax(dim=-1)
    cumulative = probs.float().cumsum(dim=-1)
    target = torch.rand(probs.shape[0], 1, generator=gen) * cumulative[:, -1:]
    return torch.searchsorted(cumulative, target, right=True)[:, 0]


def _race(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """p / q with q ~ Exp(1), in place: each row's argmax is a draw from its probabilities (draw, on a GPU)."""
    return probs.div_(torch.empty_like(probs).exponential_(generator=gen))


def keep_mask(rows: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Which tokens each row's top-k, then nucleus (the smallest prefix whose mass reaches top_p, its first token
    always) keeps: rows [N, V] of tempered logits -> bool [N, V]."""
    ordered, order = rows.sort(dim=-1, descending=True)
    rank = torch.arange(rows.shape[-1], device=rows.device)[None]
    keep = rank < on_device(top_k, rows.device)[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    keep &= probs.cumsum(-1) - probs < on_device(top_p, rows.device)[:, None]
    return torch.zeros_like(keep).scatter(1, order, keep)


def guided_order(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> list[int]:
    """The order a guided step tries tokens in. Greedy: by logit. Sampled: by logit / temperature plus Gumbel
    noise (which draws from the softmax restricted to whatever tokens the guide allows), the tokens top-k /
    top-p keep before the others."""
    scores = logits.float().cpu()
    if params.temperature == 0:
        return torch.argsort(scores, descending=True).tolist()
    tempered = scores / params.temperature
    uniform = torch.rand(scores.shape, generator=gen).clamp_(1e-20, 1.0)
    noisy = tempered - torch.log(-torch.log(uniform))
    kept = keep_mask(tempered[None], [params.top_k or len(scores)], [params.top_p])[0]
    return torch.cat([idx[torch.argsort(noisy[idx], descending=True)]
                      for idx in (kept.nonzero()[:, 0], (~kept).nonzero()[:, 0])]).tolist()
