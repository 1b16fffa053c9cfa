"""Bench results: JSON, CSV, a table, and PNG plots (single run or two runs compared)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

COLUMNS = ["concurrency", "input_tokens", "output_tokens", "output_tokens_per_request", "requests", "completed",
           "peak_inflight", "failure_rate",
           "output_tokens_per_s", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
           "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms", "in_engines", "valid"]


# a level shorter than this is flagged under the table: on two H200 levels of 0.6 s moved by up to 35 % from one
# sweep to the next, where 2 s ones mostly stayed within 10 % (docs/performance-log.md, session 28)
SHORT_LEVEL_S = 1.0


def _share(value: float | None) -> str:
    """A share of a request's time: past 100 % only by the two clocks' disagreement, so shown as 100 %*."""
    if value is None:
        return "-"
    return "100%*" if value > 1.0 else f"{value:.0%}"


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def flat(level: dict[str, Any]) -> dict[str, Any]:
    row = {k: level[k] for k in COLUMNS if k in level}
    for metric in ("ttft", "itl", "tpot", "e2e"):
        for q in ("p50", "p90", "p99"):
            row[f"{metric}_{q}_ms"] = _ms((level.get(f"{metric}_s") or {}).get(q))  # tpot: not in older results
    return {k: row.get(k) for k in COLUMNS}


def write(results: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    with (out_dir / "results.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        for level in results["levels"]:
            writer.writerow(flat(level))
    return [out_dir / "results.json", out_dir / "results.csv", *plot({"": results}, out_dir)]


def table(results: dict[str, Any]) -> str:
    head = f"{'conc':>5} {'in':>5} {'out':>5} {'out/req':>7} {'ok':>6} {'fail%':>6} {'tok/s':>9} {'req/s':>8} " \
           f"{'TTFT p50':>9} {'ITL p50':>8} {'TPOT p50':>9} {'e2e p50':>8} {'e2e p99':>8}  valid"
    units = f"{'users':>5} {'tok':>5} {'tok':>5} {'tok':>7} {'req':>6} {'':>6} {'out tok/s':>9} {'':>8} " \
            f"{'ms':>9} {'ms':>8} {'ms':>9} {'ms':>8} {'ms':>8}"
    # the engines' share of a request's time (hpc.bench.engines): a run's levels have it, a bare URL's do not
    engines = any(lv.get("in_engines") is not None for lv in results["levels"])
    if engines:
        head = head.replace("  valid", " in eng  valid")
    lines = [head, units]
    for lv in results["levels"]:
        f = flat(lv)
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"{f['concurrency']:>5} {f['input_tokens']:>5} {f['output_tokens']:>5} "
                     f"{lv.get('output_tokens_per_request', 0):>7.1f} "
                     f"{lv['completed']:>6} {100 * lv['failure_rate']:>5.1f}% {lv['output_tokens_per_s']:>9.1f} "
                     f"{lv['requests_per_s']:>8.2f} {fmt(f['ttft_p50_ms']):>9} {fmt(f['itl_p50_ms']):>8} "
                     f"{fmt(f['tpot_p50_ms']):>9} {fmt(f['e2e_p50_ms']):>8} {fmt(f['e2e_p99_ms']):>8}"
                     + (f" {_share(lv.get('in_engines')):>6}" if engines else "") + "  "
                     f"{'yes' if lv['valid'] else 'NO: ' + '; '.join(lv['invalid_reasons'])}")
    spread = [f"c={lv['concurrency']}: {lv['client_processes']}" for lv in results["levels"]
              if lv.get("client_processes", 1) > 1]
    if spread:
        lines.append("client processes (the load generator's users spread over them): " + ", ".join(spread))
    if engines:
        lines.append("in eng: of a request's mean time at the client, the share inside the engines (each from its "
                     "inbox to its last output); the rest went to the client, the frontend, the workers, their links "
                     "(100%*: the engines' clock and the client's disagree by more than the rest)")
    short = [f"c={lv['concurrency']}: {lv['duration_s']:.2f} s" for lv in results["levels"]
             if lv.get("duration_s") is not None and lv["duration_s"] < SHORT_LEVEL_S]
    if short:
        lines.append(f"levels under {SHORT_LEVEL_S:g} s, whose figures move from run to run (--requests-per-user "
                     "makes them longer): " + ", ".join(short))
    return "\n".join(lines)


def plot(runs: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, res in runs.items():
        lv = res["levels"]
        xs = [l["e2e_s"]["p50"] * 1000 if l["e2e_s"]["p50"] else 0 for l in lv]
        ax.plot(xs, [l["output_tokens_per_s"] for l in lv], marker="o", label=label or res.get("target", ""))
        for l, x in zip(lv, xs):
            ax.annotate(f"c={l['concurrency']}", (x, l["output_tokens_per_s"]), fontsize=7)
    ax.set_xlabel("end-to-end latency p50 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs latency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    paths.append(save_figure(plt, fig, out_dir / "throughput_vs_latency.png"))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    for label, res in runs.items():
        lv = res["levels"]
        cs = [l["concurrency"] for l in lv]
        a1.plot(cs, [(l["ttft_s"]["p50"] or 0) * 1000 for l in lv], marker="o", label=label or "TTFT p50")
        a2.plot(cs, [(l["itl_s"]["p50"] or 0) * 1000 for l in lv], marker="o", label=label or "ITL p50")
    for a, name in ((a1, "TTFT p50 (ms)"), (a2, "ITL p50 (ms)")):
        a.set_xlabel("concurrency")
        a.set_ylabel(name)
        a.set_xscale("log", base=2)
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    paths.append(save_figure(plt, fig, out_dir / "ttft_itl_vs_concurrency.png"))
    return paths


def save_figure(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
