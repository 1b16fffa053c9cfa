"""The field's own clients, unchanged, against a stack on this machine: AIPerf, GuideLLM, lm-eval and MLPerf LoadGen.

    python benchmarks/peer_clients.py [--tools aiperf,guidellm,lm-eval,loadgen] [--recipe tiny-agg]
                                      [--venvs ~/.cache/hpc/peer-venvs] [--json OUT]

Each tool is installed, at a pinned release, in a virtualenv of its own (made once under --venvs, with this
machine's site packages visible so that torch and transformers are not fetched again) and run as its users run it,
from its own command line, against the recipe's stack. lm-eval runs both of its OpenAI model types, tokenized and
not, batched and not, on a small task shipped in benchmarks/peers/ (nothing is downloaded). A row is the tool's own
count of requests and failures beside the frontend's (hpc_frontend_errors_total: every 4xx and 5xx), and the figure
the tool is run for. The tiny model has random weights: accuracies are chance, what matters is that nothing failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

from _stack import local_stack  # noqa: E402

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"
# the releases measured (docs/performance.md); a newer one is one edit here
RELEASES = {"aiperf": "aiperf==0.13.0", "guidellm": "guidellm==0.8.1", "lm-eval": "lm-eval[api]==0.4.13",
            "loadgen": "mlcommons-loadgen==6.0.17"}


def venv_python(tool: str, root: Path) -> Path:
    """The tool's virtualenv's python, made and filled on first use (a marker names the release installed)."""
    where = root / tool
    python, marker = where / "bin" / "python", where / ".hpc-installed"
    if marker.exists() and marker.read_text() == RELEASES[tool]:
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(where)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", RELEASES[tool]], check=True)
    marker.write_text(RELEASES[tool])
    return python


def frontend_errors(url: str) -> float:
    from hpc.checks.probe import get_text

    text = get_text(url.removesuffix("/v1") + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("hpc_frontend_errors_total"))


def run(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{Path(cmd[0]).name} failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n"
                         f"{done.stderr[-3000:]}")
    return done


def aiperf(python: Path, base: str, model: str, tokenizer: str, requests: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="aiperf-") as out:
        run([str(python.parent / "aiperf"), "profile", "--model", model, "--url", base, "--endpoint-type", "chat",
             "--streaming", "--tokenizer", tokenizer, "--concurrency", "4", "--request-count", str(requests),
             "--prompt-input-tokens-mean", "64", "--prompt-input-tokens-stddev", "0",
             "--prompt-output-tokens-mean", "16", "--prompt-output-tokens-stddev", "0",
             "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--ui-type", "none",
             "--workers-max", "2", "--no-gpu-telemetry", "--output-artifact-dir", out])
        d = json.loads((Path(out) / "profile_export_aiperf.json").read_text())
    failed = sum(e.get("count", 0) for e in d.get("error_summary") or [])
    return [{"tool": "AIPerf", "mode": "chat, streaming, c=4, 64/16", "requests": int(d["request_count"]["avg"]),
             "failed": failed, "figure": f"TTFT p50 {d['time_to_first_token']['p50']:.1f} ms, ITL p50 "
             f"{d['inter_token_latency']['p50']:.2f} ms, {d['output_token_throughput']['avg']:.0f} out tok/s, "
             f"OSL {d['output_sequence_length']['min']:.0f}-{d['output_sequence_length']['max']:.0f}"}]


def guidellm(python: Path, base: str, model: str, tokenizer: str, requests: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="guidellm-") as out:
        report = Path(out) / "report.json"
        run([str(python.parent / "guidellm"), "run", "--backend", f"kind=openai_http,target={base},model={model}",
             "--profile", "kind=concurrent,streams=4", "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
             "--constraint", f"kind=max_requests,count={requests}",
             "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--disable-progress",
             "--output", f"kind=json,path={report}"], cwd=Path(out))
        bench = json.loads(report.read_text())["benchmarks"][0]
    done = bench["requests"]
    m = bench["metrics"]

    def median(name: str) -> float:
        return m[name]["successful"]["median"]
    return [{"tool": "GuideLLM", "mode": "chat, streaming, concurrent@4, 64/16",
             "requests": len(done["successful"]) + len(done["errored"]) + len(done["incomplete"]),
             "failed": len(done["errored"]) + len(done["incomplete"]),
             "figure": f"TTFT p50 {median('time_to_first_token_ms'):.1f} ms, ITL p50 "
                       f"{median('inter_token_latency_ms'):.2f} ms"}]


LM_EVAL_MODES = [  # (model type, tokenized, batch size, tasks): chat has no loglikelihood and one prompt a request
    ("local-completions", True, 1, "hpc_tiny_mc,hpc_tiny_gen"),
    ("local-completions", True, 4, "hpc_tiny_mc,hpc_tiny_gen"),
    ("local-completions", False, 1, "hpc_tiny_mc,hpc_tiny_gen"),
    ("local-completions", False, 4, "hpc_tiny_mc,hpc_tiny_gen"),
    ("local-chat-completions", False, 1, "hpc_tiny_gen"),
]


def lm_eval(python: Path, base: str, model: str, tokenizer: str, requests: int) -> list[dict]:
    rows = []
    for kind, tokenized, batch, tasks in LM_EVAL_MODES:
        path = "chat/completions" if kind == "local-chat-completions" else "completions"
        args = f"model={model},base_url={base}/v1/{path},tokenizer={tokenizer},tokenized_requests={tokenized}," \
               f"num_concurrent=2,max_retries=1"
        with tempfile.TemporaryDirectory(prefix="lm-eval-") as out:
            started = time.perf_counter()
            run([str(python.parent / "lm_eval"), "--model", kind, "--model_args", args, "--tasks", tasks,
                 "--include_path", str(PEERS / "lm_eval_tasks"), "--batch_size", str(batch),
                 "--output_path", out] + (["--apply_chat_template"] if "chat" in kind else []),
                cwd=PEERS, env={"HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
            seconds = time.perf_counter() - started
            results = json.loads(next(Path(out).rglob("results_*.json")).read_text())
        scores = ", ".join(f"{t} {m.split(',')[0]}={v:.2f}" for t, r in sorted(results["results"].items())
                           for m, v in r.items() if m.split(",")[0] in ("acc", "exact_match"))
        samples = sum(results["n-samples"][t]["effective"] for t in results["n-samples"])
        rows.append({"tool": "lm-eval", "mode": f"{kind}, tokenized={tokenized}, batch {batch}",
                     "requests": samples, "failed": 0,  # lm-eval stops on a failed request: it ran to its end
                     "figure": f"{scores} in {seconds:.1f} s"})
    return rows


def loadgen(python: Path, base: str, model: str, tokenizer: str, requests: int) -> list[dict]:
    done = run([str(python), str(PEERS / "mlperf_server.py"), "--url", base, "--model", model])
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return [{"tool": "MLPerf LoadGen", "mode": f"Server, {r['target_qps']:.0f} qps, 64/16",
             "requests": round(r["samples_per_s"] * r["seconds"]), "failed": r["http_errors"],
             "figure": f"{r['result']}: {r['samples_per_s']:.1f} samples/s, TTFT p99 {r['ttft_p99_ns'] / 1e6:.0f} ms, "
                       f"TPOT p99 {r['tpot_p99_ns'] / 1e6:.1f} ms"}]


TOOLS = {"aiperf": aiperf, "guidellm": guidellm, "lm-eval": lm_eval, "loadgen": loadgen}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, of {', '.join(TOOLS)}")
    parser.add_argument("--recipe", default="tiny-agg")
    parser.add_argument("--requests", type=int, default=100, help="AIPerf's and GuideLLM's requests")
    parser.add_argument("--venvs", type=Path, default=Path.home() / ".cache" / "hpc" / "peer-venvs")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    tools = args.tools.split(",")
    unknown = sorted(set(tools) - set(TOOLS))
    if unknown:
        parser.error(f"unknown tool(s) {', '.join(unknown)}; choose from {', '.join(TOOLS)}")
    pythons = {t: venv_python(t, args.venvs) for t in tools}
    rows = []
    with local_stack(args.recipe) as (rundir, url):
        base = url.removesuffix("/v1")
        model = rundir.manifest().recipe.model
        tokenizer = str(Path(model.tokenizer or model.path).expanduser())
        for tool in tools:
            before = frontend_errors(url)
            got = TOOLS[tool](pythons[tool], base, model.served_name, tokenizer, args.requests)
            errors = frontend_errors(url) - before
            rows += [{**row, "frontend_errors": int(errors)} for row in got]
    print(f"{'tool':<15} {'mode':<50} {'requests':>8} {'failed':>6} {'4xx/5xx':>7}  figure")
    for r in rows:
        print(f"{r['tool']:<15} {r['mode']:<50} {r['requests']:>8} {r['failed']:>6} {r['frontend_errors']:>7}  "
              f"{r['figure']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
