"""Pure parsers: Slurm command output -> typed states."""

from __future__ import annotations

import re
from dataclasses import replace, dataclass, field
from enum import Enum


class SlurmState(str, Enum):
    """A job's or step's state as squeue and sacct spell it (squeue(1), JOB STATE CODES); compares equal to it."""

    BOOT_FAIL = "BOOT_FAIL"
    CANCELLED = "CANCELLED"
    COMPLETED = "COMPLETED"
    COMPLETING = "COMPLETING"
    CONFIGURING = "CONFIGURING"
    DEADLINE = "DEADLINE"
    FAILED = "FAILED"
    NODE_FAIL = "NODE_FAIL"
    OUT_OF_MEMORY = "OUT_OF_MEMORY"
    PENDING = "PENDING"
    PREEMPTED = "PREEMPTED"
    REQUEUED = "REQUEUED"
    REQUEUE_FED = "REQUEUE_FED"
    REQUEUE_HOLD = "REQUEUE_HOLD"
    RESIZING = "RESIZING"
    RESV_DEL_HOLD = "RESV_DEL_HOLD"
    REVOKED = "REVOKED"
    RUNNING = "RUNNING"
    SIGNALING = "SIGNALING"
    SPECIAL_EXIT = "SPECIAL_EXIT"
    STAGE_OUT = "STAGE_OUT"
    STOPPED = "STOPPED"
    SUSPENDED = "SUSPENDED"
    TIMEOUT = "TIMEOUT"
    UNKNOWN = "UNKNOWN"  # a state this table does not list (a newer Slurm's)

    __str__ = str.__str__  # printed and formatted as Slurm prints it
    __format__ = str.__format__

    @classmethod
    def of(cls, text: str) -> "SlurmState":
        """`CANCELLED by 1000` -> CANCELLED; a state not in the table -> UNKNOWN."""
        word = text.split()[0] if text.split() else ""
        try:
            return cls(word)
        except ValueError:
            return cls.UNKNOWN

    @property
    def phase(self) -> str:
        """queued | running | ended (torchx's SLURM_STATES, coarser): what hpc waits on."""
        return STATES[self]


STATES: dict[SlurmState, str] = {
    **{s: "queued" for s in (SlurmState.PENDING, SlurmState.CONFIGURING, SlurmState.REQUEUED,
                             SlurmState.REQUEUE_FED, SlurmState.REQUEUE_HOLD, SlurmState.RESV_DEL_HOLD,
                             SlurmState.SPECIAL_EXIT, SlurmState.SUSPENDED, SlurmState.STOPPED,
                             SlurmState.UNKNOWN)},
    **{s: "running" for s in (SlurmState.RUNNING, SlurmState.COMPLETING, SlurmState.RESIZING,
                              SlurmState.SIGNALING, SlurmState.STAGE_OUT)},
    **{s: "ended" for s in (SlurmState.BOOT_FAIL, SlurmState.CANCELLED, SlurmState.COMPLETED, SlurmState.DEADLINE,
                            SlurmState.FAILED, SlurmState.NODE_FAIL, SlurmState.OUT_OF_MEMORY,
                            SlurmState.PREEMPTED, SlurmState.REVOKED, SlurmState.TIMEOUT)},
}

# squeue/sacct format strings the parsers below expect.
SQUEUE_FORMAT = "%i|%T|%M|%D|%N|%R|%S|%L"  # %S: a pending job's expected start (backfill); %L: time left
SACCT_FIELDS = "JobID,JobName,State,ExitCode,Elapsed,NodeList"


class ParseError(ValueError):
    pass


@dataclass(frozen=True)
class StepState:
    step_id: str
    name: str
    state: SlurmState
    exit_code: int
    signal: int
    nodes: str


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: SlurmState
    elapsed: str = ""
    nodes: str = ""
    reason: str = ""
    expected_start: str = ""  # a pending job's, once the scheduler has one (squeue's %S)
    time_left: str = ""  # a running job's, before its time limit (squeue's %L)
    exit_code: int = 0
    steps: list[StepState] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.state.phase == "ended"


def parse_sbatch(stdout: str) -> str:
    """`sbatch --parsable` prints `ID` or `ID;cluster`; plain sbatch `Submitted batch job ID`."""
    text = stdout.strip()
    m = re.search(r"Submitted batch job (\d+)", text) or re.fullmatch(r"(\d+)(?:;\S+)?", text.splitlines()[-1]
                                                                      if text else "")
    if not m:
        raise ParseError(f"cannot find a job id in sbatch output: {stdout!r}")
    return m.group(1)


def _is_job(jid: str, job_id: str) -> bool:
    """The job's own line, or a heterogeneous job's component's (`ID+N`: one line each, the first leads)."""
    return jid == job_id or (jid.startswith(job_id + "+") and jid[len(job_id) + 1:].isdigit())


def parse_squeue(stdout: str, job_id: str) -> JobState | None:
    found = None
    nodes: list[str] = []
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6 or not _is_job(parts[0], job_id):
            continue
        nodes += [parts[4]] if parts[4] and parts[4] not in nodes else []
        if found is not None:
            continue
        pending = parts[1] == "PENDING"
        start = parts[6].strip() if pending and len(parts) > 6 else ""
        left = parts[7].strip() if not pending and len(parts) > 7 else ""
        found = JobState(job_id=job_id, state=SlurmState.of(parts[1]), elapsed=parts[2], nodes=parts[4],
                         # squeue says "(None)" while the scheduler has not given a reason yet
                         reason=parts[5].strip("()") if pending and parts[5].strip("()") != "None" else "",
                         expected_start="" if start in ("N/A", "Unknown", "None") else start,
                         time_left="" if left in ("NOT_SET", "INVALID", "UNLIMITED") else left)
    return None if found is None else replace(found, nodes=",".join(nodes))


def _exit(code: str) -> tuple[int, int]:
    a, _, b = code.partition(":")
    return int(a or 0), int(b or 0)


def parse_sacct(stdout: str, job_id: str) -> JobState | None:
    """`sacct -n -P -o JobID,JobName,State,ExitCode,Elapsed,NodeList -j ID`."""
    job: list[str] | None = None
    steps: list[StepState] = []
    for line in stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6:
            continue
        jid, name, state, code, elapsed, nodes = parts[:6]
        state = state.split()[0]  # "CANCELLED by 0" -> CANCELLED
        if _is_job(jid, job_id):
            if job is None:  # a heterogeneous job's first component leads
                job = [state, code, elapsed, nodes]
            else:
                job[3] = f"{job[3]},{nodes}"
        elif _is_job(jid.split(".", 1)[0], job_id) and "." in jid:
            ec, sig = _exit(code)
            steps.append(StepState(step_id=jid[len(job_id):].lstrip("."), name=name, state=SlurmState.of(state),
                                   exit_code=ec,
                                   signal=sig, nodes=nodes))
    if job is None:
        return None
    ec, _ = _exit(job[1])
    return JobState(job_id=job_id, state=SlurmState.of(job[0]), elapsed=job[2], nodes=job[3], exit_code=ec, steps=steps)
