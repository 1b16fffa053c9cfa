"""An MLPerf Inference LoadGen harness, Server scenario, against an OpenAI-compatible /v1/completions.

    python mlperf_server.py --url http://HOST:PORT --model NAME [--qps 20] [--seconds 25] [--isl 64] [--osl 16]

Runs in a virtualenv that has `mlcommons-loadgen` (benchmarks/peer_clients.py makes it) and needs nothing else: the
standard library's HTTP client streams each query, FirstTokenComplete at its first token and QuerySamplesComplete
at its last, so LoadGen judges TTFT and TPOT at their 99th percentiles as the MLPerf LLM benchmarks do. Prints one
JSON object: LoadGen's verdict and figures from mlperf_log_summary.txt, and the HTTP errors seen (exit 1 if any).
"""

from __future__ import annotations

import argparse
import array
import http.client
import json
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import mlperf_loadgen as lg

SUMMARY_FIGURES = {  # mlperf_log_summary.txt line -> this harness's key
    "Completed samples per second": "samples_per_s", "Completed tokens per second": "tokens_per_s",
    "Scheduled samples per second": "scheduled_per_s", "99.00 percentile first token latency (ns)": "ttft_p99_ns",
    "99.00 percentile time to output token (ns)": "tpot_p99_ns", "99.00 percentile latency (ns)": "latency_p99_ns",
}


class Client:
    """One streamed completion per query; `errors` counts the HTTP failures (their first line kept)."""

    def __init__(self, url: str, model: str, osl: int) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.model, self.osl = parts.hostname or "127.0.0.1", parts.port or 80, model, osl
        self.errors: list[str] = []
        self.local = threading.local()
        self.lock = threading.Lock()

    def _connection(self) -> http.client.HTTPConnection:
        if getattr(self.local, "conn", None) is None:
            self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        return self.local.conn

    def run(self, query_id: int, prompt: list[int]) -> None:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": self.osl, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        tokens, first = 0, False
        keep = []  # the response buffers, alive until LoadGen has read them
        try:
            conn = self._connection()
            conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:200]!r}")
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"stream error: {event['error']}")
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event.get("choices") and not first:
                    first = True
                    keep.append(array.array("B", event["choices"][0].get("text", "").encode() or b" "))
                    address, size = keep[-1].buffer_info()
                    lg.FirstTokenComplete([lg.QuerySampleResponse(query_id, address, size)])
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported, the query still completes
            self.local.conn = None
            with self.lock:
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
        keep.append(array.array("B", b"done"))
        address, size = keep[-1].buffer_info()
        lg.QuerySamplesComplete([lg.QuerySampleResponse(query_id, address, size, max(tokens, 1))])


def settings(args: argparse.Namespace) -> lg.TestSettings:
    s = lg.TestSettings()
    s.scenario = lg.TestScenario.Server
    s.mode = lg.TestMode.PerformanceOnly
    s.server_target_qps = args.qps
    s.min_duration_ms = int(args.seconds * 1000)
    s.min_query_count = int(args.qps * args.seconds)
    s.use_token_latencies = True
    s.ttft_latency = int(args.ttft_ms * 1e6)
    s.tpot_latency = int(args.tpot_ms * 1e6)
    return s


def summary(path: Path) -> dict:
    figures: dict = {}
    if os.environ.get("MLPERF_DEBUG"):
        print(path.read_text(), file=sys.stderr)
    for line in path.read_text().splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "Result is":
            figures["result"] = value
        elif line.startswith(" * "):  # why a result is INVALID, as LoadGen says it
            figures.setdefault("notes", []).append(line[3:].strip())
        elif key in SUMMARY_FIGURES:
            figures[SUMMARY_FIGURES[key]] = float(value)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--qps", type=float, default=20.0)
    parser.add_argument("--seconds", type=float, default=25.0)  # early stopping wants ~460 queries
    parser.add_argument("--isl", type=int, default=64)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--ttft-ms", type=float, default=2000.0)
    parser.add_argument("--tpot-ms", type=float, default=200.0)
    parser.add_argument("--vocab", type=int, default=250, help="prompt token ids are drawn below this")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(10, args.vocab) for _ in range(args.isl)] for _ in range(256)]
    client = Client(args.url, args.model, args.osl)
    pool = ThreadPoolExecutor(max_workers=64)

    def issue(samples):
        for sample in samples:
            pool.submit(client.run, sample.id, prompts[sample.index])

    sut = lg.ConstructSUT(issue, lambda: None)
    qsl = lg.ConstructQSL(len(prompts), len(prompts), lambda _: None, lambda _: None)
    with tempfile.TemporaryDirectory(prefix="mlperf-") as out:
        log = lg.LogSettings()
        log.log_output.outdir = out
        log.log_output.copy_summary_to_stdout = False
        started = time.perf_counter()
        lg.StartTestWithLogSettings(sut, qsl, settings(args), log)
        pool.shutdown(wait=True)
        figures = summary(Path(out) / "mlperf_log_summary.txt")
    lg.DestroyQSL(qsl)
    lg.DestroySUT(sut)
    figures.update(seconds=round(time.perf_counter() - started, 1), target_qps=args.qps, http_errors=len(client.errors),
                   first_errors=client.errors[:3])
    print(json.dumps(figures))
    return 1 if client.errors else 0


if __name__ == "__main__":
    sys.exit(main())
