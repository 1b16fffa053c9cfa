"""hpc bench: consistent numbers against real stacks; the validity gate against misbehaving servers."""

from __future__ import annotations

import asyncio
import json
import os
import threading

import pytest
from PIL import Image

from hpc.bench.clients import run_sweep
from hpc.bench.loadgen import Level
from hpc.cli.main import main
from hpc.runtime.serve.http import HttpServer, Response, json_response
from hpc.checks.probe import get_text, metric_values
from tests.runtime.conftest import free_port, stack_fixture

mock = stack_fixture("mock-agg", "--set", "mock.per_token_delay_ms=1")
disagg = stack_fixture("tiny-disagg")


@pytest.mark.integration
def test_bench_against_mock_run_is_consistent_and_plots(mock, tmp_path, capsys):
    before = metric_values(get_text(mock.url + "/metrics"), "hpc_frontend_completion_tokens_total")
    out = tmp_path / "b"
    assert main(["bench", str(mock.run.path), "--concurrency", "1,4", "--input-tokens", "16",
                 "--output-tokens", "8", "--requests", "12", "--warmup", "0", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    after = metric_values(get_text(mock.url + "/metrics"), "hpc_frontend_completion_tokens_total")
    assert sum(lv["output_tokens_total"] for lv in res["levels"]) == after - before == 2 * 12 * 8
    # per request, as asked (the table's `out` and `out/req`), not the level's total
    assert [(lv["output_tokens"], lv["output_tokens_per_request"]) for lv in res["levels"]] == [(8, 8.0)] * 2
    for lv in res["levels"]:
        assert lv["valid"] and lv["completed"] == 12
        assert lv["ttft_s"]["p50"] <= lv["e2e_s"]["p50"] and lv["ttft_s"]["p99"] <= lv["e2e_s"]["p99"]
        assert lv["itl_s"]["p50"] is not None
    for png in ("throughput_vs_latency.png", "ttft_itl_vs_concurrency.png"):
        with Image.open(out / png) as img:
            assert img.format == "PNG" and img.size[0] > 100
    assert (out / "results.csv").read_text().count("\n") == 3
    cmp = tmp_path / "cmp"
    assert main(["bench", "--compare", str(out), str(out), "--out", str(cmp)]) == 0
    assert (cmp / "throughput_vs_latency.png").is_file()
    assert res["client"]["pid"] == os.getpid()  # this process generated the load


@pytest.mark.integration
def test_bench_in_job_generates_the_load_in_a_job_of_the_runs_cluster_and_relays_it(mock, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)  # the job gets the run by its path and --out made absolute, not this directory
    assert main(["bench", str(mock.run.path), "--in-job", "--concurrency", "2", "--input-tokens", "16",
                 "--output-tokens", "8", "--requests", "8", "--warmup", "0", "--out", "b"]) == 0
    relayed = capsys.readouterr()
    assert relayed.out.startswith("load generator: job ") and "submitit INFO" not in relayed.out
    assert "c=2 in=16 out=8: 8/8 requests" in relayed.err  # the job's progress, as it came
    assert next(ln for ln in relayed.out.splitlines() if ln.split()[:1] == ["2"]).split()[4] == "8"  # its table
    res = json.loads((tmp_path / "b" / "results.json").read_text())
    assert res["client"]["pid"] != os.getpid() and res["levels"][0]["completed"] == 8  # another process sent them
    assert list((mock.run.path / "bench-jobs").glob("*_result.pkl"))  # submitit's job, in the run directory
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--in-job"]) == 2
    assert "--in-job runs on a run's cluster" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_against_tiny_disagg_counts_match_server(disagg, tmp_path):
    from hpc.bench.engines import EngineCounters, metrics_urls

    urls = metrics_urls(disagg.run.path)
    assert sorted(urls) == ["decode-0", "prefill-0"]
    res = run_sweep(disagg.url, disagg.model, [Level(2, 32, 6, 8)], streaming=True, warmup=1, show_progress=False,
                    engines=EngineCounters(urls))
    (lv,) = res
    assert lv["valid"] and lv["output_tokens_total"] == 8 * 6 and lv["peak_inflight"] == 2
    assert lv["ttft_s"]["p50"] <= lv["e2e_s"]["p50"]
    # the prefill's time and the decode's, over the client's: a share of it, the hops the rest
    assert 0.05 < lv["in_engines"] < 1.0, lv["in_engines"]


class FakeServer:
    """An OpenAI-ish server that misbehaves on purpose."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.count = 0
        self.port = free_port()
        self.asked: list[int] = []  # each request's max_tokens
        self.prompts: list[tuple[int, ...]] = []  # and its prompt
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(5)

    async def handle(self, req) -> Response:
        self.count += 1
        body = json.loads(req.body)
        self.asked.append(body["max_tokens"])
        self.prompts.append(tuple(body["prompt"]))
        if self.behaviour == "fail-quarter" and self.count % 4 == 0:
            return json_response({"error": {"message": "overloaded", "type": "server_error", "code": 503}}, 503)
        tokens = 0 if self.behaviour == "empty" else body["max_tokens"]
        text = "" if self.behaviour == "empty" else "x" * tokens
        if body.get("stream") and self.behaviour == "chunked":  # 1 token, then 3 and 4 at 40 ms intervals
            async def chunks():
                for piece in ("x", "xxx", "xxxx"):
                    yield b'data: {"choices": [{"text": "' + piece.encode() + b'"}]}\n\n'
                    await asyncio.sleep(0.04)
                yield b'data: {"choices": [], "usage": {"completion_tokens": 8}}\n\n'
                yield b"data: [DONE]\n\n"
            return Response(content_type="text/event-stream", stream=chunks())
        if body.get("stream"):
            async def events():
                if text:
                    yield b'data: {"choices": [{"text": "' + text.encode() + b'"}]}\n\n'
                yield b'data: {"choices": [], "usage": {"completion_tokens": %d}}\n\n' % tokens
                yield b"data: [DONE]\n\n"
            return Response(content_type="text/event-stream", stream=events())
        return json_response({"choices": [{"text": text}], "usage": {"completion_tokens": tokens}})

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = HttpServer(self.handle)
        self.loop.run_until_complete(server.start("127.0.0.1", self.port))
        self.ready.set()
        self.loop.run_forever()


@pytest.mark.unit
@pytest.mark.parametrize("streaming", [True, False])
def test_gate_flags_empty_text(streaming):
    srv = FakeServer("empty")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(2, 8, 4, 20)], streaming, 0, False)
    assert not lv["valid"] and "no output tokens" in lv["invalid_reasons"]


@pytest.mark.unit
def test_gate_flags_quarter_failures_and_cli_exits_nonzero(tmp_path):
    srv = FakeServer("fail-quarter")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(1, 8, 4, 40)], True, 0, False)
    assert not lv["valid"] and lv["failure_rate"] == pytest.approx(0.25, abs=0.03)
    assert any("failed" in r for r in lv["invalid_reasons"]) and lv["output_tokens_total"] > 0
    code = main(["bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m", "--concurrency", "2",
                 "--requests", "20", "--warmup", "0", "--out", str(tmp_path / "o")])
    assert code == 1
    assert json.loads((tmp_path / "o" / "results.json").read_text())["valid"] is False


@pytest.mark.unit
def test_output_lengths_spread_around_the_level_and_a_negative_spread_is_refused(tmp_path, capsys):
    srv = FakeServer("good")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(4, 8, 20, 80, output_spread=10)], True, 0, False)
    assert lv["valid"] and len(srv.asked) == 80 and min(srv.asked) >= 10 and max(srv.asked) <= 30
    assert len(set(srv.asked)) > 5 and lv["output_tokens_total"] == sum(srv.asked)  # not 80 equal requests
    code = main(["bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m", "--output-spread", "-1",
                 "--out", str(tmp_path / "o")])
    assert code == 2 and "--output-spread -1 is negative" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and len(srv.asked) == 80  # nothing sent, nothing written


@pytest.mark.unit
def test_time_per_output_token_is_per_token_when_events_carry_several(tmp_path):
    srv = FakeServer("chunked")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(1, 8, 8, 4)], True, 0, False)
    # 80 ms from the first token to the last over 7 tokens: ~11 ms each; the gaps between events are 40 ms
    assert 0.009 <= lv["tpot_s"]["p50"] <= 0.02 and lv["itl_s"]["p50"] >= 0.035
    assert main(["bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m", "--concurrency", "1",
                 "--input-tokens", "8", "--output-tokens", "8", "--requests", "4", "--warmup", "0",
                 "--out", str(tmp_path / "o")]) == 0
    row = (tmp_path / "o" / "results.csv").read_text().splitlines()
    assert "tpot_p50_ms" in row[0].split(",") and row[1].split(",")[row[0].split(",").index("tpot_p50_ms")]


@pytest.mark.unit
def test_gate_passes_a_good_server():
    srv = FakeServer("good")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(4, 8, 5, 40)], True, 0, False)
    assert lv["valid"] and lv["output_tokens_total"] == 200 and lv["failure_rate"] == 0


@pytest.mark.unit
def test_a_level_that_never_reached_its_concurrency_is_invalid_and_the_default_sends_enough(tmp_path):
    srv = FakeServer("good")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(32, 8, 4, 16)], True, 0, False)
    assert not lv["valid"] and lv["peak_inflight"] == 16
    assert "never had 32 requests in flight (peak 16)" in lv["invalid_reasons"][0]
    assert main(["bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m", "--concurrency", "1,32",
                 "--input-tokens", "8", "--output-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "o")]) == 0
    levels = json.loads((tmp_path / "o" / "results.json").read_text())["levels"]
    assert [(lv["requests"], lv["peak_inflight"], lv["valid"]) for lv in levels] == [(64, 1, True), (128, 32, True)]


def test_bench_sends_sla_targets_and_priority_as_the_global_router_reads_them():
    from hpc.bench.loadgen import Level

    assert Level(1, 8, 8, 4).routing_fields() == {}
    assert Level(1, 8, 8, 4, ttft_target_ms=50, priority=3).routing_fields() == {
        "extra_args": {"ttft_target": 50}, "nvext": {"agent_hints": {"priority": 3}}}


@pytest.mark.unit
def test_each_level_sends_prompts_of_its_own_and_a_seed_repeats_them(tmp_path):
    """One seed for every level made each level begin with the previous level's prompts (prefix-cache hits)."""
    srv = FakeServer("good")
    levels = [Level(1, 8, 4, 6), Level(2, 8, 4, 6)]
    run_sweep(f"http://127.0.0.1:{srv.port}", "m", levels, True, 0, False)
    first, second = srv.prompts[:6], srv.prompts[6:12]
    assert len(set(first)) == 6 and not set(first) & set(second)
    run_sweep(f"http://127.0.0.1:{srv.port}", "m", levels, True, 0, False)  # the same seed: the same prompts
    assert srv.prompts[12:18] == first and set(srv.prompts[18:]) == set(second)
    run_sweep(f"http://127.0.0.1:{srv.port}", "m", levels[:1], True, 0, False, seed=2)  # past both levels' seeds
    assert not set(srv.prompts[24:]) & set(srv.prompts[:12])
    assert main(["bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m", "--concurrency", "1",
                 "--input-tokens", "8", "--output-tokens", "4", "--requests", "4", "--warmup", "0", "--seed", "7",
                 "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "results.json").read_text())["seed"] == 7


@pytest.mark.unit
@pytest.mark.parametrize("concurrency,requests,processes,users,shares", [
    (64, 256, 4, [16] * 4, [64] * 4),
    (5, 21, 2, [3, 2], [13, 8]),  # uneven: what division leaves goes to the first
    (2, 8, 6, [1, 1], [4, 4]),  # never more processes than users
])
def test_a_level_splits_over_client_processes(concurrency, requests, processes, users, shares):
    from hpc.bench.clients import shares as split

    parts = split(Level(concurrency, 8, 4, requests), processes)
    assert [p.concurrency for p in parts] == users and [p.requests for p in parts] == shares
    assert {(p.input_tokens, p.output_tokens) for p in parts} == {(8, 4)}


@pytest.mark.unit
def test_auto_gives_a_client_process_per_16_users_within_half_the_cores():
    from hpc.bench.clients import processes_for

    assert [processes_for("auto", c, 32) for c in (1, 16, 17, 64, 512)] == [1, 1, 2, 4, 16]
    assert processes_for("auto", 64, 2) == 1 and processes_for(3, 64, 2) == 3 and processes_for(8, 2, 32) == 2
    assert processes_for("3", 64, 2) == 3  # as --client-processes gives it


@pytest.mark.unit
def test_users_in_client_processes_send_every_request_once_with_prompts_of_their_own(tmp_path):
    srv = FakeServer("good")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(6, 8, 5, 30)], True, 1, False, processes=3)
    assert lv["valid"] and lv["client_processes"] == 3 and lv["completed"] == 30
    assert lv["output_tokens_total"] == 150 and lv["peak_inflight"] == 6 and lv["client_cpu_s"] > 0
    assert srv.count == 30 + 3 and len(set(srv.prompts)) == 33  # one warm-up each; no process repeats another
    assert 0 < lv["ttft_s"]["p50"] <= lv["e2e_s"]["p50"] and lv["duration_s"] > 0
    from hpc.bench.report import table

    assert "spread over them): c=6: 3\n" in table({"levels": [lv]})  # the table says how it was loaded


@pytest.mark.unit
def test_the_table_flags_levels_shorter_than_a_second():
    from hpc.bench.report import table

    srv = FakeServer("good")
    (lv,) = run_sweep(f"http://127.0.0.1:{srv.port}", "m", [Level(2, 8, 4, 8)], True, 0, False)
    assert 0 < lv["duration_s"] < 1
    flagged = table({"levels": [lv, {**lv, "concurrency": 8, "duration_s": 2.5}]}).splitlines()[-1]
    assert flagged.startswith("levels under 1 s") and "--requests-per-user" in flagged
    assert flagged.endswith(f"c=2: {lv['duration_s']:.2f} s")  # the 2.5 s level is not named
    assert "levels under" not in table({"levels": [{**lv, "duration_s": 2.5}]})


@pytest.mark.unit
@pytest.mark.parametrize("value", ["0", "-2", "two", "$(reboot)"])
def test_a_bad_client_processes_is_refused_by_name(value, tmp_path, capsys):
    code = main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", "--client-processes", value,
                 "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and "--client-processes" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.unit
def test_requests_per_user_sets_each_level_s_floor_and_a_bad_one_is_refused(tmp_path, capsys):
    srv = FakeServer("good")
    url = f"http://127.0.0.1:{srv.port}"
    assert main(["bench", "--url", url, "--model", "m", "--concurrency", "1,3", "--requests-per-user", "30",
                 "--output-tokens", "2", "--warmup", "0", "--client-processes", "1", "--out", str(tmp_path / "o")]) == 0
    levels = json.loads((tmp_path / "o" / "results.json").read_text())["levels"]
    # --url has no recipe: its floor of 64 a level holds at c=1, 30 a user lifts c=3 to 90
    assert [lv["requests"] for lv in levels] == [64, 90] and srv.count == 64 + 90
    for bad, says in ((["--requests-per-user", "0"], "--requests-per-user 0 is not a count"),
                      (["--requests-per-user", "8", "--requests", "10"], "--requests and --requests-per-user both")):
        code = main(["bench", "--url", url, "--model", "m", *bad, "--out", str(tmp_path / "bad")])
        err = capsys.readouterr().err
        assert code == 2 and says in err and "Traceback" not in err
    assert not (tmp_path / "bad").exists() and srv.count == 64 + 90  # nothing sent, nothing written


@pytest.mark.unit
def test_a_sweep_stopped_midway_keeps_the_levels_it_finished(tmp_path, monkeypatch, capsys):
    from hpc.bench import clients

    srv = FakeServer("good")
    real = clients.run_level

    async def until_the_second_level(url, model, level, *args, **kwargs):
        if level.concurrency == 4:
            raise KeyboardInterrupt  # Ctrl-C during the second level
        return await real(url, model, level, *args, **kwargs)

    monkeypatch.setattr(clients, "run_level", until_the_second_level)
    code = main(["bench", "--url", f"http://127.0.0.1:{srv.port}", "--model", "m", "--concurrency", "1,4",
                 "--input-tokens", "8", "--output-tokens", "4", "--warmup", "0", "--out", str(tmp_path / "o")])
    assert code == 130
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    first = saved["levels"][0]
    assert [lv["concurrency"] for lv in saved["levels"]] == [1] and first["completed"] == first["requests"] > 0
    assert saved["valid"] is False and saved["interrupted"] == "after 1 of 2 levels"
    assert "interrupted after 1 of 2 levels" in capsys.readouterr().err


@pytest.mark.unit
def test_events_read_together_share_the_gap_since_the_last_read(monkeypatch):
    """Several SSE events in one read got one timestamp, so ITL p50 read 0.0 at c=1 where the stack's tokens come
    several to a read; the gap since the last read is spread over them."""
    import json as _json

    from hpc.bench import loadgen

    clock = iter([1.0, 1.3, 1.9])
    monkeypatch.setattr(loadgen.time, "perf_counter", lambda: next(clock))
    sample = loadgen.Sample(ok=False)
    events = loadgen._Events(sample, t0=0.5)

    def ev(text):
        return b"data: " + _json.dumps({"choices": [{"text": text}]}).encode() + b"\n\n"
    events.feed(ev("a"))  # the first token at 1.0
    events.feed(ev("b") + ev("c") + ev("d"))  # three at 1.3: 0.1 each
    events.feed(ev("e") + ev("f"))  # two at 1.9: 0.3 each
    assert sample.ttft == pytest.approx(0.5)
    assert sample.itls == pytest.approx([0.1, 0.1, 0.1, 0.3, 0.3])
