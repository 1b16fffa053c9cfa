"""One large request must not slow down the others: while prompts as large as the frontend takes arrive, a small
completion's latency and /live's are measured, against the same without them.

    python benchmarks/large_body.py [--mb 8] [--limit-tokens 131072] [--seconds 6]

The large prompts are plain text of MB megabytes (chat messages and completions prompts, one after another). With
`--limit-tokens` large enough that the characters could fit (a long-context model's limit), they are tokenized in
full before the token limit refuses them: that is the path that used to hold the event loop. Prints a short
table: p50/p99/max of /live and of a 4-token completion, quiet and under the large prompts, and what the large
prompts got back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request
from pathlib import Path
import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _stack import local_stack  # noqa: E402


def _post(url: str, body: bytes, timeout: float = 300.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=60) as response:
        response.read()
        return response.status


def _probe(url: str, model: str, seconds: float) -> dict[str, list[float]]:
    small = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
    times: dict[str, list[float]] = {"live": [], "small": []}
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        _get(url + "/live")
        times["live"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        status, _ = _post(url + "/v1/completions", small)
        assert status == 200, status
        times["small"].append(time.perf_counter() - t0)
        time.sleep(0.01)
    return times


def _flood(url: str, model: str, mb: float, stop: threading.Event, answers: list[str]) -> None:
    text = ("the quick brown fox jumps over the lazy dog " * int(mb * 1024 * 1024 / 44 + 1))[: int(mb * 1024 * 1024)]
    bodies = [json.dumps({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 4}),
              json.dumps({"model": model, "prompt": text, "max_tokens": 4})]
    routes = ["/v1/chat/completions", "/v1/completions"]
    i = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        status, raw = _post(url + routes[i % 2], bodies[i % 2].encode())
        message = json.loads(raw).get("error", {}).get("message", "")[:70] if status != 200 else "ok"
        answers.append(f"{status} in {time.perf_counter() - t0:.2f} s: {message}")
        i += 1


def _row(name: str, values: list[float]) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (f"{name:<26} {len(values):>5} {statistics.median(values) * 1000:>8.1f} {p99 * 1000:>8.1f} "
            f"{ordered[-1] * 1000:>8.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="size of each large prompt, MB of text")
    parser.add_argument("--limit-tokens", type=int, default=131072, help="the recipe's limits.max_input_tokens")
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    with local_stack("tiny-agg", f"limits.max_input_tokens={args.limit_tokens}",
                     "roles.agg.override_engine_args.enable_chunked_prefill=true") as (run, url):
        model = run.manifest().recipe.model.served_name
        quiet = _probe(url, model, args.seconds)
        stop, answers = threading.Event(), []
        flood = threading.Thread(target=_flood, args=(url, model, args.mb, stop, answers), daemon=True)
        flood.start()
        time.sleep(0.5)
        loaded = _probe(url, model, args.seconds)
        stop.set()
        flood.join(300)
    print(f"{'':<26} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, times in (("quiet", quiet), (f"beside {args.mb:g} MB prompts", loaded)):
        print(_row(f"/live, {name}", times["live"]))
        print(_row(f"completion, {name}", times["small"]))
    print(f"large prompts sent: {len(answers)}; first answer: {answers[0] if answers else '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
