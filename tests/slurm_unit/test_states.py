"""Slurm's states in one table (torchx's SLURM_STATES, coarser): every state squeue or sacct may print has a phase."""

from __future__ import annotations

import pytest

from hpc.slurm.parse import STATES, SlurmState, parse_sacct, parse_squeue

pytestmark = pytest.mark.unit


def test_every_state_has_a_phase_and_reads_as_slurm_spells_it():
    assert set(STATES) == set(SlurmState)
    assert {STATES[s] for s in SlurmState} == {"queued", "running", "ended"}
    assert f"{SlurmState.RUNNING}" == str(SlurmState.RUNNING) == "RUNNING" == SlurmState.RUNNING


def test_the_parsers_give_states_with_their_phase():
    job = parse_sacct("12|tiny|CANCELLED by 1000|0:15|00:00:03|node1\n12.0|etcd|NEW_STATE_X|0:0|00:00:02|node1\n",
                      "12")
    assert job is not None and job.state is SlurmState.CANCELLED and job.finished
    assert job.steps[0].state is SlurmState.UNKNOWN  # a newer Slurm's state: not taken for an ended job
    queued = parse_squeue("13|PENDING|0:00|1||(Priority)|N/A|\n", "13")
    assert queued is not None and queued.state is SlurmState.PENDING and not queued.finished
    assert parse_squeue("14|REQUEUE_HOLD|0:00|1||(JobHeldAdmin)|N/A|\n", "14").state.phase == "queued"
