"""`python -m hpc.checks.ready MANIFEST`: wait for each stage on its own probe; no fixed sleeps.

Stages: etcd health, NATS health, frontend /health, then the frontend listing the expected instance
count per role. Phase times go to state/ready.json; a stage that stops making progress is reported with
the last lines of its component's log.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

from hpc.manifest import Manifest
from hpc.rundir import RunDir, RunLayout, write_json
from hpc.checks.probe import reach_json
from hpc.waiting import Backoff, wait_until

POLL = Backoff(first_s=0.05, factor=1.0, cap_s=0.05)  # readiness files and loopback probes are cheap


class NotReady(Exception):
    pass


def log_tail(manifest: Manifest, component: str, lines: int = 15) -> str:
    path = Path(manifest.run_dir) / "logs" / f"{component}.log"
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    return "\n".join(f"    {line}" for line in text[-lines:])


def failed_for_good(states: dict[str, dict]) -> list[str]:
    """Components (state file names: a worker's rank as `decode-0.rank1`) that failed with no restart coming: a
    worker its failure policy restarts (`restarting`) is waited for."""
    return sorted(name for name, data in states.items()
                  if data.get("phase") == "failed" and not data.get("restarting"))


def _failed_component(manifest: Manifest) -> tuple[str, str] | None:
    """The first component that failed for good, and the error it reported ("" if none)."""
    states = RunDir(Path(manifest.run_dir)).component_states()
    failed = failed_for_good(states)
    return (failed[0], str(states[failed[0]].get("error") or "")) if failed else None


def _answers_200(url: str) -> bool:
    """An endpoint not listening is waited on, not an error: an endpoint file an earlier job of this run directory
    left (until this job's first step moves it aside), or a service that its step restarts."""
    answer = reach_json(url, 1)
    return answer is not None and answer[0] == 200


class _Stages:
    """Readiness stage by stage, each recorded in RUN/state/ready.json as it is reached, each bounded."""

    def __init__(self, manifest: Manifest, timeout: float, stall_s: float, progress: Callable[[str], None],
                 abort: Callable[[], str | None]) -> None:
        self.manifest, self.timeout, self.stall_s, self.progress, self.abort = manifest, timeout, stall_s, progress, abort
        self.start = time.monotonic()
        self.phases: dict[str, float] = {}
        self.out = RunLayout.of(manifest.run_dir).ready

    def record(self, stage: str) -> None:
        self.phases[stage] = round(time.monotonic() - self.start, 3)
        write_json(self.out, {"phase": stage, "seconds": self.phases, "ready": stage == "ready"})
        self.progress(f"  {stage:<28} {self.phases[stage]:7.2f} s")

    def give_up(self, reason: str) -> NotReady:
        """The readiness record says it gave up (the smoke job waiting on it ends at once), then the error."""
        write_json(self.out, {"phase": next(reversed(self.phases), None), "seconds": self.phases, "ready": False,
                              "gave_up": reason.splitlines()[0]})
        return NotReady(reason)

    def until(self, stage: str, component: str | Callable[[], str], check: Callable[[], bool],
              record: bool = True) -> None:
        """One stage (recorded when `record`): done, or a failed component / an abort reason / the stage's time budget -> NotReady."""
        def culprit() -> str:
            return component() if callable(component) else component

        def look() -> bool | None:
            if check():
                return True
            failed = _failed_component(self.manifest)
            if failed:
                name, error = failed
                raise self.give_up(f"{name} failed while waiting for {stage}{': ' + error if error else ''}\n"
                                   f"  last lines of its log:\n{log_tail(self.manifest, name.split('.rank')[0])}")
            reason = self.abort()
            if reason:
                raise self.give_up(f"{reason} while waiting for {stage}; last lines of {culprit()}'s log:\n"
                                   f"{log_tail(self.manifest, culprit())}")
            return None
        elapsed = time.monotonic() - self.start
        budget = max(0.0, min(self.stall_s, self.timeout - elapsed))  # a stall is a stage without progress
        try:
            wait_until(look, budget, stage, backoff=POLL)
        except TimeoutError:
            raise self.give_up(f"stuck waiting for {stage} after {time.monotonic() - self.start:.0f} s; last lines "
                               f"of {culprit()}'s log:\n{log_tail(self.manifest, culprit())}") from None
        if record:
            self.record(stage)


def wait_ready(manifest: Manifest, timeout: float | None = None, stall_s: float | None = None,
               progress: Callable[[str], None] = print,
               abort: Callable[[], str | None] = lambda: None) -> dict[str, float]:
    """Block until ready; `abort` may return a reason to give up (e.g. the Slurm job ended)."""
    timeout = timeout or manifest.recipe.runtime.readiness_timeout_s
    stages = _Stages(manifest, timeout, stall_s or timeout, progress, abort)
    layout = RunLayout.of(manifest.run_dir)
    for service in ("etcd", "nats"):
        if any(s.name == service for s in manifest.plan.services):
            def healthy(service=service) -> bool:
                ep = layout.read_endpoint(service)
                return ep is not None and ep.health is not None and _answers_200(ep.health)
            stages.until(f"{service} healthy", service, healthy)
    frontend: dict[str, str] = {}

    def frontend_up() -> bool:
        ep = layout.read_endpoint("frontend")
        if ep is not None and ep.url is not None:
            frontend["url"] = ep.url
            return _answers_200(ep.url + "/live")
        return False
    stages.until("frontend up", "frontend", frontend_up)
    names = {w.name for w in manifest.plan.workers}
    seen: set[str] = set()

    def registered() -> bool:
        _, body = reach_json(frontend["url"] + "/health", 1) or (0, None)
        for role, items in ((body or {}).get("instances") or {}).items():
            for item in items:
                name = f"{role}-{item['index']}"
                if name in names and name not in seen:
                    seen.add(name)
                    stages.record(f"{name} registered")
        return seen == names
    # a stuck stage names the first worker that has not registered yet
    stages.until("workers registered", lambda: min(names - seen, default="frontend"), registered, record=False)
    if manifest.recipe.disaggregated:
        warm_handoffs(manifest, frontend["url"])
        stages.record("handoffs warmed")
    stages.record("ready")
    RunDir(Path(manifest.run_dir)).write_scrape_targets()  # every component is up: Prometheus may scrape them
    return stages.phases


WARM_REQUESTS_MAX = 64


def warm_handoffs(manifest: Manifest, url: str) -> None:
    """Requests through prefill -> decode before "ready": the whole handoff path (frontend, prefill, KV transfer,
    decode) has worked once before anyone is told it is ready — a broken transfer fails readiness, not the first
    user. Round robin takes turns per role, so prefill x decode requests reach every pair when the counts are
    coprime, and every worker in any case."""
    from hpc.checks.probe import post_json

    roles = manifest.recipe.roles
    n = min(WARM_REQUESTS_MAX, roles.required("prefill").total_count * roles.required("decode").total_count)
    for i in range(n):
        status, body = post_json(url + "/v1/completions", {"model": manifest.recipe.model.served_name,
                                                           "prompt": [100 + i, 200, 300, 400], "max_tokens": 2,
                                                           "temperature": 0, "ignore_eos": True}, timeout=120)
        if status != 200:
            raise NotReady(f"a warm-up request through prefill -> decode failed: HTTP {status} {str(body)[:300]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.checks.ready")
    parser.add_argument("manifest")
    parser.add_argument("--timeout", type=float)
    args = parser.parse_args(argv)
    manifest = Manifest.load(args.manifest)
    print(f"hpc: waiting for {manifest.recipe.name} to be ready", flush=True)
    try:
        wait_ready(manifest, args.timeout, progress=lambda s: print(s, flush=True))
    except NotReady as exc:
        print(f"hpc: not ready: {exc}", file=sys.stderr, flush=True)
        return 1
    print("hpc: ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
