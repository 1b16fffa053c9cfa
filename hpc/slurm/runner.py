"""The Runner seam: argv lists in, (returncode, stdout, stderr) out. Never a shell string."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def complaint(self) -> str:
        """A failed command's conclusion, for a one-line error: the last line it wrote to stderr (else stdout).
        Slurm's clients write their causes first and the verdict last ('sinfo: fatal: Could not establish...')."""
        lines = [line.strip() for line in (self.stderr.strip() or self.stdout).splitlines() if line.strip()]
        return lines[-1] if lines else f"exited {self.returncode}"


class Runner(Protocol):
    def run(self, argv: list[str], cwd: str | None = None, timeout: float = 60.0) -> Completed: ...


class LocalRunner:
    """Runs commands on this machine; `env` adds to the inherited environment (e.g. SLURM_CONF)."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.env = {**os.environ, **(env or {})}

    def run(self, argv: list[str], cwd: str | None = None, timeout: float = 60.0) -> Completed:
        try:
            proc = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout,
                                  stdin=subprocess.DEVNULL)
        except FileNotFoundError:
            return Completed(127, "", f"{argv[0]}: command not found (is Slurm installed and on PATH?)")
        except subprocess.TimeoutExpired:
            return Completed(124, "", f"{argv[0]} timed out after {timeout:.0f} s")
        return Completed(proc.returncode, proc.stdout, proc.stderr)
