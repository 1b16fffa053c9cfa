"""Prometheus text exposition for workers and the frontend."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator


# Monotonic counts whose names predate the _total convention (benchmarks and docs read them by these names).
COUNTERS = frozenset({
    "requests", "prompt_tokens", "generated_tokens", "prompt_tokens_cached", "prompt_tokens_computed",
    "prefill_steps", "prefill_steps_graphed", "prefill_chunks", "decode_steps", "decode_steps_graphed",
    "decode_steps_overlapped", "decode_steps_picked_in_graph", "decode_rows_joined_in_flight", "first_tokens",
    "first_tokens_left_on_device", "kv_events", "kv_ipc_shared", "kv_ipc_opened", "aborted", "stats_records",
    "cuda_malloc_segments", "prefix_blocks_hit", "prefix_blocks_looked_up", "prefix_copies_graphed",
    "requests_streamed_direct", "kv_shared_with_answer", "kv_taken_from_answer", "kv_lent_nixl", "kv_ipc_copy_batches",
})


def metric_kind(name: str) -> str:
    """Prometheus' type of one of our values: a counter only goes up (rate() applies), a gauge is a level."""
    return "counter" if name.endswith("_total") or name in COUNTERS or name.startswith("kv_fetched_") else "gauge"


def prometheus(prefix: str, values: dict[str, float], labels: dict[str, str]) -> bytes:
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    lines = []
    for name, value in sorted(values.items()):
        if not isinstance(value, (int, float)):
            continue
        metric = f"{prefix}_{name}"
        kind = metric_kind(name)
        lines.append(f"# TYPE {metric} {kind}")
        lines.append(f"{metric}{{{label}}} {value}")
    return ("\n".join(lines) + "\n").encode()


def prometheus_family(metric: str, samples: list[tuple[dict[str, str], float]]) -> bytes:
    """One metric over several label sets (its TYPE line once, as the exposition format wants)."""
    if not samples:
        return b""
    kind = "counter" if metric.endswith("_total") else "gauge"
    lines = [f"# TYPE {metric} {kind}"]
    for labels, value in samples:
        lines.append(metric + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} " + str(value))
    return ("\n".join(lines) + "\n").encode()


# Seconds; dense where interactive serving lives (ms ITLs, sub-second TTFTs), sparse up to minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5,
                   5.0, 10.0, 30.0, 60.0, 120.0, float("inf"))


class LatencyHistograms:
    """TTFT, inter-token latency and end-to-end request time as Prometheus histograms (prometheus-client)."""

    def __init__(self, prefix: str, labels: dict[str, str]) -> None:
        from prometheus_client import CollectorRegistry, Histogram

        self.registry = CollectorRegistry()
        names = sorted(labels)

        def histogram(name: str, doc: str):
            return Histogram(f"{prefix}_{name}", doc, names, buckets=LATENCY_BUCKETS,
                             registry=self.registry).labels(**labels)

        self.ttft = histogram("time_to_first_token_seconds", "request start to its first token")
        self.itl = histogram("inter_token_latency_seconds", "time between tokens after the first (per token)")
        self.e2e = histogram("request_duration_seconds", "request start to its last token")

    async def track(self, outputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        """Pass `outputs` (each with .token_ids) through, timing the tokens as they go by."""
        start = last = time.perf_counter()
        first = True
        try:
            async for out in outputs:
                now = time.perf_counter()
                if out.token_ids:
                    if first:
                        self.ttft.observe(now - start)
                        first = False
                    else:
                        self.itl.observe((now - last) / len(out.token_ids))
                    last = now
                yield out
        finally:
            if not first:
                self.e2e.observe(time.perf_counter() - start)

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
