"""A light supervisor: one serving child process, started again after a failure while its policy allows.

Light imports only: a worker's or the frontend's supervisor must not pay for torch or the tokenizer.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Callable


def supervise(command: Callable[[int], list[str]], after_failure: Callable[[int, int], int | None],
              started: Callable[[subprocess.Popen, int], None] | None = None) -> int:
    """Run `command(attempt)` (attempt 0, 1, ...) as a child until it exits 0, or this process is told to stop
    (TERM or INT, passed on to the child as TERM): then 0. `started(child, attempt)`, if given, runs once the
    child is started (a server's health wait: what it raises ends this process). When the child fails with
    `code`, `after_failure(code, attempt)` gives this process's exit code, or None to start the next attempt. The
    drain signal (SIGUSR1) is ignored here and by the children that inherit it (etcd, NATS): Slurm sends it to
    every process of the step, and a serving child that drains sets its own handler."""
    stopping = False
    child: subprocess.Popen | None = None

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    attempt = 0
    while not stopping:
        child = subprocess.Popen(command(attempt), stdin=subprocess.DEVNULL)
        if started is not None:
            started(child, attempt)
        code = child.wait()
        if stopping or code == 0:
            return 0
        decided = after_failure(code, attempt)
        if decided is not None:
            return decided
        attempt += 1
    return 0
