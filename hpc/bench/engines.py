"""How much of a request's time the run's engines held it: each worker's engine counts the requests it finished
and their seconds from its inbox to their last output (hpc_worker_finished_request*_total in its /metrics). Over a
level, each role's mean time a request (a disaggregated request passes prefill, then decode), summed, over the
client's mean e2e, is the share the engines had; the rest is the hops (client, frontend, worker, links). In a closed
loop a user is out of the engines' batches for the rest, which bounds the tokens/s a level can reach."""

from __future__ import annotations

import json
from pathlib import Path

COUNTERS = ("finished_requests_total", "finished_request_seconds_total")
Snapshot = dict[str, dict[str, float]]  # component (e.g. decode-0) -> COUNTERS


def worker_states(run_path: Path) -> dict[str, dict]:
    """Each worker rank's state file (its device, metrics URL, phases), by file name (decode-0, prefill-0.rank1).
    Workers are what report a device: the frontend and the services are left out, and so is a file being
    rewritten at the moment it is read."""
    states = {}
    for path in sorted((run_path / "state").glob("*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state, dict) and "device" in state:
            states[path.stem] = state
    return states


def metrics_urls(run_path: Path) -> dict[str, str]:
    """Each worker's metrics URL as its state file gives it, by component; ranks without an endpoint left out."""
    urls = {}
    for state in worker_states(run_path).values():
        if state.get("http") and state.get("component"):
            urls.setdefault(str(state["component"]), str(state["http"]))
    return urls


def worker_counters(metrics_url: str, names: tuple[str, ...], timeout: float = 2.0) -> dict[str, float]:
    """A worker's counters (hpc_worker_<name> in its /metrics), each summed over its samples."""
    from hpc.checks.probe import get_text, metric_values

    text = get_text(f"{metrics_url}/metrics", timeout=timeout)
    return {name: metric_values(text, f"hpc_worker_{name}") for name in names}


class EngineCounters:
    """The engines' counters, read whenever called, until a worker does not answer: from then on nothing (the
    share is then not known), so that workers a login node cannot reach cost one timeout, not two a level."""

    def __init__(self, urls: dict[str, str], timeout: float = 2.0) -> None:
        self.urls, self.timeout = dict(urls), timeout

    def __call__(self) -> Snapshot:
        taken = {}
        for component, url in self.urls.items():
            try:
                taken[component] = worker_counters(url, COUNTERS, self.timeout)
            except OSError:
                self.urls = {}
                return {}
        return taken


def share_in_engines(before: Snapshot, after: Snapshot, client_e2e_mean_s: float | None) -> float | None:
    """The engines' share of a request's mean time at the client over a level; None when a worker was not read
    both times, no engine finished a request, or the client has no e2e."""
    if not client_e2e_mean_s or not after or set(before) != set(after):
        return None
    per_role: dict[str, list[float]] = {}
    for component, counts in after.items():
        role = component.rsplit("-", 1)[0]  # agg-0, prefill-1: the role's workers share one mean
        summed = per_role.setdefault(role, [0.0, 0.0])
        for i, name in enumerate(COUNTERS):
            summed[i] += counts[name] - before[component][name]
    means = [seconds / requests for requests, seconds in per_role.values() if requests > 0]
    return sum(means) / client_e2e_mean_s if means else None
