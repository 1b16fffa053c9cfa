"""`hpc profile`: input checks, the plan (dry run), the SLA choice and what it writes, and a real profile of the
tiny model on this machine that resumes from its JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from hpc.cli.main import main
from hpc.profile import choose as pick
from hpc.profile.plan import isl_points, points, profile_recipe
from hpc.profile.spec import ProfileRequest
from hpc.resolve import resolve, resolve_specs
from hpc.spec.catalog import load_recipe
from hpc.spec.global_router import parse_global_router

ARGS = ["profile", "-r", "tiny-disagg", "--isl", "64", "--osl", "16", "--ttft", "100", "--itl", "20"]


@pytest.mark.unit
@pytest.mark.parametrize("extra, expect", [
    (["--isl", "-5"], "--isl: must be a positive number (got -5)"),
    (["--itl", "0"], "--itl: must be a positive number (got 0)"),
    (["--isl", "4096"], "limits.max_input_tokens: --isl 4096 is above the recipe's limits.max_input_tokens 512"),
    (["--tp", "3"], "--tp: size 3 does not divide the 8 GPUs of a node of 'local'"),
    (["--tp", "1,2,4,8"], "the profile keeps a prefill and a decode engine of each TP size warm: 30 GPUs"),
    (["--tp", "1,2", "--max-gpus", "4"], "6 GPUs for --tp 1,2, above the 4 allowed"),
    (["-r", "tiny-video"], "modality: hpc profile sizes text serving"),
    (["-r", "tiny-pools"], "roles.prefill.pools: a profile sizes one layout"),
])
def test_bad_inputs_are_one_line_and_exit_2(extra, expect, capsys, tmp_path):
    args = [*ARGS, *extra]
    if extra[:1] == ["-r"]:  # another recipe
        args = [a for a in args if a != "tiny-disagg"]
        args.remove("-r")
    assert main([*args, "--dry-run", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert expect in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "p").exists()


@pytest.mark.unit
def test_dry_run_prints_the_plan_and_writes_nothing(capsys, tmp_path):
    assert main([*ARGS, "--tp", "1,2", "--max-concurrency", "8", "--dry-run", "--out", str(tmp_path / "p")]) == 0
    out = capsys.readouterr().out
    assert "engine prefill-tp2: TP 2, 4 points" in out and "engine decode-tp1: TP 1, 4 points" in out
    assert re.search(r"decode-0 \(decode-tp2\)\s+2\s", out) and "(disagg form)" in out and "points: 16; estimated" in out
    assert not (tmp_path / "p").exists()


@pytest.mark.unit
def test_the_profile_recipe_holds_one_engine_per_phase_and_tp_in_the_profilers_form():
    recipe, path = load_recipe("tiny-disagg")
    prof = profile_recipe(recipe, [2, 1], "agg")
    pools = {p.name: p for p in prof.roles.agg.pools}
    assert list(pools) == ["prefill-tp2", "decode-tp2", "prefill-tp1", "decode-tp1"]  # whole nodes first
    assert pools["prefill-tp2"].tensor_parallel_size == 2
    assert pools["prefill-tp2"].override_engine_args["kv_cache_config"] == {"enable_block_reuse": False}
    assert pools["decode-tp1"].override_engine_args["kv_cache_config"] == {"enable_block_reuse": True}
    r = resolve("local", "tiny-disagg")
    resolved = resolve_specs(r.cluster, Path(r.cluster_file), prof, path)
    assert resolved.engine_args["decode-tp2"]["tensor_parallel_size"] == 2
    assert [w.tasks for w in resolved.plan.workers] == [2, 2, 1, 1]


@pytest.mark.unit
def test_the_disaggregated_form_addresses_every_prefill_and_decode_pool_by_priority():
    recipe, path = load_recipe("tiny-disagg")
    prof = profile_recipe(recipe, [1, 2])
    assert recipe.roles.prefill.pools is None and [p.name for p in prof.roles.prefill.pools] == [
        "prefill-tp2", "prefill-tp1"]
    config = parse_global_router(prof.frontend.global_router, "profile")
    req = ProfileRequest(isl=64, osl=16, ttft_ms=100, itl_ms=20, tps=[1, 2])
    for point in points(recipe, req, {}):
        names = config.pools(point.phase)
        pool = config.prefill_pool(64, None, point.priority) if point.phase == "prefill" else \
            config.decode_pool(64, None, point.priority)
        assert names[pool] == point.pool, point
    # a decode point is fed by the largest prefill engine
    decode_tp1 = next(p for p in points(recipe, req, {}) if p.pool == "decode-tp1")
    assert config.pools("prefill")[config.prefill_pool(64, None, decode_tp1.priority)] == "prefill-tp2"


def _points(ttft: dict[int, dict[int, float]], decode: dict[int, dict[int, tuple[float, float]]]) -> list[dict]:
    out = [{"phase": "prefill", "tp": tp, "isl": isl, "concurrency": 1, "ttft_ms": t, "itl_ms": None,
            "tok_s": 1.0, "valid": True} for tp, curve in ttft.items() for isl, t in curve.items()]
    out += [{"phase": "decode", "tp": tp, "isl": 64, "concurrency": c, "ttft_ms": 1.0, "itl_ms": itl,
             "tok_s": tok_s, "valid": True} for tp, levels in decode.items() for c, (itl, tok_s) in levels.items()]
    return out


@pytest.mark.unit
def test_the_choice_is_the_most_per_gpu_throughput_that_meets_the_sla_and_regions_become_a_router_grid():
    req = ProfileRequest(isl=64, osl=16, ttft_ms=100, itl_ms=20, tps=[1, 2])
    # TP 1: cheap but slow on long inputs; TP 2: fast. Decode: TP 1 meets 20 ms up to c=4, TP 2 up to c=8.
    points = _points({1: {16: 20, 32: 40, 64: 80, 128: 160}, 2: {16: 10, 32: 20, 64: 50, 128: 90}},
                     {1: {1: (5, 100), 4: (15, 300), 8: (30, 500)}, 2: {1: (4, 120), 4: (8, 400), 8: (12, 700)}})
    assert pick.ttft_at(points, 1, 48) == 60  # between 40 at 32 and 80 at 64
    choice = pick.choose(points, req)
    assert choice["prefill"]["chosen"]["tp"] == 1  # 64 / 0.080 s / 1 GPU = 800 beats 64 / 0.050 / 2 = 640
    # TP 1 meets 20 ms up to c=4 (300 tok/s per GPU); TP 2 up to c=8 (700 / 2 = 350 per GPU): TP 2
    assert choice["decode"]["chosen"] == {"tp": 2, "concurrency": 8, "itl_ms": 12, "meets": True, "tok_s": 700,
                                          "tok_s_per_gpu": 350}
    grid = pick.router_grid(points, req, isl_points(req, 512))
    config = parse_global_router(grid, "grid")  # Dynamo's format, checked like a user's
    assert config.pools("prefill") == ["prefill-tp1", "prefill-tp2"]
    # long inputs (row around 112 tokens: TP 1 140 ms, TP 2 80 ms) at a 100 ms target: only TP 2 meets it;
    # at 150 ms both do and TP 1 gives more per GPU; short inputs go to TP 1
    assert config.prefill_pool(120, 100) == 1 and config.prefill_pool(120, 150) == 0
    assert config.prefill_pool(16, 50) == 0
    # decode at a 10 ms ITL target: only TP 2 (8 ms at c=4); at 20 ms TP 2's c=8 (350 per GPU) beats TP 1's 300
    assert config.decode_pool(64, 10) == config.pools("decode").index("decode-tp2")
    recipe, _ = load_recipe("tiny-disagg")
    emitted = pick.emitted_recipe(recipe, choice, req)
    assert emitted.roles.decode.override_engine_args == {"tensor_parallel_size": 2}
    assert emitted.roles.decode.tensor_parallel_size == 2 and emitted.roles.prefill.tensor_parallel_size == 1
    assert emitted.benchmark.concurrency == [1, 8] and emitted.benchmark.shapes[0].input_tokens == 64
    pooled = pick.pooled_recipe(emitted, grid, "gr.json")
    assert [(p.name, p.tensor_parallel_size) for p in pooled.roles.prefill.pools] == [("prefill-tp1", 1),
                                                                                       ("prefill-tp2", 2)]


@pytest.mark.unit
def test_no_size_meeting_the_sla_picks_the_closest_and_says_so():
    req = ProfileRequest(isl=64, osl=16, ttft_ms=1, itl_ms=1, tps=[1, 2])
    points = _points({1: {64: 80}, 2: {64: 25}}, {1: {1: (5, 100)}, 2: {1: (4, 120)}})
    choice = pick.choose(points, req)
    assert choice["prefill"]["chosen"]["tp"] == 2 and not choice["prefill"]["chosen"]["meets"]
    assert choice["decode"]["chosen"]["tp"] == 2 and not choice["decode"]["chosen"]["meets"]


@pytest.mark.integration
def test_a_real_profile_writes_a_recipe_that_validates_and_resumes(tmp_path, model_cache, monkeypatch, capsys):
    from tests.runtime.conftest import free_port

    monkeypatch.setenv("HPC_RUNS_DIR", str(tmp_path / "runs"))
    out = tmp_path / "prof"
    args = [*ARGS, "--tp", "1", "--max-concurrency", "2", "--requests", "4", "--out", str(out),
            "--set", f"model.path={model_cache / 'tiny'}", "--set", f"frontend.port={free_port()}"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "profile.json").read_text())
    assert sorted(results["points"]) == ["decode/tp1/c1", "decode/tp1/c2", "prefill/tp1/isl128",
                                         "prefill/tp1/isl16", "prefill/tp1/isl32", "prefill/tp1/isl64"]
    assert all(p["valid"] for p in results["points"].values())
    assert results["points"]["decode/tp1/c2"]["concurrency"] == 2 and results["points"]["decode/tp1/c2"]["tok_s"] > 0
    assert results["choice"]["decode"]["chosen"]["tp"] == 1
    assert "<- chosen" in printed and (out / "prefill_ttft_vs_isl.png").stat().st_size > 1000
    emitted = yaml.safe_load((out / "recipe.yaml").read_text())
    assert emitted["name"] == "tiny-disagg-sla"
    assert main(["validate", "-r", str(out / "recipe.yaml")]) == 0
    # an interrupted profile: one point lost; the rerun measures only that one
    del results["points"]["decode/tp1/c2"]
    (out / "profile.json").write_text(json.dumps(results))
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "resuming: 5 of 6 points measured before" in printed and "[6/6] decode-tp1 c=2" in printed
    assert "[5/6]" not in printed
    assert main([*args[:-4], "--isl", "32", *args[-4:]]) == 2  # other inputs in the same directory
    assert "holds a profile of something else" in capsys.readouterr().err


@pytest.mark.unit
def test_an_aggregated_recipe_gets_a_ttft_itl_grid_over_pools_of_the_winning_sizes():
    req = ProfileRequest(isl=64, osl=16, ttft_ms=100, itl_ms=20, tps=[1, 2])
    # TP 1: TTFT 80 ms, 300 tok/s at 15 ms; TP 2: TTFT 40 ms, 700 tok/s (350 per GPU) at 12 ms
    points = _points({1: {64: 80}, 2: {64: 40}}, {1: {1: (5, 100), 4: (15, 300)}, 2: {1: (4, 120), 8: (12, 700)}})
    grid = pick.agg_router_grid(points, req)
    config = parse_global_router(grid, "grid")
    names = config.pools("agg")
    assert names == ["agg-tp1", "agg-tp2"]
    assert names[config.agg_pool(ttft_ms=50, itl_ms=20)] == "agg-tp2"  # only TP 2 prefills within 50 ms
    assert names[config.agg_pool(ttft_ms=100, itl_ms=30)] == "agg-tp2"  # both meet: 350 per GPU beats 300
    points = _points({1: {64: 80}, 2: {64: 40}}, {1: {1: (5, 100), 4: (15, 400)}, 2: {1: (4, 120), 8: (12, 700)}})
    names = parse_global_router(pick.agg_router_grid(points, req), "grid").pools("agg")
    config = parse_global_router(pick.agg_router_grid(points, req), "grid")
    assert names[config.agg_pool(ttft_ms=100, itl_ms=30)] == "agg-tp1"  # now TP 1's 400 per GPU wins there
    recipe, _ = load_recipe("tiny-agg")
    pooled = pick.pooled_recipe(recipe, pick.agg_router_grid(points, req), "gr.json")
    assert [(p.name, p.tensor_parallel_size) for p in pooled.roles.agg.pools] == [("agg-tp1", 1), ("agg-tp2", 2)]


@pytest.mark.unit
def test_the_aggregated_form_addresses_every_engine_by_priority_too():
    recipe, _ = load_recipe("tiny-disagg")
    prof = profile_recipe(recipe, [1, 2], "agg")
    config = parse_global_router(prof.frontend.global_router, "profile")
    req = ProfileRequest(isl=64, osl=16, ttft_ms=100, itl_ms=20, tps=[1, 2])
    for point in points(recipe, req, {}, "agg"):
        assert config.pools("agg")[config.agg_pool(priority=point.priority)] == point.pool, point


@pytest.mark.unit
def test_each_prefill_point_sends_prompts_no_earlier_point_began_with(monkeypatch):
    """One seed for every point made a longer prompt begin with the shorter points' tokens, which the prefill
    worker's prefix cache held: TTFT came out too low. Each point draws from a seed of its own, the same on a
    rerun (a resumed profile measures what it would have)."""
    import random

    from hpc.bench import clients, loadgen
    from hpc.profile.plan import Point
    from hpc.profile.sweep import measure

    seeds = []

    async def fake_level(url, model, level, streaming, warmup, seed=0, processes=1):
        seeds.append(seed)
        assert processes == 1  # one user per point here: one client process
        percentile = {"p50": 0.01}
        return {"ttft_s": percentile, "tpot_s": percentile, "output_tokens_per_s": 1.0, "valid": True,
                "invalid_reasons": []}

    monkeypatch.setattr(clients, "run_level", fake_level)
    req = ProfileRequest(isl=64, osl=16, ttft_ms=100, itl_ms=20, tps=[1])
    short, long = (Point("prefill", 1, "prefill-tp1", 0, isl, 1, 1) for isl in (32, 64))
    for point in (short, long, short):
        measure(point, req, "http://x", "m")
    assert seeds[0] != seeds[1] and seeds[2] == seeds[0]
    first = loadgen.prompt_ids(32, random.Random(seeds[0]))
    assert loadgen.prompt_ids(64, random.Random(seeds[1]))[:32] != first
