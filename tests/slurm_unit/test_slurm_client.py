"""Slurm verbs against a small fake runner that answers with outputs recorded on the dev cluster."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc.slurm.client import SlurmClient, SubmitError
from hpc.slurm.parse import ParseError, parse_sacct, parse_sbatch, parse_squeue
from hpc.slurm.runner import Completed

pytestmark = pytest.mark.unit

# Recorded on the dev cluster (slurm-wlm 22.05.8), jobs 5, 6 and 9.
SACCT_CANCELLED = """6|hpc-tiny-disagg|CANCELLED by 0|0:0|00:00:08|node[1-3]
6.batch|batch|CANCELLED|0:15|00:00:08|node1
6.0|etcd|COMPLETED|0:0|00:00:08|node1
6.3|prefill-0|COMPLETED|0:0|00:00:07|node2
"""
SACCT_FAILED = """9|hpc-tiny-disagg|FAILED|3:0|00:00:01|node[1-3]
9.batch|batch|FAILED|3:0|00:00:01|node1
9.4|decode-0|FAILED|3:0|00:00:00|node3
9.3|prefill-0|COMPLETED|0:0|00:00:00|node2
"""
SQUEUE_RUNNING = "6|RUNNING|0:05|3|node[1-3]|node[1-3]|2026-11-29T04:39:05|9:55\n"
SQUEUE_PENDING = "7|PENDING|0:00|3||(Resources)|N/A\n"  # the backfill scheduler has no start time for it yet
SQUEUE_PENDING_PLANNED = "7|PENDING|0:00|3||(Resources)|2026-11-29T04:41:05|5:00\n"  # %L: its whole limit


class FakeSlurm:
    """Records argv; answers from state the test sets. No subprocess anywhere."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.queue: dict[str, str] = {}
        self.acct: dict[str, str] = {}
        self.sbatch = Completed(0, "6\n", "")
        self.controller_up = True

    def run(self, argv: list[str], cwd: str | None = None, timeout: float = 60.0) -> Completed:
        assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)  # never a shell string
        self.calls.append(argv)
        tool = argv[0]
        if tool == "sbatch":
            return self.sbatch
        job = argv[argv.index("-j") + 1] if "-j" in argv else argv[-1]
        if tool == "squeue":
            return Completed(0, "".join(self.queue.get(j, "") for j in job.split(",")), "")
        if tool == "sacct":
            return Completed(0, "".join(self.acct.get(j, "") for j in job.split(",")), "")
        if tool == "scontrol":
            return Completed(0 if self.controller_up else 1,
                             "Slurmctld(primary) at slurmctl is " + ("UP" if self.controller_up else "DOWN"), "")
        if tool == "scancel":
            if "--signal=USR1" not in argv:
                self.queue.pop(job, None)
                self.acct[job] = SACCT_CANCELLED
            return Completed(0, "", "")
        raise AssertionError(f"unexpected command {argv}")


def test_parsers():
    assert parse_sbatch("Submitted batch job 42\n") == "42"
    assert parse_sbatch("43;dev\n") == "43"
    with pytest.raises(ParseError):
        parse_sbatch("sbatch: error: invalid partition")
    st = parse_squeue(SQUEUE_PENDING, "7")
    assert st.state == "PENDING" and st.reason == "Resources" and not st.finished and st.expected_start == ""
    assert parse_squeue(SQUEUE_PENDING_PLANNED, "7").expected_start == "2026-11-29T04:41:05"
    assert parse_squeue(SQUEUE_RUNNING, "6").expected_start == ""  # a running job's %S is when it started
    assert parse_squeue("7|PENDING|0:00|3||(Priority)\n", "7").reason == "Priority"  # an older format: no %S
    assert parse_squeue(SQUEUE_RUNNING, "6").time_left == "9:55"
    assert parse_squeue(SQUEUE_PENDING_PLANNED, "7").time_left == ""  # not running: no clock yet
    assert parse_squeue("6|RUNNING|0:05|3|n|n|x|UNLIMITED\n", "6").time_left == ""
    st = parse_sacct(SACCT_FAILED, "9")
    assert st.state == "FAILED" and st.exit_code == 3 and st.finished
    assert [(s.name, s.exit_code) for s in st.steps if s.state == "FAILED"] == [("batch", 3), ("decode-0", 3)]
    assert parse_sacct(SACCT_CANCELLED, "6").state == "CANCELLED"  # "CANCELLED by 0"
    assert parse_sacct("", "6") is None


def test_submit_and_status_through_the_runner(tmp_path: Path):
    fake = FakeSlurm()
    client = SlurmClient(fake)
    script = tmp_path / "job with space.sbatch"
    script.write_text("#!/bin/bash\n")
    assert client.submit(script) == "6"
    assert fake.calls[0] == ["sbatch", "--parsable", str(script)]
    fake.queue["6"] = SQUEUE_RUNNING
    assert client.status("6").state == "RUNNING"
    del fake.queue["6"]
    fake.acct["6"] = SACCT_CANCELLED
    assert client.status("6").state == "CANCELLED"


def test_failed_sbatch_keeps_slurms_message():
    fake = FakeSlurm()
    fake.sbatch = Completed(1, "", "sbatch: error: invalid partition specified: nope\n")
    with pytest.raises(SubmitError, match="invalid partition specified: nope"):
        SlurmClient(fake).submit(Path("/tmp/x.sbatch"))


def test_cancel_is_tiered_and_by_job_id_only():
    fake = FakeSlurm()
    fake.queue["6"] = SQUEUE_RUNNING
    drained = iter([False, True])
    state = SlurmClient(fake).cancel("6", grace_s=5, poll_s=0.01, drained=lambda: next(drained))
    cancels = [c for c in fake.calls if c[0] == "scancel"]
    assert cancels == [["scancel", "--signal=USR1", "6"], ["scancel", "6"]]
    assert state.state == "CANCELLED"
    assert not any("--name" in a or "-n" == a for c in cancels for a in c)


def test_ping():
    fake = FakeSlurm()
    assert SlurmClient(fake).ping() is None
    fake.controller_up = False
    assert "DOWN" in SlurmClient(fake).ping()


def test_many_jobs_in_one_squeue_and_one_sacct():
    fake = FakeSlurm()
    fake.queue = {"6": SQUEUE_RUNNING, "7": SQUEUE_PENDING}
    fake.acct = {"9": SACCT_FAILED}
    states = SlurmClient(fake).statuses(["6", "7", "9", "404"])
    assert [c[0] for c in fake.calls] == ["squeue", "sacct"]
    assert {k: (v.state if v else None) for k, v in states.items()} == {
        "6": "RUNNING", "7": "PENDING", "9": "FAILED", "404": None}


def test_slurm_is_asked_on_a_backoff_and_local_waits_end_at_the_deadline():
    from hpc.waiting import SLURM, Throttle, wait_until

    now = [0.0]
    throttle = Throttle(SLURM, clock=lambda: now[0])
    asked = []
    while now[0] < 40:
        if throttle.due():
            asked.append(now[0])
        now[0] += 0.25
    assert asked == [0.0, 2.0, 6.0, 14.0, 22.0, 30.0, 38.0]  # now, then 2, 4, 8, 8 ... s apart

    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    with pytest.raises(TimeoutError, match="etcd publishing"):
        wait_until(lambda: None, 1.0, "etcd publishing", sleep=sleep, clock=lambda: now[0])
    assert abs(sum(slept) - 1.0) < 1e-9 and slept[0] == 0.01 and max(slept) == 0.25
    answers = iter([None, None, "ready"])
    assert wait_until(lambda: next(answers), 5, "x", sleep=lambda s: None) == "ready"
    # a check written as a comparison waits too: False is "not yet", as None is (it returned at once)
    answers = iter([False, None, False, 0, True])
    assert wait_until(lambda: next(answers), 5, "x", sleep=lambda s: None) == 0


def test_launch_waits_through_pending_and_reports_a_job_that_ended_first(tmp_path: Path, capsys):
    from hpc.launch.slurm import _wait_running
    from hpc.rundir import RunDir

    run = RunDir(tmp_path / "run 'x' $(y)")
    (run.path / "logs").mkdir(parents=True)
    (run.path / "logs" / "preflight.log").write_text("python: ok (3.11)\nmodule msgspec: missing\n")
    fake = FakeSlurm()
    fake.queue["7"] = SQUEUE_PENDING
    asked = []

    def status_run(argv, cwd=None, timeout=60.0):
        asked.append(argv[0])
        if len(asked) == 2:  # the scheduler plans its start
            fake.queue["7"] = SQUEUE_PENDING_PLANNED
        if len(asked) == 4:  # PENDING for a while, then the job fails before it was ever ready
            fake.queue.pop("7", None)
            fake.acct["7"] = SACCT_FAILED.replace("9", "7")
        return FakeSlurm.run(fake, argv, cwd, timeout)
    fake.run = status_run
    assert _wait_running(SlurmClient(fake), "7", run) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["  slurm: PENDING (Resources)",
                                "  slurm: PENDING (Resources), expected to start 2026-11-29T04:41:05",
                                "  slurm: FAILED"]
    assert "preflight failed: module msgspec: missing" in err and "job 7 ended FAILED before it was ready" in err

    fake.queue["6"] = SQUEUE_RUNNING
    assert _wait_running(SlurmClient(fake), "6", run) is None  # RUNNING: on to readiness


def test_a_job_that_failed_without_its_log_is_told_to_put_runs_where_the_nodes_see_them(tmp_path: Path, capsys):
    from hpc.launch.slurm import _wait_running
    from hpc.rundir import RunDir

    run = RunDir(tmp_path / "run")
    (run.path / "logs").mkdir(parents=True)  # on this machine; the batch node could not open it (exit 0:53)
    fake = FakeSlurm()
    fake.acct["7"] = SACCT_FAILED.replace("9", "7")
    assert _wait_running(SlurmClient(fake), "7", run) == 1
    err = capsys.readouterr().err
    assert f"the job wrote no log ({run.logs / 'job.out'})" in err and "runs_dir, or HPC_RUNS_DIR" in err
    assert "ended FAILED before it was ready" in err and "hpc logs" not in err  # no log to show

    (run.logs / "job.out").write_text("hpc: job 7 on node1\n")  # it ran and failed later: its log says why
    assert _wait_running(SlurmClient(fake), "7", run) == 1
    err = capsys.readouterr().err
    assert "wrote no log" not in err and "see: hpc logs 7" in err


def test_a_pending_job_with_no_reason_yet_shows_none_as_no_reason():
    st = parse_squeue("7|PENDING|0:00|3||(None)|N/A\n", "7")
    assert st.state == "PENDING" and st.reason == ""  # not "PENDING (None)"


def test_a_heterogeneous_jobs_components_are_one_job():
    """squeue and sacct list a hetjob as ID+0, ID+1, ...; its steps as ID+N.STEP: one state, every node."""
    squeue = ("50+0|RUNNING|0:05|1|node1|None|2026-12-03T11:00:00|19:55\n"
              "50+1|RUNNING|0:05|1|node2|None|2026-12-03T11:00:00|19:55\n"
              "500|RUNNING|0:05|1|node3|None|2026-12-03T11:00:00|19:55\n")
    st = parse_squeue(squeue, "50")
    assert st.state == "RUNNING" and st.nodes == "node1,node2"
    sacct = ("50+0|hpc-x|RUNNING|0:0|00:00:05|node1\n50+1|hpc-x|RUNNING|0:0|00:00:05|node2\n"
             "50+0.0|preflight|COMPLETED|0:0|00:00:01|node1\n50+1.2|prefill-0|FAILED|1:0|00:00:02|node2\n"
             "500|other|RUNNING|0:0|00:00:05|node3\n")
    st = parse_sacct(sacct, "50")
    assert st.nodes == "node1,node2" and [(s.step_id, s.name, s.exit_code) for s in st.steps] == [
        ("+0.0", "preflight", 0), ("+1.2", "prefill-0", 1)]
