"""The real stack on the dev cluster: launch, smoke, requests from the host, TP over MPI, faults, cancel."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpc.cli.main import main
from hpc.rundir import RunDir, list_runs, read_json
from hpc.waiting import wait_until
from hpc.checks.probe import get_json, get_text, metric_values, post_json, post_sse
from hpc.runtime.engine.kv.nixl import nixl_available
from tests.slurm.conftest import DEV, dev_cluster_file, frontend_port

pytestmark = pytest.mark.slurm
LAB = Path(DEV["slurm_conf"]).parents[1]


def _launch(*args: str) -> RunDir:
    code = main(["launch", *args, "--set", frontend_port()])
    run = list_runs()[0]  # the newest
    if code != 0:
        main(["cancel", run.path.name, "--grace", "1"])
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(run.logs.glob("*")))
        pytest.fail(f"launch failed:\n{logs}")
    return run


def _url(run: RunDir) -> str:
    url = run.frontend_url()
    assert url is not None, "the frontend said where it listens"
    return url


def _node_processes() -> dict[str, list[str]]:
    """Every process left in each node's namespace apart from slurmd itself."""
    left = {}
    for ns in sorted(p.name for p in Path("/run/netns").glob("hpc-node*")):
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        names = []
        for pid in pids:
            try:
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                state = Path(f"/proc/{pid}/stat").read_text().split()[2]
            except OSError:
                continue
            if comm != "slurmd" and state != "Z":
                names.append(f"{pid}:{comm}")
        left[ns] = names
    return left


def _cancel_and_check_clean(run: RunDir, capsys=None) -> None:
    job = run.job_id()
    assert main(["cancel", job]) == 0
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_node_processes().values()):
        time.sleep(0.2)
    assert not any(_node_processes().values()), _node_processes()
    from hpc.cli.runtime_commands import _slurm_state

    assert _slurm_state(run)["state"] == "CANCELLED"
    # the run directory stays until asked for: the job's logs are there
    assert any(run.logs.glob("*.log"))
    assert main(["cancel", job, "--remove"]) == 0
    assert not run.path.exists()


def _complete(url: str, model: str, prompt: str = "Hello from the host", n: int = 16):
    status, body = post_json(url + "/v1/completions", {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": n,
                                                       "ignore_eos": True})
    assert status == 200, body
    return body["choices"][0]["text"]


def test_tiny_disagg_as_planned_with_smoke_and_clean_cancel(slurm_env, tmp_path):
    run = _launch("-c", "dev", "-r", "tiny-disagg")
    smoke = json.loads((run.path / "smoke.json").read_text())
    assert smoke["passed"], smoke
    assert run.run_info().smoke_job_id  # it ran as a submitit job
    states = run.component_states()
    assert {states[c]["node"] for c in ("etcd", "nats", "frontend")} == {"node1"}
    assert states["prefill-0"]["node"] == "node2" and states["decode-0"]["node"] == "node3"
    url = _url(run)
    assert url.startswith("http://10.77.0.11:")  # bound to node1's own address, reached from the host
    assert _complete(url, "hpc/tiny")
    # the load generator in a job of the cluster's own (hpc bench --in-job): a node sent the requests, not this host
    assert main(["bench", run.job_id(), "--in-job", "--concurrency", "2", "--requests", "8", "--warmup", "0"]) == 0
    (results,) = run.path.glob("bench/*/results.json")
    bench = json.loads(results.read_text())
    assert bench["client"]["host"] in {"node1", "node2", "node3"} and bench["levels"][0]["completed"] == 8
    _cancel_and_check_clean(run)


def test_cancel_lets_the_disaggregated_stream_in_flight_finish(slurm_env, capsys):
    """hpc cancel's first tier: the decode worker serving a stream drains, and the frontend keeps its connection
    until the stream has ended (it was cut with an error before). Mock engines: a token each 40 ms, so the stream
    outlasts the 5 s the frontend keeps workers that all leave discovery at once."""
    run = _launch("-c", "dev", "-r", "tiny-disagg", "--set", "backend=mock", "--set", "mock.per_token_delay_ms=40")
    stream = post_sse(_url(run) + "/v1/completions", {"model": "hpc/tiny", "prompt": "A long answer", "max_tokens": 200,
                                                      "ignore_eos": True, "stream": True}, timeout=60)
    events = [next(stream)]
    started = time.time()
    cancelled = threading.Thread(target=main, args=(["cancel", run.job_id()],))
    cancelled.start()
    events += list(stream)
    ended = time.time()
    cancelled.join(60)
    assert not cancelled.is_alive()
    phases = {name: run.component_states()[name]["phases"] for name in ("prefill-0", "decode-0")}
    assert events[-1].get("choices", [{}])[0].get("finish_reason") == "length", events[-1]
    assert sum(1 for e in events if e["choices"][0]["text"]) == 200
    assert ended - started > 6, "the stream went on for seconds after the cancel began"
    assert started < phases["decode-0"]["draining"] < ended - 1 < phases["decode-0"]["drained"], phases
    said = re.search(r"job \d+: CANCELLED \(workers drained in ([0-9.]+) s\)", capsys.readouterr().out)
    assert said and float(said.group(1)) > 5, "the cancel waited for the stream, and said so"
    _cancel_and_check_clean(run)


@pytest.mark.skipif(not nixl_available(), reason="needs the nixl extra (nixl-cu13)")
def test_kv_crosses_nodes_over_nixl_tcp(slurm_env):
    """Prefill on node2, decode on node3, the KV READ over NIXL with UCX held to TCP between the nodes' namespaces
    (shared memory would work too: every dev node shares this host's /dev/shm, unlike real nodes)."""
    prompts = ["The capital of France is", "def main():", "word " * 200]
    run = _launch("-c", "dev", "-r", "tiny-disagg", "--no-smoke")
    ref = [_complete(_url(run), "hpc/tiny", p, 16) for p in prompts]
    _cancel_and_check_clean(run)
    run = _launch("-c", "dev", "-r", "tiny-disagg", "--no-smoke", "--set", "runtime.kv_transport=nixl",
                  "--set", "roles.prefill.env.UCX_TLS=tcp", "--set", "roles.decode.env.UCX_TLS=tcp")
    states = run.component_states()
    assert states["prefill-0"]["node"] == "node2" and states["decode-0"]["node"] == "node3"
    assert [_complete(_url(run), "hpc/tiny", p, 16) for p in prompts] == ref

    def metric(worker: str, name: str) -> float:
        return metric_values(get_text(states[worker]["http"] + "/metrics"), name)

    assert metric("decode-0", "hpc_worker_kv_fetched_nixl") >= len(prompts)  # readiness' warm-up fetched too
    assert metric("prefill-0", "hpc_worker_kv_lent_nixl") == metric("decode-0", "hpc_worker_kv_fetched_nixl")
    assert metric("decode-0", "hpc_worker_kv_fetched_bytes") == 0
    _cancel_and_check_clean(run)


def test_tiny_epd_on_dev(slurm_env):
    run = _launch("-c", "dev", "-r", "tiny-epd")
    smoke = json.loads((run.path / "smoke.json").read_text())
    assert smoke["passed"], smoke
    _cancel_and_check_clean(run)


def test_a_restarted_frontend_routes_by_the_caches_of_workers_on_other_nodes(slurm_env):
    """kv_aware with two workers on their own nodes: the frontend (node1) is SIGKILLed, its supervisor starts it
    again, and the workers resend their blocks over NATS: the prefix seated before goes to the same worker."""
    run = _launch("-c", "dev", "-r", "tiny-agg", "--no-smoke", "--set", "roles.agg.count=2",
                  "--set", "frontend.router=kv_aware")
    try:
        url, prefix = _url(run), list(range(100, 400))  # 9 full blocks of 32

        def ask(suffix: int) -> dict:
            code, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": prefix + [suffix],
                                                             "max_tokens": 2, "temperature": 0}, timeout=30)
            assert code == 200, body
            return body

        def router() -> dict:
            return get_json(url + "/health", 2.0)[1]["router"]

        ask(0)
        wait_until(lambda: router()["indexed_blocks"] >= 9, 10, "the prefix's blocks indexed")
        states = run.component_states()
        assert {states["agg-0"]["node"], states["agg-1"]["node"]}.isdisjoint({states["frontend"]["node"]})
        os.kill(states["frontend"]["pid"], signal.SIGKILL)  # the serving process; the nodes share the PIDs

        def again() -> bool:
            state = run.component_states()["frontend"]
            try:
                return state["phase"] == "ready" and state["restarts"] == 1 and router()["indexed_blocks"] >= 9
            except OSError:  # not listening yet
                return False
        wait_until(again, 60, "the frontend serving again with the workers' blocks indexed")
        assert [ask(i)["usage"]["prompt_tokens_details"]["cached_tokens"] for i in (1, 2, 3)] == [288] * 3
        routed = sorted(i["routed"] for i in get_json(url + "/health", 2.0)[1]["instances"]["agg"])
        assert routed == [0, 3], routed
    finally:
        _cancel_and_check_clean(run)


def test_tp2_worker_spanning_two_nodes_matches_tp1(slurm_env, tmp_path):
    one_gpu_nodes = dev_cluster_file(tmp_path, gpus_per_node=1)
    prompts = ["The capital of France is", "def main():", "Slurm schedules"]
    run1 = _launch("-c", "dev", "-r", "tiny-agg", "--no-smoke")
    ref = [_complete(_url(run1), "hpc/tiny", p, 24) for p in prompts]
    _cancel_and_check_clean(run1)
    run2 = _launch("-c", one_gpu_nodes, "-r", "tiny-agg", "--no-smoke",
                   "--set", "roles.agg.tensor_parallel_size=2")
    w = run2.manifest().plan.workers[0]
    assert w.tasks == 2 and w.nodes == [1, 2]
    ranks = {json.loads(p.read_text())["node"] for p in run2.state.glob("agg-0*.json")}
    assert ranks == {"node2", "node3"}
    got = [_complete(_url(run2), "hpc/tiny", p, 24) for p in prompts]
    assert got == ref
    _cancel_and_check_clean(run2)


def test_killed_decode_worker_under_load_recovers(slurm_env):
    run = _launch("-c", "dev", "-r", "tiny-disagg", "--no-smoke", "--set", "roles.decode.count=2",
                  "--set", "roles.decode.failure.on_failure=restart")
    url = _url(run)
    results: list[str] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                events = list(post_sse(url + "/v1/completions", {"model": "hpc/tiny", "prompt": "load",
                                                                 "temperature": 0, "max_tokens": 32, "ignore_eos": True,
                                                                 "stream": True}, timeout=20))
                results.append("error" if any("error" in e for e in events) else "ok")
            except Exception as exc:  # a hung request would show up as a timeout here
                results.append(f"exception {type(exc).__name__}")

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = json.loads((run.state / "decode-0.json").read_text())
    os.kill(victim["pid"], signal.SIGKILL)  # the nodes share one PID namespace
    t_kill = time.monotonic()
    dropped_after = None
    while time.monotonic() - t_kill < 5:
        live = get_json(url + "/health")[1]["live"]
        if live.get("decode") == 1 and dropped_after is None:
            dropped_after = time.monotonic() - t_kill
        if dropped_after is not None:
            break
        time.sleep(0.02)
    # with policy 'restart' a new instance registers
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and get_json(url + "/health")[1]["live"].get("decode") != 2:
        time.sleep(0.1)
    restarted = get_json(url + "/health")[1]["live"].get("decode") == 2
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a client request hung"
    assert dropped_after is not None and dropped_after <= 2.0, dropped_after
    assert restarted
    assert all(r in ("ok", "error") for r in results), results  # no hangs, no timeouts
    assert results.count("error") <= 4 and results.count("ok") >= 4
    assert json.loads((run.state / "decode-0.json").read_text())["restarts"] == 1
    print(f"kill -> out of routing {dropped_after:.3f} s; {results.count('error')} of {len(results)} streams "
          f"ended with an error event")
    _cancel_and_check_clean(run)


def test_a_tp2_worker_restarts_as_a_unit(slurm_env, tmp_path):
    """One rank of a TP=2 worker killed: srun ends its sibling (--kill-on-bad-exit) and the script starts both
    ranks again, which form a new group and serve."""
    one_gpu_nodes = dev_cluster_file(tmp_path, gpus_per_node=1)
    run = _launch("-c", one_gpu_nodes, "-r", "tiny-agg", "--no-smoke", "--set", "roles.agg.tensor_parallel_size=2",
                  "--set", "roles.agg.failure.on_failure=restart", "--set", "roles.agg.failure.max_restarts=2")
    url = _url(run)
    before = {p.name: json.loads(p.read_text())["pid"] for p in run.state.glob("agg-0*.json")}
    assert set(before) == {"agg-0.json", "agg-0.rank1.json"}
    os.kill(before["agg-0.rank1.json"], signal.SIGKILL)

    def pids_now() -> dict[str, int]:
        return {p.name: json.loads(p.read_text()).get("pid") for p in run.state.glob("agg-0*.json")}

    # generous: both ranks import torch, form a new group and warm up again, on a CI machine of two cores that
    # also runs the dev cluster (60 s was once too short there); the test is about the restart, not its speed
    deadline = time.monotonic() + 150
    while time.monotonic() < deadline:
        now = pids_now()
        fresh = all(now.get(k) not in (None, v) for k, v in before.items())
        if fresh and json.loads((run.state / "agg-0.json").read_text()).get("phase") == "ready":
            break
        time.sleep(0.2)
    now = pids_now()
    assert all(now[k] != v for k, v in before.items()), (before, now)  # both ranks are new processes
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and get_json(url + "/health")[1]["live"].get("agg") != 1:
        time.sleep(0.2)
    assert _complete(url, "hpc/tiny", "after the restart", 8)
    assert "restarting all its ranks (1 of 2)" in (run.logs / "job.out").read_text()
    log = (run.logs / "agg-0.log").read_text()  # both attempts' lines: the failed one's are why it restarted
    assert log.count("TP rank 0 of 2") == 2  # rank 0 started twice, and its first start is still there
    _cancel_and_check_clean(run)


def test_a_rank_killed_while_the_job_comes_up_is_restarted_not_the_jobs_failure(slurm_env, tmp_path):
    """The job's own readiness wait sees a rank fail before the worker registered: its role's policy (restart)
    starts both ranks again, so readiness waits for them (the failed rank's state says `restarting`) instead of
    ending the job, which then serves."""
    one_gpu_nodes = dev_cluster_file(tmp_path, gpus_per_node=1)
    run = _launch("-c", one_gpu_nodes, "-r", "tiny-agg", "--no-wait", "--no-smoke", "--set",
                  "roles.agg.tensor_parallel_size=2", "--set", "roles.agg.failure.on_failure=restart",
                  "--set", "roles.agg.failure.max_restarts=2")
    try:
        rank1 = run.state / "agg-0.rank1.json"
        # with its weights loaded, as rank 0 warms up (and before it registers): rank 0's next collective fails, so
        # it reports itself failed while the job's readiness still waits for the worker
        wait_until(lambda: "weights_loaded" in (read_json(rank1) or {}).get("phases", {}), 120,
                   "rank 1 loaded")
        first = read_json(rank1)["pid"]
        os.kill(first, signal.SIGKILL)

        def ready() -> bool | None:
            out = (run.logs / "job.out").read_text() if (run.logs / "job.out").exists() else ""
            assert "not ready" not in out, out[-3000:]
            return (read_json(run.state / "ready.json") or {}).get("ready")
        wait_until(ready, 200, "the job ready after its worker's restart")
        assert read_json(rank1)["pid"] != first
        assert "restarting all its ranks (1 of 2)" in (run.logs / "job.out").read_text()
        assert _complete(_url(run), "hpc/tiny", "after the restart", 8)
    except BaseException:
        main(["cancel", run.run_info().job_id, "--grace", "1"])  # nothing left to hold the next test's ports
        raise
    _cancel_and_check_clean(run)


def test_global_router_pools_on_dev_route_by_grid_and_survive_a_killed_pool(slurm_env):
    """Seed 003 on the dev cluster: 2 prefill + 2 decode pools (tiny-pools); requests land where the grid and the
    priority rules say (per-pool counters), and with the bulk decode pool killed under load no request that had
    not started streaming is lost: the fast pool takes them."""
    run = _launch("-c", "dev", "-r", "tiny-pools", "--set", "roles.decode.failure.on_failure=continue")
    assert json.loads((run.path / "smoke.json").read_text())["passed"]
    url = _url(run)
    pools = lambda: {p["pool"]: p for p in get_json(url + "/health")[1]["router"]["pools"]}  # noqa: E731
    short, long = list(range(100, 110)), list(range(100, 400))
    cases = [(short, {}, {"prefill-bulk", "decode-bulk"}),
             (long, {"extra_args": {"ttft_target": 50, "itl_target": 10}}, {"prefill-fast", "decode-fast"}),
             (short, {"nvext": {"agent_hints": {"priority": 50}}}, {"prefill-fast", "decode-fast"}),
             (long, {"extra_args": {"ttft_target": 20}}, {"prefill-fast", "decode-bulk"})]
    texts = set()
    for prompt, fields, expected in cases:
        before = pools()
        status, body = post_json(url + "/v1/completions", {"model": "hpc/tiny", "prompt": prompt, "max_tokens": 8,
                                                           "temperature": 0, "ignore_eos": True, **fields})
        assert status == 200, body
        after = pools()
        assert {p for p in after if after[p]["routed"] > before[p]["routed"]} == expected, fields
        if prompt is long:
            texts.add(body["choices"][0]["text"])
    assert len(texts) == 1  # prefill on node n0, decode on n1, across pools: the same greedy answer
    states = run.component_states()
    assert states["prefill-0"]["node"] != states["decode-1"]["node"]  # the KV crossed nodes between pools

    results: list[str] = []
    stop = threading.Event()

    def client() -> None:  # short prompts, default targets: the bulk pools by the grid
        while not stop.is_set():
            try:
                events = list(post_sse(url + "/v1/completions", {"model": "hpc/tiny", "prompt": short, "stream": True,
                                                                 "temperature": 0, "max_tokens": 24,
                                                                 "ignore_eos": True}, timeout=20))
            except Exception as exc:
                results.append(f"exception {type(exc).__name__}")
                continue
            started = any(e.get("choices") and e["choices"][0].get("text") for e in events if isinstance(e, dict))
            failed = any("error" in e for e in events if isinstance(e, dict))
            results.append("ok" if not failed else "error after streaming" if started else "lost")

    threads = [threading.Thread(target=client) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    before = pools()
    os.kill(json.loads((run.state / "decode-1.json").read_text())["pid"], signal.SIGKILL)  # decode-bulk's worker
    time.sleep(3.0)
    stop.set()
    for t in threads:
        t.join(30)
    after = pools()
    assert not any(t.is_alive() for t in threads), "a client request hung"
    assert "lost" not in results and not any(r.startswith("exception") for r in results), results
    assert results.count("ok") >= 8, results
    assert after["decode-bulk"]["live"] == 0
    assert after["decode-fast"]["routed"] - before["decode-fast"]["routed"] >= 4  # the bulk pool's requests
    print(f"pooled on dev: {len(results)} streams, {results.count('error after streaming')} ended with an error "
          f"after streaming began; decode-bulk moved on {after['decode-bulk']['retried_away']}")
    _cancel_and_check_clean(run)


def test_profile_on_dev_in_one_allocation_and_its_recipe_launches(slurm_env, tmp_path, capsys):
    """hpc profile of tiny-disagg, TP 1 and 2, on the dev cluster: every engine in one job (6 GPUs over the 3
    nodes), every point valid, and the recipe it writes launches there and passes smoke."""
    out = tmp_path / "profile"
    code = main(["profile", "-c", "dev", "-r", "tiny-disagg", "--isl", "64", "--osl", "16", "--ttft", "500",
                 "--itl", "100", "--tp", "1,2", "--max-concurrency", "4", "--requests", "8", "--out", str(out),
                 "--set", frontend_port()])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert printed.count("submitted job") == 1  # one allocation for every engine of every size
    results = json.loads((out / "profile.json").read_text())
    assert len(results["points"]) == 2 * 4 + 2 * 3 and all(p["valid"] for p in results["points"].values())
    assert {p["tp"] for p in results["points"].values()} == {1, 2}
    job_nodes = {json.loads(p.read_text())["node"] for p in (list_runs()[0].state).glob("*-*.json")}
    assert len(job_nodes) == 3, job_nodes
    run = _launch("-c", "dev", "-r", str(out / "recipe.yaml"))
    assert json.loads((run.path / "smoke.json").read_text())["passed"]
    _cancel_and_check_clean(run)


def test_tiny_video_on_dev_with_cfg_parallel_ranks(slurm_env):
    """seed 004 on the dev cluster: the video worker's two CFG ranks are one srun step (MPI over PMIx), smoke
    decodes the videos it made (URL and inline)."""
    run = _launch("-c", "dev", "-r", "tiny-video", "--set", "diffusion.dit_cfg_size=2",
                  "--set", "roles.agg.tensor_parallel_size=2")
    smoke = json.loads((run.path / "smoke.json").read_text())
    assert smoke["passed"], smoke
    assert {c["name"] for c in smoke["checks"]} >= {"video_url", "video_b64_json"}
    ranks = sorted(p.name for p in run.state.glob("agg-0*.json"))
    assert ranks == ["agg-0.json", "agg-0.rank1.json"], ranks
    log = (run.logs / "agg-0.log").read_text()
    assert "rank 0 of 2 (cfg 0/2" in log and "rank 1 of 2 (cfg 1/2" in log
    _cancel_and_check_clean(run)


def _frontend_processes() -> tuple[list[tuple[str, str, list[bytes]]], list[tuple[str, str, list[bytes]]]]:
    """The frontend's processes on the nodes, (namespace, pid, argv): those serving, and their supervisors."""
    serving, supervisors = [], []
    for ns, names in _node_processes().items():
        for pid in (entry.split(":")[0] for entry in names):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[1:3] == [b"-m", b"hpc.runtime.frontend"]:  # not the srun that started it
                (serving if b"--attempt" in argv or b"--replica" in argv else supervisors).append((ns, pid, argv))
    return serving, supervisors


def test_a_frontend_of_two_processes_in_one_slurm_step(slurm_env, tmp_path):
    """frontend.processes on Slurm: the step gets a CPU per process (an exclusive node here), both serve the
    port inside the node's namespace; when process 0 dies the step's supervisor starts the frontend again (both
    processes, the same port) and the job goes on; cancelling the job leaves none behind."""
    whole_nodes = dev_cluster_file(tmp_path, exclusive=True)
    run = _launch("-c", whole_nodes, "-r", "mock-agg", "--no-smoke", "--set", "frontend.processes=2")
    try:
        assert "--cpus-per-task=2" in next(line for line in (run.path / "job.sbatch").read_text().splitlines()
                                            if "--job-name=frontend" in line)
        serving, supervisors = _frontend_processes()
        assert len(serving) == 2 and len(supervisors) == 1, (serving, supervisors)
        assert {ns for ns, _, _ in serving + supervisors} == {"hpc-node1"}
        url, model = _url(run), run.manifest().recipe.model.served_name

        def spread() -> list[float]:
            for _ in range(24):  # a connection each: the kernel picks a process per connection
                _complete(url, model, n=2)
            text = get_text(url + "/metrics")
            return [sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("hpc_frontend_process_requests_total") and f'process="{i}"' in line)
                    for i in range(2)]
        per_process = spread()
        assert sum(per_process) == 24 and min(per_process) > 0, per_process

        (first,) = [pid for _, pid, argv in serving if b"--attempt" in argv]
        os.kill(int(first), signal.SIGKILL)  # the nodes share this machine's PIDs

        def again():
            state = run.component_states()["frontend"]
            return state if state["phase"] == "ready" and state["restarts"] == 1 else None
        wait_until(again, 60, "the frontend started again by its supervisor")
        serving, supervisors = _frontend_processes()
        assert len(serving) == 2 and len(supervisors) == 1 and first not in {pid for _, pid, _ in serving}, serving
        per_process = spread()  # counted from the new start
        assert sum(per_process) == 24 and min(per_process) > 0, per_process
        from hpc.cli.runtime_commands import _slurm_state

        assert _slurm_state(run)["state"] == "RUNNING"
    finally:
        _cancel_and_check_clean(run)


def test_a_dry_run_submitted_with_plain_sbatch_is_found_by_hpc_and_a_resubmit_starts_clean(slurm_env, capsys):
    from hpc.slurm.client import SlurmClient

    assert main(["launch", "-c", "dev", "-r", "tiny-agg", "--dry-run", "--set", frontend_port()]) == 0
    run = list_runs()[0]
    client = SlurmClient(slurm_env)
    jobs: list[str] = []
    try:
        _submit_twice(run, client, jobs, capsys)
    except BaseException:
        for job in jobs:  # nothing left to hold the next test's nodes and ports
            client.cancel(job, grace_s=1)
        raise
    # the second job moved the first one's states, endpoints and verdict aside before its services started
    (moved,) = (run.path / "previous").iterdir()
    assert moved.name.startswith(f"{jobs[0]}-") and (moved / "endpoints" / "frontend.json").is_file()
    assert (moved / "smoke.json").is_file() and (moved / "state" / "agg-0.json").is_file()
    assert json.loads((moved / "job.json").read_text())["job_id"] == jobs[0]
    _cancel_and_check_clean(run)


def _submit_twice(run: RunDir, client, jobs: list[str], capsys) -> None:
    from hpc.checks.ready import wait_ready

    for attempt in range(2):
        job = client.submit(run.script_path)  # the user's own sbatch, twice: the script is the whole job
        jobs.append(job)
        wait_ready(run.manifest(), timeout=180, progress=lambda s: None)
        assert run.job_id() == job and run.job()["submitted_by"] == "sbatch"  # the job's own record
        wait_until(lambda: read_json(run.path / "smoke.json"), 120, "the job's own smoke stage")
        capsys.readouterr()
        assert main(["status", job]) == 0  # found by the job id that only the job itself told the run directory
        out = capsys.readouterr().out
        assert "state: RUNNING" in out and "agg 1/1 ok" in out and "smoke: PASSED" in out, out
        assert _complete(_url(run), run.manifest().recipe.model.served_name)
        if attempt == 0:  # stopped, its run directory kept, and submitted again as it is
            assert main(["cancel", job, "--grace", "2"]) == 0
            def ended(job=job) -> bool:
                state = client.status(job)
                return state is None or state.finished
            wait_until(ended, 60, "the first job's end")


def test_a_profile_hpc_cluster_new_made_from_the_cluster_serves_on_it(slurm_env, tmp_path, capsys):
    import yaml

    out = tmp_path / "probed.yaml"
    assert main(["cluster", "new", "probed", "-p", "debug", "--out", str(out)]) == 0
    profile = yaml.safe_load(out.read_text())
    dev = {k: DEV[k] for k in ("partition", "nodes_available", "gpus_per_node", "cpus_per_node", "gpu_request", "mpi")}
    assert {k: profile[k] for k in dev} == dev  # what sinfo, srun and scontrol said is what dev.yaml was written as
    run = _launch("-c", str(out), "-r", "tiny-agg")
    assert json.loads((run.path / "smoke.json").read_text())["passed"]
    assert _complete(_url(run), "hpc/tiny")
    _cancel_and_check_clean(run)


def test_a_requeued_job_serves_again_and_status_tells_the_last_start_from_the_next(slurm_env, capsys):
    """Preemption or a failed node puts a started job back in the queue (same id): it starts from the top,
    moves its last start's states under previous/, and serves again."""
    run = _launch("-c", "dev", "-r", "tiny-agg")
    job, first = run.job_id(), run.job()["started_at"]
    subprocess.run(["scontrol", "requeue", job], check=True, env=os.environ)
    wait_until(lambda: _slurm_state(run)["state"] == "PENDING", 30, "the job queued again")
    capsys.readouterr()
    main(["status", job])
    out = capsys.readouterr().out
    assert "state: PENDING" in out and "requeued: Slurm put the job back in its queue" in out
    assert "readiness (last start): ready in" in out
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, env=os.environ)  # no wait
    wait_until(lambda: True if run.job().get("started_at", first) > first and
               (read_json(run.state / "ready.json") or {}).get("ready") else None, 90, "the job's second start ready")
    assert _complete(_url(run), "hpc/tiny")  # the new start's frontend: its allocation may hold other nodes
    assert (run.path / "previous").is_dir() and any((run.path / "previous").glob(f"{job}-*/state"))
    capsys.readouterr()
    main(["status", job])
    out = capsys.readouterr().out
    assert "state: RUNNING" in out and "requeued" not in out and "readiness: ready in" in out
    _cancel_and_check_clean(run)


def _slurm_state(run: RunDir) -> dict:
    from hpc.cli.runtime_commands import _slurm_state as state

    return state(run)
