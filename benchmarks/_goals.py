"""Issue #14's "must show" goals, judged from the figures gpu_suite.py's steps wrote: one verdict a goal, with what
was measured, so that one GPU call says which goals hold on this machine today.

Each goal names the step it reads: the JSON the step wrote, or a test run's pytest summary. A goal whose step did
not run, failed or wrote no figures (a test run: printed no summary) is "not measured", never met.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

# (lowest, highest) of first ÷ second sweep; c=64 ÷ c=1; stack ÷ engine; KV handoff ms; share of the roofline
SWEEP_BAND = (0.90, 1.10)
SCALING = 20.0
KEPT = 0.95
HANDOFF_SAME_GPU_MS = 1.0
HANDOFF_ACROSS_GPUS_MS = 2.0
ROOFLINE_TP1 = 0.85
ROOFLINE_TP2 = 0.70
# the KV handoff path the goals are about: device to device, never the bytes through the hosts
DEVICE_TO_DEVICE = "kv_fetched_cuda_ipc"


@dataclass(frozen=True)
class Verdict:
    goal: str
    step: str
    measured: str
    met: bool | None  # None: not measured


def _pct(x: float) -> str:
    return f"{x:.0%}"


def _sweeps(figures: dict[str, Any]) -> tuple[str, bool | None]:
    first, second = figures["first"], figures["second"]
    ratios = {c: first[c]["output_tokens_per_s"] / second[c]["output_tokens_per_s"] for c in first}
    ok = all(SWEEP_BAND[0] <= r <= SWEEP_BAND[1] for r in ratios.values())
    measured = " / ".join(f"c={c} {_pct(r)}" for c, r in ratios.items())
    speeds = _scheduler_speeds(figures.get("scheduler_per_level") or {})
    if speeds:  # a host-bound engine runs at the speed of the vCPU under its scheduler, which changes over time
        measured += "; the decode scheduler's CPU, first ÷ second sweep: " + " / ".join(
            f"c={c} {_pct(r)}" for c, r in speeds.items())
    return _on_own_gpus(figures, measured, ok)


def _on_own_gpus(figures: dict[str, Any], measured: str, ok: bool) -> tuple[str, bool | None]:
    """The sweeps' goals are about prefill and decode on GPUs of their own: on GPUs they shared (one GPU's stated
    fallback), or with no record of where the workers ran, the figures are shown and the goal is not measured."""
    devices = {name: worker.get("device") for name, worker in (figures.get("workers") or {}).items()
               if name.rsplit("-", 1)[0] in ("prefill", "decode")}
    if {name.rsplit("-", 1)[0] for name in devices} != {"prefill", "decode"} or None in devices.values():
        return f"not measured on their own GPUs (the figures do not say where prefill and decode ran): {measured}", None
    if len(set(devices.values())) < len(devices):
        shared = ", ".join(sorted(set(devices.values())))
        return f"not measured on their own GPUs (prefill and decode shared {shared}): {measured}", None
    return measured, ok


def _scheduler_speeds(per_level: dict[str, list[dict[str, dict[str, float]]]]) -> dict[str, float]:
    """Per level, how fast the CPU under the busiest scheduler thread ran in the first sweep against the second:
    the second's mean time a run of the reference that thread times on itself ÷ the first's (cpu_reference.py; it
    runs only while rows decode, so it is a decode engine's). A level without runs in both sweeps is left out."""
    speeds = {}
    for c, sweeps in per_level.items():
        if len(sweeps) < 2:
            continue
        runs = {name: [sweep.get(name, {}).get("scheduler_cpu_reference_runs_total", 0) for sweep in sweeps[:2]]
                for name in sweeps[0]}
        name = max(runs, key=lambda n: min(runs[n]), default=None)
        if name is None or min(runs[name]) <= 0:
            continue
        mean = [sweeps[i][name]["scheduler_cpu_reference_seconds_total"] / runs[name][i] for i in (0, 1)]
        speeds[c] = mean[1] / mean[0]
    return speeds


def _scaling(figures: dict[str, Any]) -> tuple[str, bool | None]:
    first, second = figures["first"], figures["second"]
    lo, hi = min(first, key=int), max(first, key=int)
    scale = [s[hi]["output_tokens_per_s"] / s[lo]["output_tokens_per_s"] for s in (first, second)]
    return _on_own_gpus(figures, f"c={hi} ÷ c={lo}: {scale[0]:.1f}x first sweep, {scale[1]:.1f}x second",
                        min(scale) >= SCALING)


def _kept(figures: dict[str, Any]) -> tuple[str, bool]:
    kept = {c: level["kept"] for c, level in figures["levels"].items()}
    measured = " / ".join(f"c={c} {_pct(k)}" for c, k in kept.items())
    # what bounds it in a closed loop: a user is out of the engine while its request crosses the hops
    # (e2e_throughput.stack_levels)
    inside = {c: level["in_engines"] for c, level in figures["levels"].items() if "in_engines" in level}
    if inside:
        measured += "; a request spent " + " / ".join(f"c={c} {_pct(share)}" for c, share in inside.items()) + \
            " of its time at the client inside the engines"
    full = {c: _batch_share(level.get("tokens_a_step") or {}) for c, level in figures["levels"].items()}
    full = {c: share for c, share in full.items() if share is not None}
    if full:
        measured += "; the stack's decode batches held " + " / ".join(
            f"c={c} {_pct(share)}" for c, share in full.items()) + " of the engine's tokens a step"
    return measured, all(k >= KEPT for k in kept.values())


def _batch_share(tokens_a_step: dict[str, float]) -> float | None:
    """The stack's decoding engine's tokens a step over the direct path's ("directly"); None without both."""
    stack = [tokens for name, tokens in tokens_a_step.items() if name != "directly"]
    direct = tokens_a_step.get("directly")
    return stack[0] / direct if stack and direct else None


def _handoff(limit_ms: float) -> Callable[[dict[str, Any]], tuple[str, bool]]:
    def judge(figures: dict[str, Any]) -> tuple[str, bool]:
        path = next((p for p in figures["paths"] if p["counted"] == DEVICE_TO_DEVICE), None)
        if path is None:
            return "no device-to-device path ran (" + ", ".join(p["counted"] for p in figures["paths"]) + ")", False
        return (f"{path['median_ms']:.2f} ms median, {figures['tokens']} tokens "
                f"({figures['prefill_device']} -> {figures['decode_device']})"), path["median_ms"] <= limit_ms
    return judge


def _roofline(label: str, share: float) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
    def judge(figures: dict[str, Any]) -> tuple[str, bool | None]:
        got = figures["summary"]["b1_of_roofline"].get(label)
        if got is None:  # gpu_check runs TP=2 wherever there are two GPUs, and fails the step if it cannot
            return f"not measured: gpu_check ran no {label} (too few GPUs)", None
        return f"{_pct(got)} of the HBM roofline", got >= share
    return judge


def _tp_tokens(figures: dict[str, Any]) -> tuple[str, bool | None]:
    summary = figures["summary"]
    same, distinct = summary.get("tp2_fp32_same_as_tp1"), summary.get("tp2_distinct_gpus")
    if same is None:
        return "not measured: gpu_check ran no TP=2 (too few GPUs)", None
    return f"fp32 tokens equal: {same}; ranks on distinct GPUs: {distinct}", bool(same and distinct)


def _tests(skips_allowed: bool) -> Callable[[dict[str, Any]], tuple[str, bool | None]]:
    """A pytest step's verdict from its summary line ("5 passed, 1 skipped in 60.2s"): something passed and
    nothing failed; with skips_allowed False, a skipped test (a layout never checked) fails the goal too. No
    summary (the step timed out or never started pytest): not measured."""
    def judge(entry: dict[str, Any]) -> tuple[str, bool | None]:
        tail = entry.get("output_tail", "").strip().splitlines()
        line = next((x for x in reversed(tail) if re.search(r"\d+ (passed|failed|error)", x)), None)
        if line is None:
            return f"not measured: no pytest summary ({entry.get('status', '?')})", None
        counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", line)}
        bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
        return line.strip("= "), counts.get("passed", 0) > 0 and not bad and (
            skips_allowed or not counts.get("skipped"))
    return judge


# (goal, step, how the step's entry is judged: from the figures it wrote, or a test run's from its summary)
GOALS: list[tuple[str, str, Callable[[dict[str, Any]], tuple[str, bool | None]]]] = [
    ("first sweep within 10 % of the second (tiny, disaggregated, own GPUs)", "stack_sweeps_disagg", _sweeps),
    (f"c=64 >= {SCALING:.0f} x c=1 (tiny, disaggregated, own GPUs)", "stack_sweeps_disagg", _scaling),
    (f"stack ÷ engine >= {KEPT:.0%}, aggregated (tiny)", "stack_vs_engine_agg", _kept),
    (f"stack ÷ engine >= {KEPT:.0%}, disaggregated (tiny)", "stack_vs_engine_disagg", _kept),
    # the model size item 5 exists for, "so that the figures compare with real serving engines"
    (f"stack ÷ engine >= {KEPT:.0%}, aggregated (8B shape)", "stack_vs_engine_agg_8b", _kept),
    (f"stack ÷ engine >= {KEPT:.0%}, disaggregated (8B shape)", "stack_vs_engine_disagg_8b", _kept),
    (f"KV handoff, 2,000 tokens of the 8B shape, same GPU <= {HANDOFF_SAME_GPU_MS:g} ms", "kv_handoff",
     _handoff(HANDOFF_SAME_GPU_MS)),
    (f"KV handoff, GPU 0 -> 1 <= {HANDOFF_ACROSS_GPUS_MS:g} ms", "kv_handoff_gpu0_to_1",
     _handoff(HANDOFF_ACROSS_GPUS_MS)),
    (f"8B shape, batch-1 decode >= {ROOFLINE_TP1:.0%} of the roofline, one GPU", "gpu_check_8b",
     _roofline("TP=1", ROOFLINE_TP1)),
    (f"8B shape, TP=2 >= {ROOFLINE_TP2:.0%} of its roofline", "gpu_check_8b", _roofline("TP=2", ROOFLINE_TP2)),
    ("8B shape, TP=2 greedy fp32 tokens == one rank's, distinct GPUs", "gpu_check_8b", _tp_tokens),
    ("TP, PP, EP (and TP-sharded MoE) fp32 tokens == one rank's over NCCL", "parallel_layouts_nccl",
     _tests(skips_allowed=False)),
]
# steps judged by their pytest summary, not by figures. The CUDA tests are not among the goals: 200 s ran 24 of
# their 74 on two H200 (most are CPU tests that CI runs), beside the goals' 400 s; `--only cuda_tests` runs them.
TESTS = {"parallel_layouts_nccl"}
# goals' steps that need a call of their own: each warms two 8B engines (a minute apiece) before its rounds
OWN_CALL = ("stack_vs_engine_agg_8b", "stack_vs_engine_disagg_8b")
GOAL_STEPS = [step for step in dict.fromkeys(step for _, step, _ in GOALS) if step not in OWN_CALL]


def verdicts(steps: dict[str, dict[str, Any]]) -> list[Verdict]:
    """Each goal's verdict from the suite's steps (name -> {"status", "figures", "output_tail"})."""
    out = []
    for goal, step, judge in GOALS:
        entry = steps.get(step)
        if entry is None:
            own = f" (a call of its own: --only {','.join(OWN_CALL)})" if step in OWN_CALL else ""
            out.append(Verdict(goal, step, f"not measured: {step} did not run{own}", None))
        elif step in TESTS:  # a failed run's summary still says what failed
            out.append(Verdict(goal, step, *judge(entry)))
        elif entry.get("status") != "ok":
            out.append(Verdict(goal, step, f"not measured: {step} {entry.get('status', '?')}", None))
        elif "figures" not in entry:
            out.append(Verdict(goal, step, f"not measured: {step} wrote no figures", None))
        else:
            try:
                measured, met = judge(entry["figures"])
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
                out.append(Verdict(goal, step, f"not measured: {step}'s figures lack {exc!r}", None))
                continue
            out.append(Verdict(goal, step, measured, met))
    return out


def table(found: list[Verdict]) -> str:
    """Markdown, as docs/performance.md takes it."""
    mark = {True: "**met**", False: "not met", None: "not measured"}
    lines = ["| goal | measured | verdict |", "|---|---|---|"]
    lines += [f"| {v.goal} | {v.measured} | {mark[v.met]} |" for v in found]
    return "\n".join(lines)
