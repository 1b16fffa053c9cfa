"""Commands on running jobs and runtime tools: status, logs, cancel, smoke, model, dev-cluster."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from hpc.show import table
from hpc.errors import UserError
from hpc.cli.args import bounded_int
from hpc.rundir import RunDir, bad_nodes_text, find_run, list_runs, read_json, shown


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="Slurm state, each component's health and the smoke verdict")
    p.add_argument("run", nargs="?", help="run directory, run id or Slurm job id (default: list recent runs)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--watch", action="store_true", help="refresh every 2 s")
    p.set_defaults(func=status)

    p = sub.add_parser("logs", help="per-component logs of a run")
    p.add_argument("run", nargs="?")
    p.add_argument("--component", help="etcd, nats, frontend, agg, prefill, decode, encode, job")
    p.add_argument("--index", type=bounded_int(0, 100_000), default=0, help="which of the component's instances")
    p.add_argument("-f", "--follow", action="store_true")
    p.add_argument("-n", "--lines", type=bounded_int(1, 10_000_000, "-1 would print all but one"), default=50,
                   help="the last N lines (N from 1)")
    p.add_argument("--request", metavar="ID", type=_request_id,
                   help="every component's lines that name this request (its x-request-id, the response's id)")
    p.set_defaults(func=logs)

    p = sub.add_parser("cancel", help="stop a run: its workers drain first (USR1), then TERM, then KILL")
    p.add_argument("run")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the workers get to finish what they serve (the drain) before TERM; on the local "
                        "profile also from TERM to KILL")
    p.add_argument("--remove", action="store_true",
                   help="remove the run directory once the job has stopped (its logs and bench results too)")
    p.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)  # the default now; older scripts pass it
    p.set_defaults(func=cancel)

    p = sub.add_parser("endpoint", help="one address for a run, or for a chain of jobs across its handovers "
                                        "(forwards each request to the frontend of the job serving now)")
    p.add_argument("run", help="run or chain id, job id or run directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=bounded_int(0, 65535), default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--retry", type=bounded_int(0, 3600), default=30, metavar="SECONDS",
                   help="how long a request that got no answer yet is sent again to the job serving by then")
    p.set_defaults(func=endpoint)

    p = sub.add_parser("smoke", help="run the smoke checks of a running job through submitit")
    p.add_argument("run", nargs="?")
    p.set_defaults(func=smoke)

    p = sub.add_parser("model", help="build a random-weight model offline (tiny ones; the 8B shape's weights are "
                                     "made by the engine at load)")
    p.add_argument("kind", choices=["tiny", "tiny-multimodal", "tiny-moe", "tiny-video", "llama-8b-shape"])
    # the choices are hpc.runtime.engine.builds.KINDS (not imported here: the CLI stays free of torch)
    p.add_argument("--out", required=True, type=Path)
    p.set_defaults(func=model)

    p = sub.add_parser("dev-cluster", help="a multi-node Slurm cluster on this machine (needs root)")
    p.add_argument("action", choices=["up", "status", "exec", "down", "env"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="up: --nodes N --gpus-per-node G; exec: NODE CMD...; "
                                                          "down: --purge")
    p.set_defaults(func=dev_cluster)

    from hpc.cli import bench_command

    bench_command.add_parser(sub)


# ---- status ------------------------------------------------------------------------------------------
def _slurm_state(run: RunDir) -> dict[str, Any]:
    """The scheduler's view of the run, from its backend (local processes, a Slurm job, an allocation's steps)."""
    from hpc.launch.backends import of_run

    info = run.run_info()
    if not run.submitted():
        return {"state": "NOT SUBMITTED" if info.submit_error is None else "SUBMIT FAILED"}
    return of_run(run).status(run)


def _listed_states(runs: list[RunDir]) -> dict[Path, str]:
    """The list's STATE column: every Slurm job of a cluster in one squeue and one sacct (sacct alone can take
    a second on a busy cluster: twenty runs asked one by one took twenty), local runs from their processes."""
    from hpc.launch.backends import of_run
    from hpc.launch.slurm import runner_for_conf
    from hpc.slurm.client import SlurmClient

    states: dict[Path, str] = {}
    by_cluster: dict[str | None, list[RunDir]] = {}
    for run in runs:
        if run.submitted() and of_run(run).name == "slurm":
            by_cluster.setdefault(run.manifest().cluster.slurm_conf, []).append(run)
        else:
            states[run.path] = _slurm_state(run)["state"]
    for slurm_conf, queued in by_cluster.items():
        found = SlurmClient(runner_for_conf(slurm_conf)).statuses([str(run.job_id()) for run in queued])
        for run in queued:
            st = found.get(str(run.job_id()))
            states[run.path] = st.state if st is not None else "UNKNOWN"
    return states


def _health(url: str | None) -> str:
    """A worker's /health in words: its status, and for a decode worker how its KV arrived (which transport)."""
    if not url:
        return "-"
    from hpc.checks.probe import reach_json

    answer = reach_json(url, 1.0)
    if answer is None:
        return "unreachable"
    code, body = answer
    if not isinstance(body, dict):
        return str(code)
    fetched = ", ".join(f"{via} {n}" for via, n in sorted((body.get("kv_fetched") or {}).items()))
    return body.get("status", str(code)) + (f", KV by {fetched}" if fetched else "")


def collect_status(run: RunDir) -> dict[str, Any]:
    m = run.manifest()
    states = run.component_states()
    endpoint = run.frontend_url()
    frontend_view: dict[str, Any] = {}
    frontend_health = "-"
    if endpoint:  # one probe of the frontend serves its own row, the workers' routing and the roles
        from hpc.checks.probe import reach_json

        answer = reach_json(endpoint + "/health", 1.0)
        if answer is None:
            frontend_health = "unreachable"
        else:
            code, body = answer
            frontend_view = body if isinstance(body, dict) else {}
            frontend_health = frontend_view.get("status", str(code))
    components = []
    for s in m.plan.services:
        st = states.get(s.name, {})
        components.append({"component": s.name, "node": st.get("node", f"n{s.node}"),
                           "phase": st.get("phase", "not started"),
                           "health": frontend_health if s.name == "frontend" else "-",
                           "restarts": st.get("restarts", 0)})
    listed = {(role, i["index"]): i for role, items in (frontend_view.get("instances") or {}).items() for i in items}
    for w in m.plan.workers:
        st = states.get(w.name, {})
        item = listed.get((w.role.value, w.index))
        # a draining worker's own health says "draining" already
        routed = "not routed" if item is None else \
            f"{'was routed' if item.get('draining') else 'routed'} ({item.get('routed', 0)} requests)"
        visible = st.get("cuda_visible_devices")
        components.append({"component": f"{w.name} ({w.pool})" if w.pool else w.name,
                           "node": st.get("node", f"n{w.nodes[0]}"),
                           "gpus": w.gpu_text() + (f" (visible {visible})" if visible else ""),
                           # a failure its role's policy restarts: the job goes on, the worker comes back
                           "phase": st.get("phase", "not started") + (" (restarting)" if st.get("restarting") else ""),
                           "health": f"{_health((st.get('http') or '') + '/health' if st.get('http') else None)}, "
                                     f"{routed}", "restarts": st.get("restarts", 0)})
    roles = {}
    for role, spec in m.recipe.roles.items():
        n = (frontend_view.get("live") or {}).get(role.value, 0)
        leaving = sum(1 for i in (frontend_view.get("instances") or {}).get(role.value, []) if i.get("draining"))
        roles[role.value] = {"live": n, "expected": spec.total_count, "draining": leaving,
                             "state": "ok" if n >= spec.total_count else
                             "degraded" if n else "draining" if leaving else "down"}
    smoke = read_json(run.layout.smoke)
    ready = read_json(run.layout.ready)
    from hpc.checks.ready import failed_for_good, log_tail

    # what a component that failed for good said last; a worker's ranks share one log
    gone = sorted({name.split(".rank")[0] for name in failed_for_good(states)})
    failed = {name: log_tail(m, name, lines=8) for name in gone}
    scheduler = _slurm_state(run)
    # queued again after it had started (preemption, a failed node, scontrol requeue): a new start will record
    # itself and move these states under previous/; until then they are its last start's
    scheduler["requeued"] = scheduler["state"] == "PENDING" and bool(run.job().get("started_at"))
    job_id = run.job_id()
    again = run.resubmitted()
    return {"run": run.name, "chain": _chain_lines(run), "run_dir": str(run.path), "recipe": m.recipe.name,
            "cluster": m.cluster.name,
            "job_id": job_id, "scheduler": scheduler, "endpoint": endpoint,
            "preflight": _preflight_summary(run.preflight(job_id)),
            "resubmitted": None if str(again.get("job_id")) != job_id else {
                **again, "bad_nodes": run.preflight(str(again.get("from_job"))).get("bad_nodes", {})},
            "ready": ready, "roles": roles, "components": components, "router": frontend_view.get("router"),
            "failed_logs": failed,
            "smoke": None if smoke is None else {"passed": smoke["passed"],
                                                 "failed": [c["name"] for c in smoke["checks"] if not c["ok"]]}}


def _chain_lines(run: RunDir) -> list[str]:
    """A chain's links, each job's state asked of Slurm in one query."""
    chain = run.chain()
    if chain is None:
        return []
    from hpc.launch.chain import chain_lines
    from hpc.launch.slurm import runner_for
    from hpc.slurm.client import SlurmClient

    ids = [job for link in chain.links() for job in chain.job_ids(link)[-1:]]
    found = SlurmClient(runner_for(run)).statuses(ids) if ids else {}
    return chain_lines(chain, lambda job_id: getattr(found.get(job_id), "state", None))


def _preflight_summary(found: dict[str, Any]) -> dict[str, Any] | None:
    """A job's preflight on its nodes (hpc.checks.node_health): how long, how many nodes, which were bad."""
    if not found:
        return None
    return {"seconds": found.get("seconds"), "nodes": len(found.get("nodes") or {}),
            "bad_nodes": found.get("bad_nodes") or {}}


def _preflight_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    again = data.get("resubmitted")
    if again:
        why = bad_nodes_text(again["bad_nodes"])
        lines.append(f"resubmitted: job {again['from_job']}'s preflight left out {again['excluded']}"
                     + (f" ({why})" if why else "") + f"; this is job {again['job_id']} "
                     "(preflight.on_bad_node: exclude)")
    pre = data.get("preflight")
    if pre:
        bad = bad_nodes_text(pre["bad_nodes"])
        lines.append(f"preflight: {pre['nodes']} nodes in {pre['seconds']} s, " + (f"failed ({bad})" if bad else "ok"))
    return lines


def _print_status(data: dict[str, Any]) -> None:
    sch = data["scheduler"]
    print(f"run {data['run']}  recipe {data['recipe']}  cluster {data['cluster']}  job {data['job_id']}")
    shown = ("elapsed", "time_left", "nodes", "reason", "expected_start", "processes")
    extra = "  ".join(f"{k.replace('_', ' ')} {v}" for k, v in sch.items() if k in shown and v)
    print(f"state: {sch['state']}  {extra}")
    for step in sch.get("failed_steps") or []:
        print(f"failed step: {step}")
    if sch.get("why"):
        print(sch["why"])
    if sch.get("requeued"):
        print("requeued: Slurm put the job back in its queue after it had started (preemption, a failed node, "
              "scontrol requeue); it starts again from the top, and what follows is its last start")
    for line in [*data["chain"], *_preflight_lines(data)]:
        print(line)
    if data["endpoint"]:
        print(f"endpoint: {data['endpoint']}/v1")
    if data["ready"]:
        print(f"readiness{' (last start)' if sch.get('requeued') else ''}: {_readiness(data['ready'])}")
    roles = ", ".join(f"{r} {v['live']}/{v['expected']} {v['state']}" for r, v in data["roles"].items())
    print(f"roles: {roles}")
    router = data.get("router")
    if router:
        line = f"router: {router['policy']}"
        if "prompt_blocks" in router:
            share = router["cached_blocks"] / router["prompt_blocks"] if router["prompt_blocks"] else 0.0
            line += (f", prompt blocks found cached {router['cached_blocks']}/{router['prompt_blocks']} ({share:.0%})"
                     + (f", {router['indexed_blocks']} blocks indexed" if "indexed_blocks" in router else "")
                     + (", index stale (routing by load)" if router["stale"] else ""))
        print(line)
        for pair in router.get("kv_pairs") or []:  # KV transfers past their deadline, by pair
            print(f"  kv transfers {pair['prefill']} -> {pair['decode']}: {pair['timeouts']} timed out, "
                  f"{pair['retried']} retried on another pair"
                  + (f"; out of routing for {pair['benched_s']:.0f} s more" if pair["benched_s"] else
                     "; serving again" if not pair.get("in_a_row") else ""))
        for pool in router.get("pools") or []:  # the global router: where requests went, and why
            why = ", ".join(f"{reason} {n}" for reason, n in sorted(pool["chosen_by"].items())) or "-"
            print(f"  pool {pool['role']}/{pool['pool']}: live {pool['live']}, routed {pool['routed']}, "
                  f"moved on {pool['retried_away']} (chosen by: {why})")
    rows = [[c["component"], c["node"], c.get("gpus", "-"), c["phase"], c["health"], c.get("restarts", "")]
            for c in data["components"]]
    print(table(["COMPONENT", "NODE", "GPUS", "PHASE", "HEALTH", "RESTARTS"], rows))
    for name, tail in data["failed_logs"].items():
        print(f"{name} failed; the last lines of its log (hpc logs {data['job_id'] or data['run']} "
              f"--component {name}):\n{tail}")
    smoke = data["smoke"]
    print("smoke: " + ("not run" if smoke is None else "PASSED" if smoke["passed"]
                       else f"FAILED ({', '.join(smoke['failed'])})"))


def _readiness(ready: dict[str, Any]) -> str:
    """`ready in 8.6 s (etcd healthy 2.0 s, ...)`: each step's seconds since submission, in the order they came."""
    seconds = {name: s for name, s in (ready.get("seconds") or {}).items() if isinstance(s, (int, float))}
    steps = ", ".join(f"{name} {s:.1f} s" for name, s in sorted(seconds.items(), key=lambda item: item[1])
                      if name != "ready")
    if ready.get("ready") and "ready" in seconds:
        head = f"ready in {seconds['ready']:.1f} s"
    else:
        head = f"not ready (last step reached: {ready.get('phase') or 'none'})"
    gave_up = f"; the launch gave up: {ready['gave_up']}" if ready.get("gave_up") and not ready.get("ready") else ""
    return head + (f" ({steps})" if steps else "") + gave_up


def status(args: argparse.Namespace) -> int:
    if args.run is None:
        runs = list_runs()[:20]
        states = _listed_states(runs)
        rows = []
        for run in runs:
            info = run.run_info()
            smoke = read_json(run.layout.smoke)
            rows.append([run.name, info.cluster or "?", run.job_id() or "-",
                         states[run.path], "-" if smoke is None else ("pass" if smoke["passed"] else "FAIL")])
        print(table(["RUN", "CLUSTER", "JOB", "STATE", "SMOKE"], rows) if rows else "no runs yet")
        return 0
    run = find_run(args.run)
    while True:
        data = collect_status(run)
        if args.json:
            print(json.dumps(data, indent=2, default=str))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            _print_status(data)
        if not args.watch:
            return 0
        time.sleep(2)


# ---- logs, cancel, smoke -------------------------------------------------------------------------------
def logs(args: argparse.Namespace) -> int:
    run = find_run(args.run)
    if args.request:
        return _request_lines(run, args.request)
    if args.component is None:
        files = _log_files(run)
        if not files and run.submitted():  # a job that ended without any: why, when Slurm's state tells
            why = _slurm_state(run).get("why")
            if why:
                print(why)
                return 0
        print(table(["LOG", "BYTES"], [[f.name, f.stat().st_size] for f in files]) if files else "no logs yet")
        print(f"show one: hpc logs {run.path.name} --component frontend")
        return 0
    name = args.component
    if name in ("agg", "prefill", "decode", "encode"):
        name = f"{name}-{args.index}"
    path = run.logs / ("job.out" if name == "job" else f"{name}.log")
    plan = run.manifest().plan
    known = {s.name for s in plan.services} | {w.name for w in plan.workers} | {"job", "preflight", "ready", "smoke"}
    if not path.is_file() and (name not in known or not args.follow):
        have = ", ".join(sorted(p.stem for p in run.logs.glob("*.log"))) or "none yet"
        what = "no log yet for" if name in known else "no component"
        raise UserError(f"{what} '{name}' in {run.path.name}", hint=f"logs: {have}")
    try:
        if not path.is_file():  # a component of this run whose step has not started: -f waits for it
            print(f"waiting for {name}'s log ({path}); Ctrl-C stops", file=sys.stderr, flush=True)
            while not path.is_file():
                time.sleep(0.2)
        lines = path.read_text(errors="replace").splitlines()
        print("\n".join(lines[-args.lines:]))
        if args.follow:
            _follow(path)
    except KeyboardInterrupt:
        return 0
    return 0


def _follow(path: Path) -> None:
    """tail -F: new lines as they come; a step that starts again rewrites its log from the top."""
    with path.open(errors="replace") as handle:
        handle.seek(0, 2)
        while True:
            line = handle.readline()
            if line:
                sys.stdout.write(line)
                sys.stdout.flush()
            elif path.stat().st_size < handle.tell():  # truncated by the step's restart: read it anew
                handle.seek(0)
            else:
                time.sleep(0.2)


def _log_files(run: RunDir) -> list[Path]:
    """The run's logs: each component's, then Slurm's job output."""
    return sorted(run.logs.glob("*.log")) + sorted(run.logs.glob("*.out"))


REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{2,127}")


def _request_id(text: str) -> str:
    """A response's id (cmpl-..., chatcmpl-...): an empty or blank one would match every line."""
    if not REQUEST_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"'{shown(text, 60)}' is not a request id: letters, digits and . _ : -, "
                                         "3 to 128 (the response's id, e.g. cmpl-3f2a...)")
    return text


def _request_lines(run: RunDir, request_id: str) -> int:
    """One request's trace: the frontend's line for a request it could not serve, and each worker's."""
    files = _log_files(run)
    found = [f"{path.stem:<12} {line}" for path in files
             for line in path.read_text(errors="replace").splitlines() if request_id in line]
    if not found:
        print(f"no log line of {run.path.name} names {request_id} (a request served without a failure leaves "
              f"none; searched {len(files)} logs)")
        return 1
    print("\n".join(found))
    return 0


class DrainWatch:
    """hpc cancel's first tier, watched (it is the `drained` check the cancel polls): how long the workers took to
    finish what they served, or which were still serving when the grace period ended and TERM cut them."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.asked: float | None = None  # the first poll: the drain signal has just been sent
        self.took: float | None = None
        self.serving: list[str] = []

    def __call__(self) -> bool:
        now = time.monotonic()
        self.asked = now if self.asked is None else self.asked
        self.serving = self.run.workers_serving()
        if not self.serving and self.took is None:
            self.took = now - self.asked
        return not self.serving

    def summary(self, grace_s: float) -> str:
        if self.asked is None:
            return ""  # nothing was serving to drain (a job not running yet)
        if self.took is not None and self.took < 0.05:
            return " (workers drained at once: nothing was in flight)"
        if self.took is not None:
            return f" (workers drained in {self.took:.1f} s)"
        return (f"\nthe grace period ({grace_s:g} s) ended with {', '.join(self.serving)} still serving: what "
                f"{'it' if len(self.serving) == 1 else 'they'} held was cut (a longer --grace lets it finish)")


def cancel(args: argparse.Namespace) -> int:
    from hpc.launch.backends import of_run

    run = find_run(args.run)
    if not run.submitted():
        raise UserError(f"run {run.name} was never submitted; nothing to cancel")

    def cancel_one(link: RunDir):
        drain = DrainWatch(link)
        done = of_run(link).cancel(link, args.grace, drain)
        link.update_run_info(cancelled_at=time.time())
        print(done.line + drain.summary(args.grace))
        return done

    chain = run.chain()
    if chain is None:
        ended = [cancel_one(run)]
    else:  # all of it: no link queues another, and every link with a job ends
        from hpc.launch.chain import cancel_chain

        ended = cancel_chain(chain, cancel_one)
    stopped = all(done.stopped for done in ended)
    if args.remove:
        where = run.path if chain is None else chain.path
        if stopped:
            _remove(where)
        else:
            print(f"kept {where}: it has not stopped yet")
    return 1 if any(done.left for done in ended) else 0


def _remove(path: Path) -> None:
    """Only when asked (--remove): a run directory holds the job's logs and every bench result of the run."""
    import shutil

    shutil.rmtree(path, ignore_errors=True)
    print(f"removed {path}")


def endpoint(args: argparse.Namespace) -> int:
    import asyncio

    from hpc.launch.endpoint import serve

    run = find_run(args.run)
    target = run.chain() or run

    def started(port: int, _endpoint) -> None:
        what = f"the chain {target.path.name}, whichever job serves" if target is not run else f"run {run.name}"
        print(f"hpc endpoint: http://{args.host}:{port}/v1 -> {what} (Ctrl-C stops it)", flush=True)

    try:
        asyncio.run(serve(target, args.host, args.port, float(args.retry), started))
    except OSError as exc:
        raise UserError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", field="--port",
                        hint="choose a free port, or --port 0 for any") from None
    return 0


def smoke(args: argparse.Namespace) -> int:
    from hpc.launch.backends import of_run
    from hpc.launch.smoke import submit_smoke
    from hpc.checks.smoke import print_verdict

    run = find_run(args.run)
    verdict = submit_smoke(run, of_run(run))
    print_verdict(verdict)
    return 0 if verdict["passed"] else 1


def model(args: argparse.Namespace) -> int:
    from hpc.runtime.engine.builds import build_kind

    t0 = time.monotonic()
    out = build_kind(args.out, args.kind)
    print(f"built {args.kind} model in {out} ({time.monotonic() - t0:.1f} s)")
    return 0


def dev_cluster(args: argparse.Namespace) -> int:
    import subprocess

    from hpc.spec.catalog import project_root

    script = project_root() / "scripts" / "dev-cluster.sh"
    return subprocess.call(["bash", str(script), args.action, *args.args])
