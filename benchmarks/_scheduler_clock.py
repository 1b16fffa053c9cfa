"""The torch engine's scheduler clock (its counters in the worker's /metrics, or TorchEngine.stats()) per decode
step: where a level or sweep slower than another spent its time, the engine alone or a worker in the stack."""

from __future__ import annotations

# of admit, a prefill step's phases (as per_prefill_step names them): its launch, a prefill worker's KV kept for
# the decode side, the first tokens picked (the wait for the device), a prefill worker's answers, the prompts' store
PREFILL_PARTS = (("launch", "prefill_launch"), ("kv", "prefill_keep_kv"), ("pick", "prefill_pick"),
                 ("answers", "prefill_answer"), ("store", "store"))
# seconds idle, admitting (prefills included) and decoding; steps; tokens the engine generated
SCHEDULER_CLOCK = ("decode_seconds_total", "admit_seconds_total", "idle_seconds_total", "decode_steps",
                   "generated_tokens", "prefill_steps", "first_tokens", "idle_running_seconds_total",
                   "idle_waits_total", "first_token_seconds_total", "link_seconds_total",
                   "finished_requests_total", "finished_request_seconds_total", "link_unread_seconds_total",
                   "outputs_link_seconds_total", "outputs_messages_total", "worker_loop_latency_seconds_total",
                   "worker_loop_latency_probes_total", "scheduler_cpu_reference_seconds_total",
                   "scheduler_cpu_reference_runs_total", *(f"{key}_seconds_total" for _, key in PREFILL_PARTS))

def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in SCHEDULER_CLOCK}


def per_step(clock: dict[str, float]) -> str:
    """A decode step's figures, or a prefill worker's per prefill step (it never decodes)."""
    return per_decode_step(clock) if clock["decode_steps"] else per_prefill_step(clock)


def per_prefill_step(clock: dict[str, float]) -> str:
    """'admit (of which: launch, KV kept, pick, answers, the prompts' store into the prefix cache) / idle' ms per
    prefill step (a prefill worker's admission is its prefill), and prompts a step."""
    steps = max(clock["prefill_steps"], 1)
    parts = ", ".join(f"{name} {clock[f'{key}_seconds_total'] / steps * 1e3:.3f}" for name, key in PREFILL_PARTS)
    return (f"{clock['admit_seconds_total'] / steps * 1e3:.3f} ({parts}) / "
            f"{clock['idle_seconds_total'] / steps * 1e3:.3f}, {clock['first_tokens'] / steps:.1f} prompts")


def per_decode_step(clock: dict[str, float]) -> str:
    """'decode / admit / idle (of which with rows running)' ms per decode step, and tokens a step (a step's rows,
    plus the first tokens that prefills picked meanwhile). Idle with no rows is a level's ramp and tail, or the
    closed loop's gaps; with rows, the scheduler's look at its inbox."""
    steps = max(clock["decode_steps"], 1)
    waited = clock["idle_seconds_total"] - clock["idle_running_seconds_total"]
    waits = (f", {clock['idle_waits_total']:.0f} waits for work of {waited / clock['idle_waits_total'] * 1e3:.2f} ms"
             if clock.get("idle_waits_total") else "")
    # how many prompts a prefill step took, and a prompt's wait for its first token from its arrival at the
    # engine (and before it, in an engine process's link from its worker): what keeps a closed loop's users out
    # of the decode batch
    prompts, firsts = "", clock.get("first_tokens") or 0
    if firsts and clock.get("prefill_steps"):
        prompts = (f"; {firsts / clock['prefill_steps']:.1f} prompts a prefill step, first token "
                   f"{clock.get('first_token_seconds_total', 0) / firsts * 1e3:.2f} ms")
        if clock.get("link_seconds_total"):
            prompts += f" (+ link {clock['link_seconds_total'] / firsts * 1e3:.2f})"
    return (f"{clock['decode_seconds_total'] / steps * 1e3:.3f} / {clock['admit_seconds_total'] / steps * 1e3:.3f} / "
            f"{clock['idle_seconds_total'] / steps * 1e3:.3f} ({clock['idle_running_seconds_total'] / steps * 1e3:.3f}"
            f" running), {clock['generated_tokens'] / steps:.1f} tokens{waits}{prompts}")


def scheduler_cpu_speed(per_level: dict[int, list[dict[str, dict[str, float]]]]) -> str:
    """Each engine's scheduler thread's CPU at each level of each sweep, from the reference it times on itself
    (hpc/runtime/engine/torch/cpu_reference.py): the engine's fastest level's mean over this level's, so 100 % is its
    fastest and 50 % a CPU half as fast. `per_level`: level -> per sweep -> engine -> a SCHEDULER_CLOCK difference."""
    means: dict[str, dict[int, list[float | None]]] = {}
    for level, sweeps in per_level.items():
        for sweep in sweeps:
            for name, clock in sweep.items():
                runs = clock.get("scheduler_cpu_reference_runs_total", 0)
                mean = clock["scheduler_cpu_reference_seconds_total"] / runs if runs else None
                means.setdefault(name, {}).setdefault(level, []).append(mean)
    lines = []
    for name, levels in means.items():
        found = [m for ms in levels.values() for m in ms if m is not None]
        if not found:
            continue
        fastest = min(found)
        lines.append(f"  {name} ({fastest * 1e6:.1f} µs at its fastest): " + ", ".join(
            f"c={level} " + " / ".join("-" if m is None else f"{fastest / m:.0%}" for m in ms)
            for level, ms in levels.items()))
    return "\n".join(["each engine's scheduler thread's CPU speed at each level, first / second sweep (a reference "
                      "timed on the thread itself, against its fastest level):", *lines]) if lines else ""
