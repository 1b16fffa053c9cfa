"""The global router in the request path (seed 003): recipes with pools, each request's pools chosen from its input
length, SLA targets and priority, the KV handed from a prefill in one pool to a decode in another, and retry on the
faster pool when a pool dies."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from hpc.checks.probe import get_json, post_json
from hpc.runtime.frontend.openai import CompletionRequest, RouteHints
from hpc.runtime.frontend.pools import PoolRouter
from hpc.spec.global_router import load_global_router
from hpc.spec.catalog import project_root
from tests.runtime.conftest import stack_fixture

TINY_POOLS = project_root() / "recipes" / "global_router" / "tiny-pools.json"
SHORT, LONG = list(range(100, 110)), list(range(100, 400))  # grid rows: ISL < 256 and >= 256


@pytest.mark.unit
def test_hints_come_from_extra_args_or_nvext_and_choose_as_the_grid_says():
    body = CompletionRequest.model_validate({"model": "m", "prompt": "x", "extra_args": {"ttft_target": 50},
                                             "nvext": {"router": {"itl_target": 7}, "agent_hints": {"priority": 3}}})
    assert body.route_hints == RouteHints(50, 7, 3)
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).route_hints == RouteHints()
    pools = PoolRouter(load_global_router(TINY_POOLS))
    assert pools.prefill(len(SHORT), RouteHints()) == ["prefill-bulk", "prefill-fast"]  # retry on the faster
    assert pools.prefill(len(LONG), RouteHints(ttft_ms=50)) == ["prefill-fast"]  # nothing faster to retry on
    assert pools.prefill(len(LONG), RouteHints(ttft_ms=900)) == ["prefill-bulk", "prefill-fast"]
    assert pools.decode(len(LONG), RouteHints(itl_ms=10)) == ["decode-fast"]
    assert pools.prefill(len(SHORT), RouteHints(priority=50))[0] == "prefill-fast"
    assert pools.decisions == {("prefill", "prefill-bulk", "grid_default_target"): 1,
                               ("prefill", "prefill-fast", "grid"): 1, ("prefill", "prefill-bulk", "grid"): 1,
                               ("decode", "decode-fast", "grid"): 1, ("prefill", "prefill-fast", "priority"): 1}


pooled = stack_fixture("tiny-pools", "--set", "roles.prefill.failure.on_failure=continue",
                       "--set", "roles.decode.failure.on_failure=continue")


def _complete(stack, prompt: list[int], **fields) -> dict:
    code, resp = post_json(stack.url + "/v1/completions", {"model": stack.model, "prompt": prompt, "max_tokens": 6,
                                                           "temperature": 0, "ignore_eos": True, **fields})
    assert code == 200, resp
    return resp


def _pools(stack) -> dict[str, dict]:
    _, health = get_json(stack.url + "/health", 5.0)
    return {p["pool"]: p for p in health["router"]["pools"]}


@pytest.mark.integration
def test_requests_land_in_the_pools_the_grid_and_priorities_say(pooled, capsys):
    cases = [  # (prompt, request fields, prefill pool, decode pool)
        (SHORT, {}, "prefill-bulk", "decode-bulk"),
        (LONG, {"extra_args": {"ttft_target": 50, "itl_target": 10}}, "prefill-fast", "decode-fast"),
        (LONG, {"extra_args": {"ttft_target": 900}}, "prefill-bulk", "decode-bulk"),
        (SHORT, {"nvext": {"agent_hints": {"priority": 50}}}, "prefill-fast", "decode-fast"),
        (LONG, {"nvext": {"router": {"ttft_target": 20}}}, "prefill-fast", "decode-bulk"),
        (SHORT, {"extra_args": {"itl_target": 6}}, "prefill-bulk", "decode-fast"),
    ]
    answers: dict[tuple[int, ...], set[str]] = {}
    before = _pools(pooled)
    for prompt, fields, prefill, decode in cases:
        was = _pools(pooled)
        resp = _complete(pooled, prompt, **fields)
        now = _pools(pooled)
        moved = {name for name in now if now[name]["routed"] != was[name]["routed"]}
        assert moved == {prefill, decode}, (fields, moved)
        answers.setdefault(tuple(prompt), set()).add(resp["choices"][0]["text"])
    # the KV of a prefill in one pool continued in another pool's decode: same greedy answer on every route
    assert all(len(texts) == 1 for texts in answers.values()), answers
    after = _pools(pooled)
    assert {name: after[name]["routed"] - before[name]["routed"] for name in after} == \
        {"prefill-fast": 3, "prefill-bulk": 3, "decode-fast": 3, "decode-bulk": 3}
    assert after["prefill-fast"]["chosen_by"].get("priority", 0) >= 1
    _, health = get_json(pooled.url + "/health", 5.0)
    by_pool = {i["pool"]: i["routed"] for items in health["instances"].values() for i in items}
    assert by_pool == {name: after[name]["routed"] for name in after}  # the pools' workers took them
    from hpc.cli.main import main

    assert main(["status", str(pooled.run.path)]) == 0
    out = capsys.readouterr().out
    assert "pool decode/decode-fast: live 1, routed" in out and "(chosen by: " in out
    assert "prefill-1 (prefill-bulk)" in out


@pytest.mark.integration
def test_a_killed_pool_hands_its_requests_to_the_faster_one(pooled):
    import urllib.request

    text = urllib.request.urlopen(pooled.url + "/metrics", timeout=5).read().decode()
    assert 'hpc_frontend_pool_routed_total{pool="decode-bulk",role="decode"' in text
    assert text.count("# TYPE hpc_frontend_pool_routed_total") == 1
    before = _pools(pooled)
    state = pooled.run.state
    for name in ("prefill-1", "decode-1"):  # the bulk pools' only workers
        os.kill(json.loads((state / f"{name}.json").read_text())["pid"], signal.SIGKILL)
    time.sleep(0.2)  # not waiting for discovery: the first requests may still find them listed
    for i in range(6):  # all of them belong to the bulk pools by the grid
        resp = _complete(pooled, SHORT + [i])
        assert resp["usage"]["completion_tokens"] == 6
    after = _pools(pooled)
    for pool in ("prefill-bulk", "decode-bulk"):
        assert after[pool]["routed"] - before[pool]["routed"] == 6
        assert after[pool]["retried_away"] - before[pool]["retried_away"] == 6
    for pool in ("prefill-fast", "decode-fast"):
        assert after[pool]["routed"] - before[pool]["routed"] == 6
    assert after["decode-bulk"]["live"] == 0 and after["decode-fast"]["live"] == 1


AGG_ROUTER = {"mode": "agg", "num_agg_pools": 2, "agg_pool_dynamo_namespaces": ["agg-fast", "agg-bulk"],
              "agg_pool_selection_strategy": {"ttft_min_ms": 10, "ttft_max_ms": 210, "ttft_resolution": 2,
                                              "itl_min_ms": 5, "itl_max_ms": 105, "itl_resolution": 2,
                                              "agg_pool_mapping": [[0, 0], [0, 1]]}}
agg_pooled = stack_fixture("mock-agg", "--set", 'roles.agg.pools=[{"name": "agg-fast"}, {"name": "agg-bulk"}]',
                           "--set", f"frontend.global_router={json.dumps(AGG_ROUTER)}")


@pytest.mark.integration
def test_aggregated_pools_follow_the_ttft_itl_grid(agg_pooled):
    cases = [({}, "agg-bulk"), ({"extra_args": {"ttft_target": 20}}, "agg-fast"),
             ({"extra_args": {"itl_target": 6}}, "agg-fast"), ({"extra_args": {"ttft_target": 200, "itl_target": 90}},
                                                               "agg-bulk")]
    for fields, pool in cases:
        was = _pools(agg_pooled)
        _complete(agg_pooled, SHORT, **fields)
        now = _pools(agg_pooled)
        assert {p for p in now if now[p]["routed"] > was[p]["routed"]} == {pool}, fields
    assert _pools(agg_pooled)["agg-bulk"]["chosen_by"] == {"grid_default_target": 1, "grid": 1}


tp_pools = stack_fixture(str(project_root() / "tests" / "runtime" / "data" / "tiny-pools-tp.yaml"))


@pytest.mark.integration
def test_kv_moves_between_workers_of_any_tp_size(tp_pools):
    """Prefill TP 1 or 2 -> decode TP 1 or 2: a TP-2 prefill gathers every rank's KV heads, a TP-2 decode gives
    each rank its own; all four routes give the same fp32 greedy tokens."""
    prompts = [LONG, SHORT, list(range(500, 533))]
    answers = {}
    for priority in range(4):
        was = _pools(tp_pools)
        answers[priority] = [_complete(tp_pools, p, max_tokens=12, nvext={"agent_hints": {"priority": priority}})
                             ["choices"][0]["text"] for p in prompts]
        now = _pools(tp_pools)
        moved = {p for p in now if now[p]["routed"] > was[p]["routed"]}
        assert moved == {f"prefill-tp{1 + priority // 2}", f"decode-tp{1 + priority % 2}"}, priority
    assert answers[1] == answers[0] and answers[2] == answers[0] and answers[3] == answers[0], answers
    manifest = tp_pools.manifest
    assert [w.tasks for w in manifest.plan.workers] == [1, 2, 1, 2]
