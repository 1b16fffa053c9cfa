"""Serving past the time limit on the dev cluster: a chain of 3 jobs with a 1-minute limit under constant load
through `hpc endpoint`, zero failed requests across both handovers; hpc status shows the chain, hpc cancel ends
all of it. (The issue asks for 3-minute limits; one minute, Slurm's smallest, keeps CI short and tightens the
handover: each link is queued 35 s before its end and must be serving within them.)"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

from hpc.cli.main import main
from hpc.launch.endpoint import serve
from hpc.rundir import ChainDir, list_runs
from hpc.slurm.client import SlurmClient
from hpc.waiting import wait_until
from tests.slurm.conftest import frontend_port

pytestmark = pytest.mark.slurm


def _endpoint(chain: ChainDir) -> int:
    ready, bound = threading.Event(), []

    def run() -> None:
        asyncio.run(serve(chain, "127.0.0.1", 0, 30.0, lambda port, _e: (bound.append(port), ready.set())))

    threading.Thread(target=run, daemon=True).start()
    assert ready.wait(10)
    return bound[0]


def test_a_chain_of_three_jobs_serves_through_both_handovers_without_a_failed_request(slurm_env, capsys):
    argv = ["launch", "-c", "dev", "-r", "tiny-agg", "--chain", "3", "--handover", "35",
            "--set", "time_limit=00:01:00", "--set", "drain_before_end_s=0", "--set", "infra.placement=shared",
            "--set", frontend_port()]
    assert main(argv) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "one address for the whole chain: hpc endpoint" in out
    chain = list_runs()[0].chain()
    assert chain is not None and len(chain.links()) == 3
    port = _endpoint(chain)
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = json.dumps({"model": "hpc/tiny", "prompt": "the chain", "max_tokens": 4})
        while not stop.is_set():
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                results.append((response.status, response.getheader("X-Hpc-Run") or "-"))
            except OSError as exc:
                results.append((0, repr(exc)))
                conn.close()
            time.sleep(0.05)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: chain.serving().get("link") == 3, 150, "link 3 of the chain to serve")
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(70)
    failed = [r for r in results if r[0] != 200]
    assert failed == [], failed[:5]
    served_by = {name for _, name in results}
    assert served_by == {f"{chain.path.name}.{k}" for k in (1, 2, 3)}, served_by

    one, two, three = chain.links()
    client_ = SlurmClient(slurm_env)
    jobs = [link.job_id() for link in (one, two, three)]
    assert len(set(jobs)) == 3 and all(jobs)
    # the first two ended by handing over (exit 0), not at their limit, each off the node of the link before
    for link in (one, two):
        wait_until(lambda: client_.status(link.job_id()).finished, 60, f"job {link.job_id()} to end")
        assert client_.status(link.job_id()).state == "COMPLETED"
    assert two.job()["job_id"] == two.queued()["job_id"] and two.queued()["from_job"] == jobs[0]

    assert main(["status", chain.path.name]) == 0
    status = capsys.readouterr().out
    assert "chain: chain of 3 jobs, handover 35 s before each end" in status
    assert f"link 3 job {jobs[2]} RUNNING (serving)" in status and f"link 1 job {jobs[0]} COMPLETED" in status

    assert main(["cancel", chain.path.name]) == 0
    assert chain.cancelled_path.exists()
    assert client_.status(jobs[2]).finished
