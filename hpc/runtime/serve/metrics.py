"""Prometheus text exposition for workers and the frontend."""

from __future__ import annotations

import bisect
import time


# Monotonic counts whose names predate the _total convention (benchmarks and docs read them by these names).
COUNTERS = frozenset({
    "requests", "prompt_tokens", "generated_tokens", "prompt_tokens_cached", "prompt_tokens_computed",
    "prefill_steps", "prefill_steps_graphed", "prefill_chunks", "decode_steps", "decode_steps_graphed",
    "decode_steps_overlapped", "decode_steps_picked_in_graph", "decode_steps_carried_in_graph",
    "decode_rows_joined_in_flight", "first_tokens", "first_tokens_left_on_device", "kv_events", "kv_ipc_shared", "kv_ipc_opened", "aborted", "stats_records",
    "cuda_malloc_segments", "prefix_blocks_hit", "prefix_blocks_looked_up", "prefix_copies_graphed",
    "requests_streamed_direct", "kv_shared_with_answer", "kv_taken_from_answer", "kv_lent_nixl", "kv_ipc_copy_batches",
})


def metric_kind(name: str) -> str:
    """Prometheus' type of one of our values: a counter only goes up (rate() applies), a gauge is a level."""
    return "counter" if name.endswith("_total") or name in COUNTERS or name.startswith("kv_fetched_") else "gauge"


def _escape(value: str) -> str:
    """A label value in the exposition format: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _label_set(labels: dict[str, str]) -> str:
    """'{k="v",...}': labels sorted by name (as prometheus-client writes them), values escaped."""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(labels.items())) + "}"


def prometheus(prefix: str, values: dict[str, float], labels: dict[str, str]) -> bytes:
    label = _label_set(labels)
    lines = []
    for name, value in sorted(values.items()):
        if not isinstance(value, (int, float)):
            continue
        metric = f"{prefix}_{name}"
        kind = metric_kind(name)
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric}{label} {value}")
    return ("\n".join(lines) + "\n").encode()


def prometheus_family(metric: str, samples: list[tuple[dict[str, str], float]]) -> bytes:
    """One metric over several label sets (its TYPE line once, as the exposition format wants)."""
    if not samples:
        return b""
    kind = "counter" if metric.endswith("_total") else "gauge"
    lines = [f"# TYPE {metric} {kind}"]
    for labels, value in samples:
        lines.append(f"{metric}{_label_set(labels)} {value}")
    return ("\n".join(lines) + "\n").encode()


# Seconds; dense where interactive serving lives (ms ITLs, sub-second TTFTs), sparse up to minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5,
                   5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))


class Histogram:
    """One Prometheus histogram of seconds over LATENCY_BUCKETS: an observation is a bisect and two additions, no
    lock (one event loop observes it). prometheus-client's took 2-3 µs a token in the frontend (a lock per bucket
    count and per sum, 14-18 % of the frontend's CPU a streamed token with its generator layer)."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self.bounds = LATENCY_BUCKETS[:-1]  # the last bucket, +Inf, takes what passes them all
        self.counts = [0] * len(LATENCY_BUCKETS)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1  # bucket `le` counts what is <= le
        self.sum += seconds

    def exposition(self, labels: dict[str, str]) -> list[str]:
        """Its lines as prometheus-client writes them: cumulative buckets, then count and sum; labels sorted."""
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip(LATENCY_BUCKETS, self.counts):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f"{self.name}_bucket{_label_set({**labels, 'le': le})} {float(total)!r}")
        return lines + [f"{self.name}_count{_label_set(labels)} {float(total)!r}",
                        f"{self.name}_sum{_label_set(labels)} {self.sum!r}"]


class RequestClock:
    """One request's latencies as its outputs go by (LatencyHistograms.start): `tokens(n)` for each output that
    carries n tokens, `end()` once it is over."""

    __slots__ = ("histograms", "start", "last", "first")

    def __init__(self, histograms: "LatencyHistograms") -> None:
        self.histograms = histograms
        self.start = self.last = time.perf_counter()
        self.first = True

    def tokens(self, n: int) -> None:
        now = time.perf_counter()
        if self.first:
            self.histograms.ttft.observe(now - self.start)
            self.first = False
        else:
            self.histograms.itl.observe((now - self.last) / n)
        self.last = now

    def end(self) -> None:
        if not self.first:  # a request that never produced a token has no duration to report
            self.histograms.e2e.observe(time.perf_counter() - self.start)


class LatencyHistograms:
    """TTFT, inter-token latency and end-to-end request time as Prometheus histograms."""

    def __init__(self, prefix: str, labels: dict[str, str]) -> None:
        self.labels = labels
        self.ttft = Histogram(f"{prefix}_time_to_first_token_seconds", "request start to its first token")
        self.itl = Histogram(f"{prefix}_inter_token_latency_seconds", "time between tokens after the first (per token)")
        self.e2e = Histogram(f"{prefix}_request_duration_seconds", "request start to its last token")

    def start(self) -> RequestClock:
        """A request's clock, started now: its caller times the outputs as they go by, in its own loop (a
        generator wrapped around the outputs cost a resumption a token)."""
        return RequestClock(self)

    def exposition(self) -> bytes:
        lines = [line for h in (self.ttft, self.itl, self.e2e) for line in h.exposition(self.labels)]
        return ("\n".join(lines) + "\n").encode()
