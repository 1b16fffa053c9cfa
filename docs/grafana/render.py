"""Draw docs/grafana/hpc-run.png: the dashboard's panels, their queries evaluated by a real Prometheus over a real run.

    python docs/grafana/render.py [--recipe tiny-disagg] [--seconds 150] [--prometheus prometheus] [--set K=V]

Grafana cannot run here, so this draws the dashboard (docs/grafana/hpc-run.json) itself: it starts the recipe's
stack on this machine, a Prometheus (`apt install prometheus`) that finds the run through the run directory's own
`prometheus-targets.json` (file SD, as docs/guide/operations.md sets it up), puts load on the stack with `hpc
bench`'s client (Poisson arrivals at rising rates, every other step one prompt again and again), then asks Prometheus' query_range API for every target of every panel, with
`$run` set to the run, and draws each panel at its gridPos with its legend. A query that returns nothing is drawn
as "no data", as Grafana would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks"))


def start_prometheus(binary: str, targets: Path, workdir: Path, port: int) -> subprocess.Popen:
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps({"global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
                                  "scrape_configs": [{"job_name": "hpc", "file_sd_configs": [
                                      {"files": [str(targets)], "refresh_interval": "5s"}]}]}))
    return subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(workdir / "prometheus.log", "w"))


def query_range(port: int, expr: str, start: float, end: float, step: float) -> list[dict]:
    query = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/query_range?{query}", timeout=30) as resp:
        body = json.loads(resp.read())
    if body.get("status") != "success":
        raise SystemExit(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def up_targets(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/targets", timeout=10) as resp:
        active = json.loads(resp.read())["data"]["activeTargets"]
    return sum(1 for t in active if t["health"] == "up")


def load(url: str, seconds: float) -> None:
    """hpc bench's client in four steps of Poisson arrivals, `seconds` in all: rising rates, every other step
    sending one prompt again and again (the KV-aware router's hits) and the others fresh ones."""
    from hpc.bench.clients import run_level
    from hpc.bench.loadgen import Level

    steps = [(4, False), (8, True), (16, False), (16, True)]
    for rate, same in steps:
        requests = int(rate * seconds / len(steps))
        asyncio.run(run_level(url, "hpc/tiny", Level(concurrency=64, input_tokens=96, output_tokens=32,
                                                     requests=requests, rate=rate, same_prompt=same), True, 0))


def legend(fmt: str, metric: dict) -> str:
    for key, value in metric.items():
        fmt = fmt.replace("{{" + key + "}}", value)
    return fmt


def draw(dashboard: dict, series: dict[int, list[tuple[str, list[dict]]]], start: float, out: Path,
         subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(16, rows * 0.42), facecolor="#111217")
    fig.suptitle(f"{dashboard['title']} — {subtitle}", color="#d8d9da", fontsize=12, x=0.01, ha="left")
    for index, panel in enumerate(panels):
        g = panel["gridPos"]
        ax = fig.add_axes((g["x"] / 24 + 0.045, 1 - (g["y"] + g["h"]) / rows + 0.035, g["w"] / 24 - 0.06,
                           g["h"] / rows - 0.08), facecolor="#181b1f")
        ax.set_title(panel["title"], color="#d8d9da", fontsize=10, loc="left")
        ax.tick_params(colors="#9fa7b3", labelsize=7)
        for spine in ax.spines.values():
            spine.set_color("#2c3235")
        ax.grid(color="#2c3235", linewidth=0.5)
        drawn = 0
        for label, result in series[index]:
            for r in result:
                xs = [float(t) - start for t, _ in r["values"]]
                ys = [float(v) for _, v in r["values"]]
                ax.plot(xs, ys, linewidth=1.4, label=legend(label, r["metric"]))
                drawn += 1
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_xlabel("seconds into the load", color="#9fa7b3", fontsize=7)
        ax.set_ylabel(unit, color="#9fa7b3", fontsize=7)
        if drawn:
            ax.legend(fontsize=7, facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da", loc="upper left")
        else:
            ax.text(0.5, 0.5, "No data", color="#9fa7b3", ha="center", va="center", transform=ax.transAxes)
    fig.savefig(out, dpi=90, facecolor=fig.get_facecolor())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny-disagg")
    parser.add_argument("--set", dest="overrides", action="append", default=["frontend.router=kv_aware"],
                        help="recipe overrides for the stack (default: the KV-aware router, for its panel)")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--prometheus", default="prometheus")
    parser.add_argument("--port", type=int, default=19090)
    parser.add_argument("--out", type=Path, default=HERE / "hpc-run.png")
    args = parser.parse_args()
    from _stack import local_stack

    dashboard = json.loads((HERE / "hpc-run.json").read_text())
    with local_stack(args.recipe, *args.overrides) as (run, url), tempfile.TemporaryDirectory(prefix="hpc-prom-") as tmp:
        prometheus = start_prometheus(args.prometheus, run.path / "prometheus-targets.json", Path(tmp), args.port)
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    if up_targets(args.port) >= 2:
                        break
                except OSError:
                    pass
                time.sleep(1)
            start = time.time()
            load(url, args.seconds)
            end = time.time() + 4
            time.sleep(4)
            series = {i: [(t.get("legendFormat", ""), query_range(args.port, t["expr"].replace("$run", run.name),
                                                                    start, end, 2.0))
                          for t in p.get("targets", [])] for i, p in enumerate(dashboard["panels"])}
        finally:
            prometheus.terminate()
            prometheus.wait(10)
    draw(dashboard, series, start, args.out, f"{args.recipe} on this machine, {os.cpu_count()} CPUs, "
         f"Prometheus' own evaluation of the panels' queries")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
