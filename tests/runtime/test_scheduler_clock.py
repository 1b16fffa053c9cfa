"""The scheduler's clock: seconds idle, admitting (prefill) and decoding, in stats() and so in a worker's /metrics.
It tells a stack's engine waiting for requests (a closed loop's waves) from one slowed down (benchmarks/
client_capacity.py reads it from each worker)."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.engine.torch.engine import TorchEngine
from hpc.runtime.engine.types import DisaggregationMode, GenerateRequest, SamplingParams
from hpc.runtime.serve.metrics import prometheus

# on a GPU the tests count steps as tokens: one step a replay
pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_step_a_replay")]

CLOCK = ("idle_seconds_total", "admit_seconds_total", "decode_seconds_total")


def test_idle_admit_and_decode_seconds_add_up_to_the_scheduler_time(tiny) -> None:
    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, {"max_seq_len": 128}) as engine:
            await asyncio.sleep(0.2)
            start = engine.stats()
            await asyncio.sleep(0.7)  # nothing to run: the scheduler waits on its inbox
            idle = engine.stats()
            req = GenerateRequest(request_id="c", token_ids=[5, 6, 7],
                                  sampling=SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            tokens = [t async for out in engine.generate(req) for t in out.token_ids]
            busy_wall = loop.time() - t0
            return start, idle, engine.stats(), tokens, busy_wall

    start, idle, served, tokens, busy_wall = asyncio.run(main())
    assert len(tokens) == 24
    assert idle["idle_seconds_total"] - start["idle_seconds_total"] >= 0.5
    assert idle["decode_seconds_total"] == start["decode_seconds_total"]  # nothing ran
    assert idle["idle_running_seconds_total"] == start["idle_running_seconds_total"]  # a wait, with no rows
    # one wait for work, going on (its timeouts are not new waits): few long waits are a loop's waves or ramps
    assert idle["idle_waits_total"] == start["idle_waits_total"] >= 1
    decode = served["decode_seconds_total"] - idle["decode_seconds_total"]
    admit = served["admit_seconds_total"] - idle["admit_seconds_total"]
    assert served["decode_steps"] - idle["decode_steps"] == 23 and served["prefill_steps"] == 1
    # the request's time in the engine is its prefill and its 23 decode steps, each counted once (on a GPU the
    # prefill may take longer than the 23 graphed steps: no order between them)
    assert 0 < admit and 0 < decode and admit + decode <= busy_wall
    # between the decode steps the scheduler only looked at its inbox: counted apart from the waits for work
    polls = served["idle_running_seconds_total"] - idle["idle_running_seconds_total"]
    assert 0 < polls <= served["idle_seconds_total"] - idle["idle_seconds_total"] and polls < decode
    # the wait the request ended was counted before it; then the one after it, if it began before stats() ran:
    # none between its 23 steps
    assert served["idle_waits_total"] - idle["idle_waits_total"] in (0, 1)
    assert all(f"# TYPE hpc_worker_{name} counter" in prometheus("hpc_worker", served, {}).decode() for name in CLOCK)
    # a request's queue (arrival to a slot) is its submit (checks; a decode's KV fetch) then its wait in the inbox
    queue, parts = served["queue_seconds_total"], served["submit_seconds_total"] + served["inbox_seconds_total"]
    assert served["inbox_seconds_total"] > 0 and served["submit_seconds_total"] > 0
    assert queue == pytest.approx(parts, rel=1e-6, abs=1e-9)


def test_the_cpu_reference_is_timed_on_the_scheduler_thread_while_it_decodes_only(tiny, monkeypatch) -> None:
    from hpc.runtime.engine.torch.cpu_reference import CpuReference

    monkeypatch.setattr(CpuReference, "EVERY_S", 0.0)  # at every chance: what ran is countable

    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, {"max_seq_len": 128}) as engine:
            await asyncio.sleep(0.2)
            start = engine.stats()
            await asyncio.sleep(0.6)  # waits for work: a woken thread's cold caches read as a slow CPU
            idle = engine.stats()
            req = GenerateRequest(request_id="c", token_ids=[5, 6, 7],
                                  sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            await _drain(engine.generate(req))
            return start, idle, engine.stats()

    start, idle, served = asyncio.run(main())
    assert idle["scheduler_cpu_reference_runs_total"] == start["scheduler_cpu_reference_runs_total"] == 0
    runs = served["scheduler_cpu_reference_runs_total"]
    # once a turn with rows running: the 11 decode steps launched, and the turn that read the last one's tokens
    assert served["decode_steps"] == 11 and runs == 12, served
    assert 1e-6 < served["scheduler_cpu_reference_seconds_total"] / runs < 5e-3, served


def test_each_engine_value_is_typed_a_counter_unless_it_is_a_level(tiny) -> None:
    # A count exported as a gauge breaks rate() in every dashboard. Every value the engine reports is a counter
    # but for these levels; a new value must be put on one side (metrics.COUNTERS or here).
    from hpc.runtime.serve.metrics import metric_kind

    levels = {"running", "waiting", "kv_usage", "handoffs_waiting", "prefix_blocks_held",
              "scheduler_thread_id"}  # an identity, not a count

    async def main():
        async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, {"max_seq_len": 128}) as engine:
            req = GenerateRequest(request_id="k", token_ids=[5, 6, 7],
                                  sampling=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
            await asyncio.gather(*[_drain(engine.generate(req)) for _ in range(3)])
            return engine.stats()

    stats = asyncio.run(main())
    assert {"decode_steps_overlapped", "first_tokens_left_on_device", "first_tokens"} <= set(stats)
    wrong = {name: metric_kind(name) for name in stats if metric_kind(name) != ("gauge" if name in levels
                                                                                 else "counter")}
    assert not wrong, wrong
    assert b"# TYPE hpc_worker_decode_steps counter" in prometheus("hpc_worker", stats, {})


async def _drain(outputs) -> None:
    async for _ in outputs:
        pass


def test_the_gil_switch_interval_is_python_s_unless_the_recipe_sets_it(tiny) -> None:
    """torch_engine.gil_switch_interval_s: an experiment's knob for how long the scheduler thread waits for the
    GIL back."""
    import sys

    from hpc.spec.recipe import TorchEngineSpec

    before = sys.getswitchinterval()
    try:
        for setting, expected in ((None, before), (0.0005, 0.0005)):
            async def main(setting=setting):
                async with TorchEngine(tiny, DisaggregationMode.AGGREGATED, {"max_seq_len": 128},
                                       switches=TorchEngineSpec(gil_switch_interval_s=setting)):
                    return sys.getswitchinterval()

            assert asyncio.run(main()) == pytest.approx(expected)
    finally:
        sys.setswitchinterval(before)
