"""The whole stack on this machine with real etcd, NATS, workers and frontend (tiny torch model)."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
import torch

from hpc.checks.probe import get_json, get_text, metric_values, post_json, post_sse
from hpc.runtime.engine.kv.nixl import nixl_available
from tests.runtime.conftest import stack_fixture

pytestmark = pytest.mark.integration

agg = stack_fixture("tiny-agg")
disagg = stack_fixture("tiny-disagg")
disagg_nixl = stack_fixture("tiny-disagg", "--set", "runtime.kv_transport=nixl")

PROMPT = "The capital of France is"


def _complete(stack, **extra):
    body = {"model": stack.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **extra}
    return post_json(stack.url + "/v1/completions", body)


@pytest.mark.parametrize("name", ["agg", "disagg"])
def test_completions_and_chat_streaming_and_not(name, request):
    stack = request.getfixturevalue(name)
    status, body = _complete(stack)
    assert status == 200 and body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 12
    events = list(post_sse(stack.url + "/v1/completions", {"model": stack.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 12,
                                                           "ignore_eos": True, "stream": True,
                                                           "stream_options": {"include_usage": True}}))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == body["choices"][0]["text"]  # greedy: streamed and whole answers agree
    assert events[-1]["usage"]["completion_tokens"] == 12
    chat = {"model": stack.model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    status, body = post_json(stack.url + "/v1/chat/completions", chat)
    assert status == 200 and body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    chunks = list(post_sse(stack.url + "/v1/chat/completions", {**chat, "stream": True}))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        body["choices"][0]["message"]["content"]


def test_each_answer_carries_its_id_in_a_header_streamed_or_not(agg):
    for stream in (False, True):
        req = urllib.request.Request(agg.url + "/v1/chat/completions", headers={"content-type": "application/json"},
                                     data=json.dumps({"model": agg.model, "max_tokens": 2, "stream": stream,
                                                      "messages": [{"role": "user", "content": "hi"}]}).encode())
        with urllib.request.urlopen(req, timeout=30) as resp:
            rid, text = resp.headers["x-request-id"], resp.read().decode()
        first = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0]) if stream else json.loads(text)
        assert rid.startswith("chatcmpl-") and first["id"] == rid, (rid, text[:300])


def test_same_greedy_text_aggregated_and_disaggregated(agg, disagg):
    for prompt in (PROMPT, "def main():", "Slurm schedules jobs on"):
        a = post_json(agg.url + "/v1/completions", {"model": agg.model, "prompt": prompt, "temperature": 0, "max_tokens": 24,
                                                    "ignore_eos": True})[1]
        d = post_json(disagg.url + "/v1/completions", {"model": disagg.model, "prompt": prompt, "temperature": 0, "max_tokens": 24,
                                                       "ignore_eos": True})[1]
        assert a["choices"][0]["text"] == d["choices"][0]["text"]


def test_disaggregated_path_really_ran(disagg):
    def served(role):
        state = json.loads((disagg.run.state / f"{role}-0.json").read_text())
        return metric_values(get_text(state["http"] + "/metrics"), "hpc_worker_requests_total")

    def direct(role):
        return _worker_metric(disagg, f"{role}-0", "hpc_worker_requests_streamed_direct")

    def moved():  # how the decode worker got the KV: with the prefill's answer (CUDA IPC, a GPU) or as bytes
        return (_worker_metric(disagg, "decode-0", "hpc_worker_kv_taken_from_answer"),
                _worker_metric(disagg, "decode-0", "hpc_worker_kv_fetched_bytes"))

    before = served("prefill"), served("decode"), direct("prefill"), direct("decode"), *moved()
    _complete(disagg)
    after = served("prefill"), served("decode"), direct("prefill"), direct("decode"), *moved()
    assert after[0] == before[0] + 1 and after[1] == before[1] + 1
    # both workers wrote their outputs straight from the engine's step (TorchEngine.stream), not via a queue
    assert after[2] == before[2] + 1 and after[3] == before[3] + 1
    # on GPUs of one node the KV came shared with the prefill's answer, no FetchKv; on CPU as bytes
    assert (after[4] - before[4], after[5] - before[5]) == ((1, 0) if torch.cuda.is_available() else (0, 1))


def test_a_disaggregated_requests_phases_are_timed_in_the_frontend_and_each_engine(disagg):
    def frontend(name):
        return metric_values(get_text(disagg.url + "/metrics"), f"hpc_frontend_{name}")

    def engine(worker, name):
        return _worker_metric(disagg, worker, f"hpc_worker_{name}")

    names = ("disagg_requests_total", "prefill_call_seconds_total", "decode_handover_seconds_total",
             "decode_first_output_seconds_total", "decode_call_seconds_total")
    engines = [(w, n) for w in ("prefill-0", "decode-0")
               for n in ("finished_requests_total", "finished_request_seconds_total")]
    before = [frontend(n) for n in names] + [engine(*e) for e in engines]
    assert _complete(disagg)[0] == 200
    after = [frontend(n) for n in names] + [engine(*e) for e in engines]
    requests, prefill_call, handover, first_output, decode_call, *in_engines = [a - b for a, b in zip(after, before)]
    prefill_done, prefill_s, decode_done, decode_s = in_engines
    assert requests == 1 and prefill_done == 1 and decode_done == 1
    assert 0 < handover and 0 < first_output < decode_call  # 11 decode tokens after the first output
    # each engine's part (its inbox to its last output) lies inside the frontend's call to its worker
    assert 0 < prefill_s < prefill_call and 0 < decode_s < decode_call
    # the event loops' latency, probed all along in the frontend's processes and each worker's
    assert frontend("loop_latency_probes_total") > 0 and frontend("loop_latency_seconds_total") > 0
    assert engine("decode-0", "worker_loop_latency_probes_total") > 0


def _worker_metric(stack, worker: str, name: str) -> float:
    state = json.loads((stack.run.state / f"{worker}.json").read_text())
    return metric_values(get_text(state["http"] + "/metrics"), name)


@pytest.mark.skipif(not nixl_available(), reason="needs the nixl extra (nixl-cu13)")
def test_kv_moved_by_nixl_gives_the_same_tokens(disagg, disagg_nixl, capsys):
    auto = "hpc_worker_kv_fetched_cuda_ipc" if torch.cuda.is_available() else "hpc_worker_kv_fetched_bytes"
    before = {disagg: _worker_metric(disagg, "decode-0", auto),
              disagg_nixl: _worker_metric(disagg_nixl, "decode-0", "hpc_worker_kv_fetched_bytes")}
    for prompt in (PROMPT, "def main():", "word " * 200):
        body = {"prompt": prompt, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
        want = post_json(disagg.url + "/v1/completions", {"model": disagg.model, **body})[1]
        got = post_json(disagg_nixl.url + "/v1/completions", {"model": disagg_nixl.model, **body})[1]
        assert "choices" in got and "choices" in want, (got, want)
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
    # every handoff of the NIXL stack went through NIXL (prefill lent, decode read), none of the other's did
    assert _worker_metric(disagg_nixl, "decode-0", "hpc_worker_kv_fetched_nixl") >= 3
    assert _worker_metric(disagg_nixl, "prefill-0", "hpc_worker_kv_lent_nixl") >= 3
    assert _worker_metric(disagg_nixl, "decode-0", "hpc_worker_kv_fetched_bytes") == before[disagg_nixl] == 0
    assert _worker_metric(disagg, "decode-0", "hpc_worker_kv_fetched_nixl") == 0
    assert _worker_metric(disagg, "decode-0", auto) == before[disagg] + 3
    from hpc.cli.main import main  # hpc status says how each decode worker's KV arrived

    assert main(["status", str(disagg_nixl.run.path), "--json"]) == 0
    health = {c["component"]: c["health"] for c in json.loads(capsys.readouterr().out)["components"]}
    assert "KV by nixl " in health["decode-0"] and "KV by" not in health["prefill-0"], health


@pytest.mark.parametrize("body,status,needle", [
    ({"prompt": "x", "temperature": 0, "max_tokens": 4}, 400, "model"),
    ({"model": "hpc/tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
    ({"model": "hpc/tiny", "prompt": "word " * 2000}, 400, "limit"),
    ({"model": "hpc/tiny", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "hpc/tiny", "prompt": [1, -2]}, 400, "integers from 0 to 2^31 - 1"),
])
def test_bad_requests_get_openai_errors(disagg, body, status, needle):
    code, resp = post_json(disagg.url + "/v1/completions", body)
    assert code == status
    assert needle in resp["error"]["message"] and resp["error"]["type"]


def test_malformed_json_and_unknown_route(disagg):
    code, resp = post_json(disagg.url + "/v1/completions", b"{not json")
    assert code == 400 and "not valid JSON" in resp["error"]["message"]
    code, resp = get_json(disagg.url + "/v1/nothing")
    assert code == 404 and "error" in resp


def test_health_models_metrics(disagg):
    code, health = get_json(disagg.url + "/health")
    assert code == 200 and health["status"] == "healthy" and health["live"] == {"prefill": 1, "decode": 1}
    assert get_json(disagg.url + "/v1/models")[1]["data"][0]["id"] == "hpc/tiny"
    text = get_text(disagg.url + "/metrics")
    assert metric_values(text, "hpc_frontend_requests_total") >= 1


def test_stop_strings_cut_the_text(agg):
    full = _complete(agg)[1]["choices"][0]["text"]
    stop = full[5:8]
    cut = _complete(agg, stop=[stop])[1]
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_client_disconnect_cancels_engine_request(agg):
    req = urllib.request.Request(agg.url + "/v1/completions", data=json.dumps(
        {"model": agg.model, "prompt": PROMPT, "temperature": 0, "max_tokens": 200, "ignore_eos": True, "stream": True}).encode(),
        headers={"content-type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=30)
    resp.readline()
    resp.close()  # the client goes away mid-stream
    state = json.loads((agg.run.state / "agg-0.json").read_text())
    import time

    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        running = metric_values(get_text(state["http"] + "/metrics"), "hpc_worker_running")
        if running == 0:
            break
        time.sleep(0.05)
    assert running == 0


def test_status_and_logs_on_the_local_profile(disagg, capsys):
    from hpc.cli.main import main

    ref = str(disagg.run.path)
    assert main(["status", ref, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["scheduler"]["state"] == "RUNNING" and data["endpoint"] == disagg.url
    phases = {c["component"]: c["phase"] for c in data["components"]}
    assert phases["etcd"] == phases["nats"] == phases["frontend"] == "ready"
    assert phases["prefill-0"] in ("registered", "first_token") and data["roles"]["decode"]["state"] == "ok"
    assert main(["status", ref]) == 0
    readiness = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("readiness: "))
    # each step's seconds in the order they came, ready last
    assert re.fullmatch(r"readiness: ready in [\d.]+ s \(etcd healthy [\d.]+ s, .*decode-0 registered [\d.]+ s.*\)",
                        readiness), readiness
    assert main(["logs", ref, "--component", "decode", "--index", "0", "-n", "5"]) == 0
    assert main(["logs", ref, "--component", "nope"]) == 2


@pytest.mark.parametrize("field, value", [("seed", 2**70), ("seed", -1), ("top_k", 10**12), ("max_tokens", 10**9),
                                          ("repetition_penalty", 0), ("repetition_penalty", 11.0),
                                          ("repetition_penalty", "1.2")])
def test_out_of_range_sampling_is_a_400_and_serving_goes_on(disagg, field, value):
    status, body = _complete(disagg, **{field: value})
    assert status == 400 and body["error"]["param"] == field
    status, body = _complete(disagg, seed=2**63 - 1, temperature=0.8)  # the largest seed still works
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    status, body = _complete(disagg, repetition_penalty=1.3)  # honoured on the decode worker, off the batched path
    assert status == 200 and body["usage"]["completion_tokens"] == 12


def test_latency_histograms_count_every_request(disagg):
    def count(name):
        return metric_values(get_text(disagg.url + "/metrics"), f"hpc_frontend_{name}_count")
    before = {n: count(n) for n in ("time_to_first_token_seconds", "request_duration_seconds",
                                    "inter_token_latency_seconds")}
    for _ in range(3):
        assert _complete(disagg)[0] == 200
    text = get_text(disagg.url + "/metrics")
    assert count("time_to_first_token_seconds") == before["time_to_first_token_seconds"] + 3
    assert count("request_duration_seconds") == before["request_duration_seconds"] + 3
    assert count("inter_token_latency_seconds") >= before["inter_token_latency_seconds"] + 3 * 11 - 3
    assert 'hpc_frontend_time_to_first_token_seconds_bucket{le="+Inf",model="hpc/tiny"}' in text


@pytest.mark.parametrize("field,value", [("best_of", 2), ("suffix", "x"), ("tools", [{"type": "function"}]),
                                         ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
                                         ("reasoning_effort", "low"),
                                         ("logit_bias", {"5": 10})])
def test_unsupported_parameters_are_refused_by_name(disagg, field, value):
    """Silently answering once when n=2 was asked, or without logprobs, would mislead the client."""
    code, resp = post_json(disagg.url + "/v1/completions", {"model": "hpc/tiny", "prompt": "x", "temperature": 0, "max_tokens": 2,
                                                            field: value})
    assert code == 400 and resp["error"]["param"] == field and resp["error"]["code"] == "unsupported_parameter"
    # the defaults many clients send with every request are fine
    code, resp = post_json(disagg.url + "/v1/completions", {"model": "hpc/tiny", "prompt": "x", "temperature": 0, "max_tokens": 2,
                                                            "n": 1, "logprobs": None, "echo": False,
                                                            "response_format": {"type": "text"}, "user": "u"})
    assert code == 200 and resp["system_fingerprint"].startswith("hpc-torch-"), resp


def test_a_chats_template_kwargs_are_the_templates_and_a_reasoning_effort_it_ignores_is_refused(disagg):
    chat = {"model": "hpc/tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 0, "max_tokens": 2}
    code, resp = post_json(disagg.url + "/v1/chat/completions", {**chat, "reasoning_effort": "low"})
    assert code == 400 and resp["error"]["param"] == "reasoning_effort" and \
        resp["error"]["code"] == "unsupported_parameter"  # the tiny model's template reads none
    code, resp = post_json(disagg.url + "/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}})
    assert code == 400 and resp["error"]["param"] == "chat_template_kwargs"
    code, resp = post_json(disagg.url + "/v1/chat/completions",
                           {**chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200, resp  # a variable this template does not read changes nothing, as in transformers
    code, resp = post_json(disagg.url + "/v1/completions", {"model": "hpc/tiny", "prompt": "x", "max_tokens": 2,
                                                            "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 400 and resp["error"]["param"] == "chat_template_kwargs"  # a completion has no template


def test_one_model_by_id(disagg):
    code, card = get_json(disagg.url + "/v1/models/hpc/tiny")
    assert code == 200 and card["id"] == "hpc/tiny" and card["object"] == "model"
    code, resp = get_json(disagg.url + "/v1/models/other")
    assert code == 404 and resp["error"]["code"] == "model_not_found"


def test_echo_with_logprobs_scores_the_prompt_on_the_prefill_worker(disagg):
    """Disaggregated: the prefill worker scores the prompt and its logprobs reach the client with the echo."""
    code, resp = post_json(disagg.url + "/v1/completions", {"model": "hpc/tiny", "prompt": "one two three four",
                                                            "max_tokens": 3, "temperature": 0, "logprobs": 1,
                                                            "echo": True, "ignore_eos": True})
    assert code == 200, resp
    lp, n = resp["choices"][0]["logprobs"], resp["usage"]["prompt_tokens"]
    assert len(lp["token_logprobs"]) == n + 3 and lp["token_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
