"""The profile's table and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc.show import table
from hpc.profile.spec import ProfileRequest


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(p: dict[str, Any]) -> float | None:
    """Tokens/s a point stands for: input tokens through prefill, output tokens through decode."""
    if p["phase"] == "prefill":
        return p["isl"] * 1000 / p["ttft_ms"] if p["ttft_ms"] else None
    return p["tok_s"]


def points_table(points: list[dict[str, Any]]) -> str:
    rows = [[p["phase"], p["tp"], p["isl"], p["concurrency"], _f(p["ttft_ms"]), _f(p["itl_ms"], 2), _f(_rate(p), 0),
             _f(_rate(p) / p["tp"] if _rate(p) else None, 0), "yes" if p["valid"] else "NO"]
            for p in sorted(points, key=lambda p: (p["phase"] != "prefill", p["tp"], p["isl"], p["concurrency"]))]
    # prefill rows: input tokens/s (ISL / TTFT); decode rows: output tokens/s
    return table(["PHASE", "TP", "ISL", "CONC", "TTFT_MS", "ITL_MS", "TOK/S", "TOK/S/GPU", "VALID"], rows)


def choice_table(choice: dict[str, Any], req: ProfileRequest) -> str:
    lines = []
    for phase, latency, target in (("prefill", "ttft_ms", req.ttft_ms), ("decode", "itl_ms", req.itl_ms)):
        chosen = choice[phase]["chosen"]
        for c in choice[phase]["candidates"]:
            mark = " <- chosen" if chosen is not None and c["tp"] == chosen["tp"] else ""
            where = f" at c={c['concurrency']}" if phase == "decode" else f" at isl {req.isl}"
            lines.append(f"{phase} TP {c['tp']}: {latency[:-3].upper()} {c[latency]:.2f} ms{where} "
                         f"({'meets' if c['meets'] else 'misses'} {target:g} ms), "
                         f"{c['tok_s_per_gpu']:.0f} tok/s/GPU{mark}")
        if chosen is not None and not chosen["meets"]:
            lines.append(f"{phase}: no TP size meets {target:g} ms; the closest is chosen")
    return "\n".join(lines)


def plots(points: list[dict[str, Any]], choice: dict[str, Any], req: ProfileRequest, out: Path) -> list[Path]:
    """TTFT vs input length per TP and ITL vs per-GPU throughput per TP, the SLA dashed, the choice starred."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hpc.bench.report import save_figure

    pre, dec = choice["prefill"]["chosen"], choice["decode"]["chosen"]
    charts = [
        ("prefill", lambda p: (p["isl"], p["ttft_ms"]), req.ttft_ms, "TTFT target",
         pre and ((req.isl, pre["ttft_ms"]), f"chosen: TP {pre['tp']}"),
         ("input tokens", "TTFT p50 (ms)", "prefill: TTFT vs input length"), "prefill_ttft_vs_isl.png"),
        ("decode", lambda p: (p["tok_s"] / p["tp"], p["itl_ms"]), req.itl_ms, "ITL target",
         dec and ((dec["tok_s_per_gpu"], dec["itl_ms"]), f"chosen: TP {dec['tp']}, c={dec['concurrency']}"),
         ("output tokens/s per GPU", "ITL p50 (ms)", f"decode: ITL vs throughput (isl {req.isl})"),
         "decode_itl_vs_throughput.png")]
    paths = []
    for phase, xy, target, target_label, chosen, labels, name in charts:
        fig, ax = plt.subplots(figsize=(6, 4))
        for tp in sorted({p["tp"] for p in points}):
            curve = sorted(xy(p) for p in points if p["phase"] == phase and p["tp"] == tp and None not in xy(p))
            if curve:
                ax.plot(*zip(*curve), marker="o", label=f"TP {tp}")
        ax.axhline(target, color="grey", linestyle="--", label=target_label)
        if chosen:
            (x, y), label = chosen
            ax.plot([x], [y], marker="*", markersize=16, color="red", linestyle="none", label=label)
        ax.set(xlabel=labels[0], ylabel=labels[1], title=labels[2])
        ax.legend()
        paths.append(save_figure(plt, fig, out / name))
    return paths
