"""Async load generation against an OpenAI-compatible server: TTFT, ITL, latency, throughput, validity.

A level is one (concurrency, input length, output length) point. A result is invalid when no tokens came
back, more than 5 % of requests failed, fewer requests completed than were asked for, or (closed loop) the
level never had `concurrency` requests in flight at once — a "c=64" level of 16 requests measures c=16.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Awaitable, Callable

from hpc.net.httpclient import Pool


@functools.cache
def _event_decoder() -> Callable[[bytes], Any]:
    """JSON decoding of each streamed event: msgspec's where installed (the serve extra brings it; 1.2 µs an event
    against json's 5.4 on a 2-CPU VM, a fifth of the load generator's CPU a token), else the standard library's.
    Both raise a ValueError on bad JSON (msgspec.DecodeError is one)."""
    try:
        import msgspec
    except ImportError:
        return json.loads
    return msgspec.json.Decoder().decode

MAX_FAILURE_RATE = 0.05
REQUESTS_PER_USER = 4  # the default floor: requests per level >= 4 x concurrency


@dataclass(frozen=True)
class Level:
    concurrency: int
    input_tokens: int
    output_tokens: int
    requests: int
    rate: float | None = None  # requests/s (Poisson arrivals) instead of a closed loop
    # sent with every request: SLA targets (extra_args) and an agent priority (nvext) for a global router
    ttft_target_ms: float | None = None
    itl_target_ms: float | None = None
    priority: int | None = None
    # every request sends the same prompt: with prefix reuse only its last block is computed again, so a
    # decode-only profile measures decode (what the profiler's decode -> aggregated conversion enables reuse for)
    same_prompt: bool = False
    # each request's max_tokens drawn from output_tokens +- output_spread (uniform): requests end in different
    # steps, as real traffic does, instead of a closed loop of equal requests finishing (and returning) in waves
    output_spread: int = 0

    def max_tokens(self, rng: random.Random) -> int:
        spread = min(self.output_spread, self.output_tokens - 1)
        return self.output_tokens + rng.randint(-spread, spread) if spread > 0 else self.output_tokens

    def routing_fields(self) -> dict[str, Any]:
        targets = {k: v for k, v in (("ttft_target", self.ttft_target_ms), ("itl_target", self.itl_target_ms))
                   if v is not None}
        fields: dict[str, Any] = {"extra_args": targets} if targets else {}
        if self.priority is not None:
            fields["nvext"] = {"agent_hints": {"priority": self.priority}}
        return fields


@dataclass
class Sample:
    ok: bool
    e2e: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between streamed events (each may carry several tokens)
    decode_s: float | None = None  # first streamed token to the last
    tokens: int = 0
    error: str = ""


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": sum(v) / len(v)}


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 3000) for _ in range(n)]


class _Events:
    """A streamed response's SSE events into its sample, parsed as the bytes arrive (in the connection's callback):
    the first token's time, the gaps between token events, the usage's count, an error event."""

    def __init__(self, sample: Sample, t0: float, decode: Callable[[bytes], Any] = json.loads) -> None:
        self.sample, self.t0, self.decode = sample, t0, decode
        self.buffer = b""
        self.last: float | None = None

    def feed(self, piece: bytes) -> None:
        buffer = self.buffer + piece if self.buffer else piece
        if b"\n\n" not in buffer:
            self.buffer = buffer
            return
        *events, self.buffer = buffer.split(b"\n\n")
        now = time.perf_counter()
        sample = self.sample
        later = 0  # text events after the first token in this read
        for event in events:
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            data = self.decode(event[6:])
            if "error" in data:
                sample.error = data["error"].get("message", "error event")
                continue
            if data.get("usage"):
                sample.tokens = int(data["usage"]["completion_tokens"])
            if data.get("choices") and data["choices"][0].get("text"):
                if sample.ttft is None:
                    sample.ttft = now - self.t0
                    self.last = now
                else:
                    later += 1
        if later:
            # the events of one read share its time: the gap since the last read, spread over them (the same
            # instant for each gave ITL 0.0 wherever several events came in one read, as at c=1)
            share = (now - (self.last if self.last is not None else now)) / later  # set with the first token
            sample.itls.extend([share] * later)
        if later or (sample.ttft is not None and self.last is None):
            self.last = now


async def one_request(pool: Pool, model: str, level: Level, streaming: bool, rng: random.Random) -> Sample:
    prompt = prompt_ids(level.input_tokens, random.Random(level.input_tokens) if level.same_prompt else rng)
    body = {"model": model, "prompt": prompt, "max_tokens": level.max_tokens(rng),
            "ignore_eos": True, "stream": streaming, **level.routing_fields()}
    if streaming:
        body["stream_options"] = {"include_usage": True}
    conn = pool.take()
    t0 = time.perf_counter()
    sample = Sample(ok=False)
    try:
        if not streaming:
            status, raw = await conn.request("POST", "/v1/completions", json.dumps(body).encode())
            data = json.loads(raw)
            if status != 200:
                sample.error = data.get("error", {}).get("message", f"HTTP {status}")
            else:
                sample.tokens = int(data["usage"]["completion_tokens"])
                sample.ok = True
                sample.ttft = time.perf_counter() - t0
        else:
            events = _Events(sample, t0, _event_decoder())
            status = await conn.stream("POST", "/v1/completions", json.dumps(body).encode(), events.feed)
            if sample.ttft is not None and events.last is not None:
                sample.decode_s = events.last - t0 - sample.ttft
            if status != 200 and not sample.error:
                try:
                    sample.error = json.loads(events.buffer)["error"]["message"]
                except (ValueError, KeyError):
                    sample.error = f"HTTP {status}"
            sample.ok = status == 200 and not sample.error
        pool.give(conn, True)
    except (OSError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"
        pool.give(conn, False)
    sample.e2e = time.perf_counter() - t0
    return sample


async def collect(url: str, model: str, level: Level, streaming: bool, warmup: int,
                  progress: Callable[[int, int], None] = lambda done, total: None, seed: int | str = 0,
                  ready: Callable[[], Awaitable[None]] | None = None) -> tuple[list[Sample], float, float, int]:
    """(samples, start, end, peak in flight) of one level from this process; `ready` is awaited after the warm-up
    requests, before the clock starts (client processes start together)."""
    pool = Pool(url)
    rng = random.Random(seed)
    for _ in range(warmup):
        await one_request(pool, model, level, streaming, rng)
    if ready is not None:
        await ready()
    samples: list[Sample] = []
    queue = list(range(level.requests))
    inflight = {"now": 0, "peak": 0}
    t0 = time.perf_counter()

    async def user() -> None:
        while queue:
            queue.pop()
            inflight["now"] += 1
            inflight["peak"] = max(inflight["peak"], inflight["now"])
            try:
                samples.append(await one_request(pool, model, level, streaming, rng))
            finally:
                inflight["now"] -= 1
            progress(len(samples), level.requests)

    if level.rate:
        tasks = []
        for _ in range(level.requests):
            tasks.append(asyncio.create_task(one_request(pool, model, level, streaming, rng)))
            await asyncio.sleep(rng.expovariate(level.rate))
        for task in asyncio.as_completed(tasks):
            samples.append(await task)
            progress(len(samples), level.requests)
    else:
        await asyncio.gather(*[user() for _ in range(level.concurrency)])
    t1 = time.perf_counter()
    pool.close()
    return samples, t0, t1, inflight["peak"]


def summarize(level: Level, samples: list[Sample], wall: float, peak_inflight: int | None = None) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    tokens = sum(s.tokens for s in ok)
    failures = len(samples) - len(ok)
    failure_rate = failures / len(samples) if samples else 1.0
    reasons = []
    if tokens == 0:
        reasons.append("no output tokens")
    if failure_rate > MAX_FAILURE_RATE:
        reasons.append(f"{failure_rate:.0%} of requests failed (limit {MAX_FAILURE_RATE:.0%})")
    if len(ok) < level.requests:
        reasons.append(f"{len(ok)} of {level.requests} requests completed")
    if peak_inflight is not None and peak_inflight < level.concurrency:
        reasons.append(f"never had {level.concurrency} requests in flight (peak {peak_inflight}): "
                       f"send at least {REQUESTS_PER_USER * level.concurrency} requests")
    errors = sorted({s.error for s in samples if s.error})[:5]
    return {
        **asdict(level), "completed": len(ok), "failed": failures, "failure_rate": failure_rate,
        "output_tokens_total": tokens, "output_tokens_per_request": tokens / len(ok) if ok else 0.0,
        "peak_inflight": peak_inflight, "duration_s": wall, "output_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "ttft_s": percentiles([s.ttft for s in ok if s.ttft is not None]),
        "itl_s": percentiles([x for s in ok for x in s.itls]),
        # time per output token after the first, per request (AIPerf's inter-token latency): right however many
        # tokens an event carries (stream_interval > 1, TensorRT-LLM's multi-token outputs), where the gaps are not
        "tpot_s": percentiles([s.decode_s / (s.tokens - 1) for s in ok if s.decode_s is not None and s.tokens > 1]),
        "e2e_s": percentiles([s.e2e for s in ok]),
        "valid": not reasons, "invalid_reasons": reasons, "errors": errors,
        # the first requests to complete (at c=1, the first sent): what a fresh launch makes its first users pay
        "first_requests": [{"ttft_s": s.ttft, "e2e_s": s.e2e} for s in samples[:3]],
    }


def bar(label: str, stream: Any = None) -> Callable[[int, int], None]:
    """A level's progress on stderr: a bar redrawn in place on a terminal; elsewhere (a log, a pipe, a Slurm
    job's output) one line when the level ends, not a redrawn line per request."""
    stream = stream or sys.stderr
    redraw = stream.isatty()

    def show(done: int, total: int) -> None:
        if not redraw:
            if done >= total:
                stream.write(f"{label}: {done}/{total} requests\n")
                stream.flush()
            return
        width = 30
        filled = int(width * done / max(total, 1))
        stream.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        if done >= total:
            stream.write("\n")
        stream.flush()
    return show
