"""Routing that knows the cache: the index built from KV events, the kv_aware choice against load, and round
robin that takes turns per role."""

from __future__ import annotations

import pytest

from hpc.runtime.engine.block_hashes import block_hashes
from hpc.runtime.frontend.kv_index import KvIndex
from hpc.runtime.frontend.router import Router
from hpc.runtime.services.discovery import Instance
from hpc.spec.recipe import RouterPolicy
from tests.runtime.conftest import until

pytestmark = pytest.mark.unit

BLOCK = 4
PROMPT = list(range(10, 22))  # three full blocks


class Connected:
    alive = connected = True

    async def close(self) -> None:
        pass


def _router(policy: RouterPolicy, counts: dict[str, int], kv: KvIndex | None = None) -> Router:
    router = Router(policy, kv=kv)
    instances = [Instance(role=role, index=i, instance_id=f"{role}{i}", host="127.0.0.1", rpc_port=30000 + i,
                          http_port=31000 + i, node="n0") for role, n in counts.items() for i in range(n)]
    router.update({i.key: i for i in instances}, now=0.0)
    for inst in instances:
        router.clients[inst.key] = Connected()
    return router


def _stored(hashes: list[int], tokens: list[int], parent=None) -> dict:
    """A TensorRT-LLM-shaped stored record with the engine's own (here: arbitrary) block hashes."""
    blocks = [{"type": "stored_block", "block_hash": h, "tokens": [
        {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens[i * BLOCK:(i + 1) * BLOCK]]}
        for i, h in enumerate(hashes)]
    return {"event": "engine", "record": {"event_id": 1, "data": {"type": "stored", "parent_hash": parent,
                                                                   "blocks": blocks}}}


def test_round_robin_takes_turns_per_role_in_a_sequential_run():
    router = _router(RouterPolicy.ROUND_ROBIN, {"prefill": 2, "decode": 3})
    for _ in range(31):  # prefill then decode, one request at a time, as a disaggregated request goes
        router.pick("prefill", set())
        router.pick("decode", set())
    for role, n in (("prefill", 2), ("decode", 3)):
        counts = [router.routed[f"{role}/{i}"] for i in range(n)]
        assert sum(counts) == 31 and max(counts) - min(counts) <= 1, (role, counts)


def test_the_index_follows_stored_removed_and_cleared_with_the_engines_own_hashes():
    kv = KvIndex(BLOCK)
    kv.apply("agg-0", _stored([901, 902], PROMPT))  # two blocks in one record
    kv.apply("agg-0", _stored([903], PROMPT[8:], parent=902))  # the third continues the chain
    kv.apply("agg-1", _stored([77], PROMPT))
    kv.apply("agg-1", _stored([5], [1, 2, 3, 4], parent=12345))  # a chain it never saw start: ignored
    assert kv.overlaps(PROMPT + [1]) == (3, {"agg-0": 3, "agg-1": 1})
    assert kv.overlaps([0] + PROMPT) == (3, {})  # shifted by one token: nothing in common
    kv.apply("agg-0", {"event": "engine", "record": {"data": {"type": "removed", "block_hashes": [902]}}})
    assert kv.overlaps(PROMPT)[1] == {"agg-0": 1, "agg-1": 1}  # a gap ends the run
    kv.apply("agg-0", {"event": "cleared"})
    assert kv.overlaps(PROMPT)[1] == {"agg-1": 1} and "agg-0" not in kv.ours


def test_kv_aware_goes_where_the_prefix_is_unless_that_worker_is_busy():
    kv = KvIndex(BLOCK)
    kv.stale = False
    kv.apply("agg-1", _stored(block_hashes(PROMPT, BLOCK), PROMPT))  # the torch engine's hashes are ours
    router = _router(RouterPolicy.KV_AWARE, {"agg": 2}, kv)
    assert [router.pick("agg", set(), PROMPT + [99])[0] for _ in range(4)] == ["agg/1"] * 4
    assert router.kv_blocks == {"prompt": 12, "overlap": 12}
    router.inflight_blocks["agg/1"] = 10  # busy computing other prompts: 3 blocks elsewhere cost less
    assert router.pick("agg", set(), PROMPT + [99])[0] == "agg/0"
    kv.reset()  # the event stream broke: by load (ties take turns), not by a stale index
    router.inflight_blocks["agg/1"] = 0
    assert sorted(router.pick("agg", set(), PROMPT)[0] for _ in range(2)) == ["agg/0", "agg/1"]


def test_a_router_temperature_spreads_near_ties_and_still_prefers_the_cache():
    import random

    kv = KvIndex(BLOCK)
    kv.stale = False
    kv.apply("agg-1", _stored(block_hashes(PROMPT, BLOCK), PROMPT))
    router = _router(RouterPolicy.KV_AWARE, {"agg": 2}, kv)
    router.temperature, router.rng = 2.0, random.Random(0)
    picks = [router.pick("agg", set(), PROMPT + [99])[0] for _ in range(400)]
    share = picks.count("agg/1") / len(picks)  # costs 0 vs 3 blocks: weights 1 and exp(-1.5), about 82 % / 18 %
    assert 0.74 < share < 0.90, share
    router.temperature = 0.0
    assert {router.pick("agg", set(), PROMPT + [99])[0] for _ in range(20)} == {"agg/1"}


_stack_fixture = __import__("tests.runtime.conftest", fromlist=["stack_fixture"]).stack_fixture
# a spin window set (auto is off on a machine of fewer than 8 CPUs): which spin each worker runs follows where its
# engine runs
kv_stack = _stack_fixture("tiny-agg", "--set", "roles.agg.count=2", "--set", "frontend.router=kv_aware",
                          "--set", "runtime.idle_spin_us=500")
# the same with each worker's engine in a process of its own (the default on GPUs): its KV events cross the
# engine link before they reach NATS
kv_stack_apart = _stack_fixture("tiny-agg", "--set", "roles.agg.count=2", "--set", "frontend.router=kv_aware",
                                "--set", "runtime.engine_process=own", "--set", "runtime.idle_spin_us=500")


@pytest.mark.integration
@pytest.mark.parametrize("stack", ["kv_stack", "kv_stack_apart"])
def test_a_shared_prefix_follows_its_worker_through_the_real_event_plane(stack, request, capsys):
    """Two workers, kv_aware: after the first request its prefix's blocks reach the frontend over NATS, and every
    later request with that prefix goes to the same worker and reuses them; hpc status shows it."""
    import time

    from hpc.checks.probe import get_json, post_json
    from hpc.cli.main import main

    kv_stack = request.getfixturevalue(stack)
    states = kv_stack.run.component_states()
    apart = stack == "kv_stack_apart"
    assert all(("engine_pid" in states[f"agg-{i}"]) == apart for i in range(2))
    # a worker spins through every call only with its engine apart: one on a thread of its process would wait
    # for the GIL behind the spinning loop; the frontend always does
    from hpc.checks.probe import get_text, metric_values

    for i in range(2):
        text = get_text(states[f"agg-{i}"]["http"] + "/metrics")
        assert metric_values(text, "hpc_worker_worker_idle_spin_in_flight") == float(apart)
    assert metric_values(get_text(kv_stack.url + "/metrics"), "hpc_frontend_idle_spin_in_flight") == 1.0

    prefix = list(range(100, 400))  # 300 tokens: 9 full blocks of 32
    seen = []
    for i in range(5):
        code, resp = post_json(kv_stack.url + "/v1/completions", {"model": "hpc/tiny", "prompt": prefix + [i],
                                                                 "max_tokens": 2, "temperature": 0})
        assert code == 200, resp
        seen.append(resp["usage"]["prompt_tokens_details"]["cached_tokens"])
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the stored blocks travel worker -> NATS -> frontend
            _, health = get_json(kv_stack.url + "/health", 2.0)
            if health["router"]["events"] >= 2 + (i == 0):  # each worker's "cleared", then the first prompt's
                break
            time.sleep(0.05)
    assert seen == [0, 288, 288, 288, 288]
    routed = sorted(i["routed"] for i in health["instances"]["agg"])
    assert routed == [0, 5], health  # one worker took them all: the one holding the prefix
    assert health["router"]["cached_blocks"] == 4 * 9 and health["router"]["stale"] is False
    assert main(["status", str(kv_stack.run.path)]) == 0
    out = capsys.readouterr().out
    indexed = health["router"]["indexed_blocks"]
    assert f"router: kv_aware, prompt blocks found cached 36/45 (80%), {indexed} blocks indexed" in out
    assert indexed >= 9 and "routed (5 requests)" in out
    # the router hashed those prompts' blocks without torch: a frontend process never loads it
    maps = open(f"/proc/{states['frontend']['pid']}/maps").read()
    assert "libtorch" not in maps and "libc" in maps


@pytest.mark.integration
def test_a_restarted_frontend_gets_back_what_the_workers_cache(kv_stack):
    """The frontend's supervisor starts it again after a crash: it asks the workers to resend every block they
    hold, so the prefix seated before the crash still goes to its worker (without it the index starts empty and
    the first requests go by load)."""
    import json
    import os
    import signal
    import time

    from hpc.checks.probe import get_json, post_json

    def ask(suffix: int) -> int:
        code, resp = post_json(kv_stack.url + "/v1/completions", {"model": "hpc/tiny", "prompt": prefix + [suffix],
                                                                 "max_tokens": 2, "temperature": 0}, timeout=10)
        assert code == 200, resp
        return resp["usage"]["prompt_tokens_details"]["cached_tokens"]

    def router() -> dict:
        return get_json(kv_stack.url + "/health", 2.0)[1]["router"]

    prefix = list(range(500, 800))  # 9 full blocks of 32, none of them the other tests'
    # the other tests' blocks are indexed already: waiting for 9 in all raced this prompt's own (CI, under load)
    already = router()["indexed_blocks"]
    ask(0)
    until(lambda: router()["indexed_blocks"] >= already + 9, 5, "the prefix's blocks indexed")
    time.sleep(0.3)  # the events still on their way (the other worker's, the other tests')
    before = router()
    state_file = kv_stack.run.state / "frontend.json"
    first = json.loads(state_file.read_text())
    os.kill(first["pid"], signal.SIGKILL)  # the serving process, not its supervisor

    def restarted():
        state = json.loads(state_file.read_text())
        return state["phase"] == "ready" and state["pid"] != first["pid"] and router()
    after = until(restarted, 60, "the frontend serving again")
    assert after["resyncs"] == 1
    after = until(lambda: (r := router())["indexed_blocks"] == before["indexed_blocks"] and r, 5,
                  f"the workers' {before['indexed_blocks']} blocks indexed again (now {router()['indexed_blocks']})")
    assert after["stale"] is False
    assert [ask(i) for i in (1, 2, 3)] == [288] * 3  # every one to the worker holding the prefix
    instances = get_json(kv_stack.url + "/health", 2.0)[1]["instances"]["agg"]
    assert sorted(i["routed"] for i in instances) == [0, 3], instances


@pytest.mark.integration
def test_the_index_is_whole_again_after_nats_restarts(kv_stack):
    """NATS dies and its supervisor starts it again: the frontend's index goes stale (routing by load), and once
    both sides are back the workers resend what they hold, whichever reconnects first."""
    import json
    import os
    import signal
    import time

    from hpc.checks.probe import get_json, post_json

    def router() -> dict:
        return get_json(kv_stack.url + "/health", 2.0)[1]["router"]

    prefix = list(range(900, 1200))  # 9 full blocks of 32, none of them the other tests'
    already = router()["indexed_blocks"]  # the other tests' blocks
    code, resp = post_json(kv_stack.url + "/v1/completions", {"model": "hpc/tiny", "prompt": prefix + [0],
                                                             "max_tokens": 2, "temperature": 0})
    assert code == 200, resp
    until(lambda: router()["indexed_blocks"] >= already + 9, 5, "the prefix's blocks indexed")
    time.sleep(0.3)  # the events still on their way (the other worker's, the other tests')
    before = router()
    nats = json.loads((kv_stack.run.state / "nats.json").read_text())
    os.kill(nats["server_pid"], signal.SIGKILL)
    until(lambda: router()["stale"], 10, "the index stale while NATS is away")

    def back():
        state = json.loads((kv_stack.run.state / "nats.json").read_text())
        r = router()
        return state.get("server_pid") != nats["server_pid"] and not r["stale"] and r
    until(back, 30, lambda: f"NATS back and events flowing (router: {router()})")
    until(lambda: (r := router())["indexed_blocks"] == before["indexed_blocks"] and r, 5,
                  f"the workers' {before['indexed_blocks']} blocks indexed again")
    code, resp = post_json(kv_stack.url + "/v1/completions", {"model": "hpc/tiny", "prompt": prefix + [1],
                                                             "max_tokens": 2, "temperature": 0})
    assert code == 200 and resp["usage"]["prompt_tokens_details"]["cached_tokens"] == 288, resp


def _with_images(record: dict, keys: dict[int, str]) -> dict:
    """The record's blocks at these positions cover an image (upstream KVCacheEventSerializer's mm_keys)."""
    for i, blk in enumerate(record["record"]["data"]["blocks"]):
        blk["mm_keys"] = [{"type": "mm_key", "hash": keys[i], "start_offset": 0}] if i in keys else []
    return record


def test_two_images_behind_the_same_placeholder_tokens_are_two_prefixes():
    """An image's placeholder tokens are the same for every image; the block's mm_keys tell them apart, so a prompt
    with another image (or none) is not routed as if its prefix were cached."""
    placeholders = [7] * 8 + [30, 31, 32, 33]  # two blocks of image tokens, then text
    kv = KvIndex(BLOCK)
    kv.apply("agg-0", _with_images(_stored([1, 2, 3], placeholders), {0: "aa" * 32, 1: "aa" * 32}))
    kv.apply("agg-1", _with_images(_stored([4, 5, 6], placeholders), {0: "bb" * 32, 1: "bb" * 32}))
    kv.apply("agg-2", _stored([8, 9], PROMPT[:8]))  # text only
    assert kv.overlaps(placeholders) == (3, {})  # the tokens alone match neither image
    assert kv.overlaps(PROMPT)[1] == {"agg-2": 2}  # text prefixes as before
    assert len(kv.holders) == 3 + 3 + 2  # each image's chain apart (one chain, had mm_keys been ignored)


def test_a_resync_keeps_the_images_of_the_blocks_it_resends():
    from hpc.runtime.services.events import KvMirror

    placeholders = [7] * 8
    record = {**_with_images(_stored([1, 2], placeholders), {1: "cc" * 32})["record"], "window_size": BLOCK}
    mirror, live, late = KvMirror(), KvIndex(BLOCK), KvIndex(BLOCK)
    mirror.note(record)
    live.apply("agg-0", {"event": "engine", "record": record})
    (held,) = mirror.records()
    assert held["mm"] == {"1": ["cc" * 32]}
    late.apply("agg-0", {"event": "held", **held})
    assert late.holders == live.holders


def test_kv_aware_picks_the_attention_dp_rank_that_holds_the_prefix_and_sends_the_request_there():
    import asyncio

    from hpc.runtime.engine.types import GenerateOutput, GenerateRequest

    kv = KvIndex(BLOCK)
    kv.stale = False
    record = _stored([1, 2, 3], PROMPT)
    record["record"]["attention_dp_rank"] = 2  # as TensorRT-LLM tags each rank's events
    kv.apply("prefill-0", record)
    router = Router(RouterPolicy.KV_AWARE, kv=kv)
    adp = Instance(role="prefill", index=0, instance_id="p0", host="127.0.0.1", rpc_port=30000, http_port=31000,
                   node="n0", dp_size=4)
    plain = Instance(role="prefill", index=1, instance_id="p1", host="127.0.0.1", rpc_port=30001, http_port=31001,
                     node="n0")
    router.update({adp.key: adp, plain.key: plain}, now=0.0)
    sent = []

    class Client(Connected):
        async def stream(self, request, deadline=None):
            sent.append(request)
            yield GenerateOutput(token_ids=[1], finished=True), b""

    router.clients = {adp.key: Client(), plain.key: Client()}
    assert router.pick("prefill", set(), PROMPT)[0] == "prefill/0" and router.picked_rank == 2
    assert router.pick("prefill", set(), [5] * 12)[0] in ("prefill/0", "prefill/1")  # nothing cached: by load

    async def main():
        req = GenerateRequest(request_id="r", token_ids=PROMPT)
        return [o async for o in router.generate("prefill", req)]
    asyncio.run(main())
    assert sent[-1].dp_rank == 2
    kv.apply("prefill-0", {"event": "cleared"})  # a restarted worker forgets every rank's blocks
    assert kv.overlaps(PROMPT)[1] == {} and not kv.ours
