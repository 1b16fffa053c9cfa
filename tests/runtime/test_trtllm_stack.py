"""TensorRT-LLM workers (the strict fake of its LLM API) through the real stack: frontend, RPC, handoff, etcd,
NATS, as separate processes launched by `hpc launch` with Dynamo's --override-engine-args flag."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import socket
import time
from pathlib import Path

import pytest

from hpc.checks.probe import get_text, metric_values, post_json, post_sse
from tests.runtime.conftest import launch_stack

pytestmark = pytest.mark.integration
FAKE = Path(__file__).resolve().parents[1] / "fakes" / "trtllm"
MEDIA = "/tmp/hpc-test-media-trtllm"
TRANSCEIVER = '{"cache_transceiver_config": {"backend": "UCX"}}'


@pytest.fixture(scope="module")
def fake_env(tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FAKE_TRTLLM_LOG", "FAKE_TRTLLM_TRANSCEIVER_DIR",
                                            "FAKE_TRTLLM_TOKEN_DELAY_MS")}
    log = tmp_path_factory.mktemp("fake-log") / "trtllm.jsonl"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAKE), saved["PYTHONPATH"]) if p)
    os.environ["FAKE_TRTLLM_LOG"] = str(log)
    os.environ["FAKE_TRTLLM_TRANSCEIVER_DIR"] = str(tmp_path_factory.mktemp("transceiver"))
    os.environ["FAKE_TRTLLM_TOKEN_DELAY_MS"] = "10"
    yield log
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _stack(tmp_path_factory, model_cache, recipe, *extra):
    from hpc.cli.main import main

    stack = launch_stack(tmp_path_factory, model_cache, recipe, "--set", "backend=trtllm", *extra)
    yield stack
    assert main(["cancel", str(stack.run.path), "--grace", "5"]) == 0


@pytest.fixture(scope="module")
def agg(fake_env, tmp_path_factory, model_cache):
    yield from _stack(tmp_path_factory, model_cache, "tiny-agg")


@pytest.fixture(scope="module")
def disagg(fake_env, tmp_path_factory, model_cache):
    yield from _stack(tmp_path_factory, model_cache, "tiny-disagg", "--override-engine-args", TRANSCEIVER)


def _complete(stack, prompt, max_tokens=12, stream=False):
    body = {"model": stack.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        events = list(post_sse(stack.url + "/v1/completions", body))
        return "".join(e["choices"][0]["text"] for e in events), events
    status, data = post_json(stack.url + "/v1/completions", body)
    assert status == 200, data
    return data["choices"][0]["text"], data


def _worker_metric(stack, name, metric):
    state = json.loads((stack.run.state / f"{name}.json").read_text())
    return metric_values(get_text(state["http"] + "/metrics"), metric)


def test_greedy_text_is_the_same_aggregated_and_disaggregated_stream_or_not(agg, disagg):
    manifest = disagg.manifest
    assert manifest.engine_args["decode"]["cache_transceiver_config"] == {"backend": "UCX"}  # the flag's layer
    assert manifest.engine_args["decode"]["scheduler_config"]["dynamic_batch_config"]["enable_batch_size_tuning"]
    before = _worker_metric(disagg, "decode-0", "hpc_worker_requests_total")
    for prompt in ("The capital of France is", "Slurm schedules jobs on"):
        text_agg, body = _complete(agg, prompt)
        text_dis, body_dis = _complete(disagg, prompt)
        stream_dis, _ = _complete(disagg, prompt, stream=True)
        stream_agg, _ = _complete(agg, prompt, stream=True)
        assert text_agg == text_dis == stream_dis == stream_agg and text_agg
        # 12 tokens asked, 12 produced: the decode worker does not repeat the prefill worker's first token.
        assert body["usage"]["completion_tokens"] == body_dis["usage"]["completion_tokens"] == 12
    assert _worker_metric(disagg, "decode-0", "hpc_worker_requests_total") >= before + 4  # the decode path ran
    # start-up objects (modules, the engine) were frozen out of the collector's view before the worker registered
    assert _worker_metric(disagg, "decode-0", "hpc_worker_gc_frozen_objects") > 10_000
    assert _worker_metric(disagg, "decode-0", "hpc_worker_engine_load_seconds") > 0  # how long its engine took


def test_a_client_disconnect_aborts_the_engine_request_within_a_second(disagg, fake_env):
    host, port = disagg.url.removeprefix("http://").split(":")
    body = json.dumps({"model": disagg.model, "prompt": "Tell me a long story", "temperature": 0, "max_tokens": 250,
                       "ignore_eos": True, "stream": True}).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        received = b""
        while received.count(b"data:") < 3:
            received += sock.recv(4096)
    left = time.time()
    deadline = left + 5
    aborts = []
    while time.time() < deadline and not aborts:
        time.sleep(0.05)
        events = [json.loads(line) for line in fake_env.read_text().splitlines()]
        aborts = [e for e in events if e["event"] == "abort" and e["ts"] >= left - 0.5]
    assert aborts, "the engine request was never aborted"
    assert aborts[0]["ts"] - left < 1.0
    finished = [e for e in events if e["event"] == "finish" and e["reason"] == "CANCELLED"]
    assert finished and finished[-1]["tokens"] < 250


def test_engine_stats_and_kv_events_reach_nats(disagg):
    import nats

    from hpc.runtime.services.node import nats_token, wait_endpoint

    manifest = disagg.manifest

    async def collect():
        ep = wait_endpoint(manifest, "nats", 10)
        nc = await nats.connect(ep.base_url(), token=nats_token(manifest))
        got = {"kv_events": [], "engine_stats": []}
        for kind in got:
            async def keep(msg, k=kind):
                got[k].append(json.loads(msg.data))

            await nc.subscribe(f"hpc.{manifest.run_id}.{kind}.*".replace("-", "_"), cb=keep)
        await asyncio.to_thread(_complete, disagg, "word " * 80, 4)
        for _ in range(60):
            if got["kv_events"] and got["engine_stats"]:
                break
            await asyncio.sleep(0.1)
        # a router that starts late asks for what the workers hold: each resends TensorRT-LLM's records it saw
        got["resent"] = []

        async def resent(msg):
            got["resent"].append(json.loads(msg.data))
        await asyncio.sleep(0.5)  # the live events still on their way
        live = list(got["kv_events"])
        await nc.subscribe(f"hpc.{manifest.run_id}.kv_events.*".replace("-", "_"), cb=resent)
        await nc.publish(f"hpc.{manifest.run_id}.kv_resync.all".replace("-", "_"), b"")
        for _ in range(50):
            if any(e["worker"] == "prefill-0" and e.get("resync") for e in got["resent"]):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.3)
        await nc.close()
        got["kv_events"] = live
        return got
    got = asyncio.run(collect())
    stored = [e for e in got["kv_events"] if e["event"] == "engine" and e["record"]["data"]["type"] == "stored"]
    assert stored and stored[0]["record"]["data"]["blocks"][0]["tokens"]  # TensorRT-LLM's per-block records
    assert got["engine_stats"] and "kvCacheStats" in got["engine_stats"][0]["record"]
    assert _worker_metric(disagg, "prefill-0", "hpc_worker_kv_events") >= 1

    def stored_blocks(events: list[dict]) -> dict[int, list[int]]:
        return {b["block_hash"]: [t["token_id"] for t in b["tokens"]] for e in events
                if e["worker"] == "prefill-0" and e["event"] == "engine" and e["record"]["data"]["type"] == "stored"
                for b in e["record"]["data"]["blocks"]}
    resent = [e for e in got["resent"] if e["worker"] == "prefill-0"]
    assert resent[0]["event"] == "cleared" and resent[0]["resync"] is True
    held = {h: e["tokens"][i * e["block"]:(i + 1) * e["block"]] for e in resent[1:] if e["event"] == "held"
            for i, h in enumerate(e["block_hashes"])}
    just_stored = stored_blocks(got["kv_events"])  # this prompt's blocks: the newest, none evicted yet
    assert just_stored and just_stored.items() <= held.items()


def _png(color) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def epd(fake_env, tmp_path_factory, model_cache):
    Path(MEDIA).mkdir(exist_ok=True)
    yield from _stack(tmp_path_factory, model_cache, "tiny-epd", "--set", f"runtime.allowed_local_media_path={MEDIA}",
                      "--override-engine-args", TRANSCEIVER)


def test_encode_prefill_decode_with_an_image(epd):
    def chat(image):
        body = {"model": epd.model, "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": image}}]}]}
        status, data = post_json(epd.url + "/v1/chat/completions", body)
        assert status == 200, data
        return data["choices"][0]["message"]["content"]
    before = {r: _worker_metric(epd, f"{r}-0", "hpc_worker_requests_total") for r in ("encode", "prefill", "decode")}
    red, red_again, blue = chat(_png((200, 0, 0))), chat(_png((200, 0, 0))), chat(_png((0, 0, 200)))
    assert red == red_again and red != blue  # the image's embeddings reached the prefill engine
    after = {r: _worker_metric(epd, f"{r}-0", "hpc_worker_requests_total") for r in before}
    assert all(after[r] >= before[r] + 3 for r in before), (before, after)


def test_logprobs_come_from_the_llm_api_aggregated_and_disaggregated(agg, disagg):
    """SamplingParams.logprobs in, CompletionOutput.logprobs out (tensorrt_llm/executor/result.py), one entry per
    generated token — the disaggregated first token's from the context phase."""
    from hpc.checks.probe import post_json, post_sse

    for stack in (agg, disagg):
        body = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
        code, resp = post_json(stack.url + "/v1/chat/completions", body)
        content = resp["choices"][0]["logprobs"]["content"]
        assert code == 200 and len(content) == resp["usage"]["completion_tokens"] == 5
        assert all(e["logprob"] == -0.25 and [t["logprob"] for t in e["top_logprobs"]] == [-0.25, -1.25]
                   for e in content)  # the fake's distribution: the sampled token at rank 1
        streamed = [e for e in post_sse(stack.url + "/v1/chat/completions", {**body, "stream": True})
                    if e.get("choices")]
        assert sum(len((e["choices"][0]["logprobs"] or {}).get("content") or []) for e in streamed) == 5


def test_a_local_tp2_worker_is_one_process_whose_llm_spawns_its_ranks(fake_env, tmp_path_factory, model_cache):
    from hpc.launch.local import local_pids

    launched = _stack(tmp_path_factory, model_cache, "tiny-agg", "--set", "roles.agg.tensor_parallel_size=2")
    stack = next(launched)
    try:
        text, _ = _complete(stack, "Two ranks, one process")
        assert text
        # one process, supervised (the role's restart policy), no trtllm-llmapi-launch: the LLM spawns its ranks
        (pid,) = local_pids(stack.run)["agg-0"]
        inits = [e for e in map(json.loads, fake_env.read_text().splitlines()) if e["event"] == "init"
                 and e["tp"] == 2]
        assert [(e["mpi_session"], e["n_workers"], e["visible_devices"]) for e in inits] == [("pool", 2, "0,1")]
        assert inits[0]["pid"] != pid and _parent(inits[0]["pid"]) == pid
    finally:
        next(launched, None)  # hpc cancel, whatever failed above


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
