"""benchmarks/decode_host_step.py times the decode worker's real step: every row carried in the graph, every
row's token sent bare, and the reference it divides by is a positive time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import decode_host_step  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_steps_take_the_decode_workers_path_and_send_every_token(model_cache):
    from hpc.runtime.engine.builds import ensure_model

    engine, sent = decode_host_step.engine_with_stand_in_graphs(ensure_model(str(model_cache / "tiny"), "tiny"))
    running = decode_host_step.rows_of(engine, 5)  # a padded size: the graph for 8 rows
    decode_host_step.steps(engine, running, 30)
    assert engine.core.counters["decode_steps_carried_in_graph"] == 29  # all but the first, which starts the chain
    assert engine.core.counters["decode_tokens_bare_total"] == sum(sent) == 5 * 29  # each step emits the one before
    assert [seq.generated for seq in running] == [29] * 5 and engine.core.graphs.replays == 30
    assert decode_host_step.reference_us() > 0


def test_with_four_steps_a_replay_each_launch_sends_four_tokens_a_row(model_cache):
    from hpc.runtime.engine.builds import ensure_model

    engine, sent = decode_host_step.engine_with_stand_in_graphs(ensure_model(str(model_cache / "tiny"), "tiny"), 4)
    running = decode_host_step.rows_of(engine, 5)
    decode_host_step.steps(engine, running, 30)
    assert engine.core.counters["decode_launches_multi_step_total"] == 30 and engine.core.graphs.replays == 30
    # each launch emits the one before
    assert engine.core.counters["decode_tokens_bare_total"] == sum(sent) == 5 * 29 * 4
    assert [seq.generated for seq in running] == [29 * 4] * 5
