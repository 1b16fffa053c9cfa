"""Serving past the time limit: a chain of jobs behind one address (hpc launch --chain N).

Each link is an ordinary run directory with its own script, all rendered at launch (CHAIN/links/K/). A link's
job, once it serves, queues the next link `handover_s` before its own end, off its own nodes; the next link comes
up beside it, passes its smoke checks and names itself in CHAIN/serving.json; the link before then drains its
workers (they leave routing and finish what they hold) and ends. The one address is `hpc endpoint RUN` (on a
login node, or wherever clients reach it): it sends each request to the frontend of the link serving now. A
frontend in the job cannot be that address, because the job that holds it ends.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable

from hpc.errors import UserError
from hpc.rundir import ChainDir, RunDir
from hpc.spec.cluster import time_to_minutes

if TYPE_CHECKING:
    from hpc.resolve import Resolved

MOST_LINKS = 1000
DEFAULT_HANDOVER_S = 600


def check_chain(r: "Resolved", links: int, handover_s: int | None, in_allocation: bool) -> int:
    """The chain's settings against the profile and the recipe, before anything is written: the handover's
    seconds (the default: 600 s, at most a quarter of the time limit)."""
    if links < 2 or links > MOST_LINKS:
        raise UserError(f"a chain is 2 to {MOST_LINKS} jobs, not {links}", field="--chain",
                        hint="--chain 3 serves for three time limits")
    if r.cluster.is_local or in_allocation:
        where = "the local profile" if r.cluster.is_local else "an allocation you hold (--in-allocation)"
        raise UserError(f"a chain of jobs needs Slurm to queue them; {where} has no time limit to outlive",
                        field="--chain", hint="launch on a Slurm cluster profile, or leave --chain out")
    limit_s = time_to_minutes(r.recipe.time_limit or r.cluster.time_limit) * 60
    drain_s = r.recipe.drain_before_end_s
    handover_s = min(DEFAULT_HANDOVER_S, limit_s // 4) if handover_s is None else handover_s
    if handover_s >= limit_s:
        raise UserError(f"the handover ({handover_s} s) must be shorter than the time limit ({limit_s} s)",
                        field="--handover", hint="a quarter of the time limit leaves room for the queue and start-up")
    if handover_s <= drain_s:
        # the link would drain at its time limit (drain_before_end_s) before the next one could take over
        raise UserError(f"the handover ({handover_s} s) must be longer than drain_before_end_s ({drain_s} s)",
                        file=str(r.recipe_file), field="drain_before_end_s",
                        hint=f"--handover {drain_s + 300}, or a smaller drain_before_end_s")
    if r.recipe.placement == "hetjob":
        raise UserError("a chain of heterogeneous jobs is not supported: the next link is kept off this job's "
                        "nodes as one job", file=str(r.recipe_file), field="placement",
                        hint="use placement: spread or pack with --chain")
    return handover_s


def chain_lines(chain: ChainDir, job_state: Callable[[str], str | None]) -> list[str]:
    """`chain: ...` then `  link 1 job 44 COMPLETED`, `  link 2 job 45 RUNNING (serving)`: for hpc status."""
    serving = chain.serving()
    parts = []
    for k, link in enumerate(chain.links(), start=1):
        ids = chain.job_ids(link)
        if not ids:
            parts.append(f"link {k} not queued yet")
            continue
        state = job_state(ids[-1]) or "?"
        parts.append(f"link {k} job {ids[-1]} {state}" + (" (serving)" if serving.get("link") == k else ""))
    head = f"chain of {len(parts)} jobs, handover {chain.record.get('handover_s')} s before each end"
    if chain.cancelled_path.exists():
        head += ", cancelled"
    return [f"chain: {head}", *(f"  {part}" for part in parts)]


def cancel_chain(chain: ChainDir, cancel_link: Callable[[RunDir], Any]) -> list[Any]:
    """Ends all of a chain: no link queues another (the marker each script reads first), then every link with a
    job, the serving one drained by `cancel_link` as any run is."""
    chain.cancelled_path.write_text(f"{time.time()}\n")
    return [cancel_link(link) for link in chain.links() if chain.job_ids(link)]

