"""Where a run lives, behind one protocol (torchx's scheduler verbs): this machine's processes, a Slurm job, or
an allocation the user holds. The CLI and the launch's follow-up call a Backend; none of them asks which one.
`hpc.launch.backends` picks the backend of a launch or of a run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from hpc.resolve import Resolved
    from hpc.rundir import RunDir


@dataclass(frozen=True)
class Cancelled:
    """What `hpc cancel` did: the line to print, what still runs (exit 1 when anything does), and whether the run
    has stopped (its directory may then be removed)."""

    line: str
    left: list[str]
    stopped: bool


class Backend(Protocol):
    name: str
    # a smoke job that ends by itself when readiness gives up (cancelling submitit's local one prints a traceback)
    smoke_ends_itself: bool

    def check(self, r: "Resolved") -> None:
        """What this backend needs of this machine, before anything is written (a UserError says what is wrong)."""

    def submit(self, run: "RunDir", *, wait: bool, smoke: bool) -> int:
        """Start the run, then (with `wait`) follow it to readiness and the smoke verdict: the launch's exit code."""
        ...

    def status(self, run: "RunDir") -> dict[str, Any]:
        """The scheduler's view of a submitted run: state first, then what this backend knows (elapsed, nodes...)."""
        ...

    def cancel(self, run: "RunDir", grace_s: float, drained: Callable[[], bool]) -> Cancelled:
        """Drain (USR1), wait up to `grace_s` for `drained`, then stop."""
        ...

    def end_if_failed(self, run: "RunDir") -> bool:
        """After a launch that did not get ready: end the run if a component failed for good (True if ended)."""
        ...

    def executor(self, run: "RunDir", what: str, minutes: int) -> Any:
        """A submitit executor for a one-node helper job of this run (smoke checks, a load generator)."""

    def serves_until(self, run: "RunDir") -> str | None:
        """How long a ready run serves, for the launch's last lines (None: until cancelled)."""
