"""Smoke checks of a running job, and the validity gate: every role really served.

`python -m hpc.checks.smoke MANIFEST` runs them here; `hpc smoke RUN` runs them through submitit on the
job's cluster (its local executor on the local profile). The verdict lands in smoke.json.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import time
from pathlib import Path
from typing import Any, Callable

from hpc.manifest import Manifest
from hpc.rundir import RunDir, RunLayout, read_json, write_json
from hpc.waiting import wait_until
from hpc.checks.probe import get_json, get_text, metric_values, post_json, post_sse


class CheckFailed(Exception):
    """A smoke check's verdict: explicit, so `python -O` (which strips assert) cannot turn a failure into a pass."""


def require(condition: object, detail: object) -> None:
    if not condition:
        raise CheckFailed(str(detail))


def _tiny_png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 90)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _decode_mp4(data: bytes) -> tuple[tuple[int, ...], float]:
    """(frames, height, width, channels) and the frame rate of an MP4, decoded as a player would."""
    import tempfile

    from hpc.runtime.engine.video.mp4 import read_mp4

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames, fps = read_mp4(Path(f.name))
    return tuple(frames.shape), fps


def _worker_requests(manifest: Manifest) -> dict[str, float]:
    """Requests each role's workers served so far, read from their own /metrics."""
    totals: dict[str, float] = {}
    for w in manifest.plan.workers:
        state = read_json(RunLayout.of(manifest.run_dir).component_state(w.name)) or {}
        url = state.get("http")
        value = 0.0
        if url:
            try:
                value = metric_values(get_text(url + "/metrics"), "hpc_worker_requests_total")
            except OSError:
                value = 0.0
        totals[w.role.value] = totals.get(w.role.value, 0.0) + value
    return totals


class _Checks:
    """The smoke checks against one run's frontend; each returns its detail or raises what failed."""

    def __init__(self, recipe: Any, url: str) -> None:
        self.recipe, self.url = recipe, url
        self.model, self.n = recipe.model.served_name, recipe.smoke.max_tokens

    def health(self) -> str:
        status, body = get_json(self.url + "/health")
        expected = {role.value: spec.total_count for role, spec in self.recipe.roles.items()}
        require(status == 200 and body["live"] == expected, f"live {body and body.get('live')} != {expected}")
        return f"live instances {body['live']}"

    def models(self) -> str:
        _, body = get_json(self.url + "/v1/models")
        ids = [m["id"] for m in body["data"]]
        require(self.model in ids, f"{ids}")
        return f"models {ids}"

    def _completion_body(self, stream: bool) -> dict[str, Any]:
        return {"model": self.model, "prompt": self.recipe.smoke.prompt, "max_tokens": self.n, "ignore_eos": True,
                **({"stream": True} if stream else {})}

    def completion(self) -> str:
        status, body = post_json(self.url + "/v1/completions", self._completion_body(False))
        text = body["choices"][0]["text"]
        require(status == 200 and text, f"status {status}, empty text")
        return f"{body['usage']['completion_tokens']} tokens: {text[:40]!r}"

    def completion_stream(self) -> str:
        events = list(post_sse(self.url + "/v1/completions", self._completion_body(True)))
        require(not any("error" in e for e in events), events[-1] if events else "no events")
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        require(text, "empty streamed text")
        return f"{len(events)} events: {text[:40]!r}"

    def _chat_body(self, stream: bool) -> dict[str, Any]:
        content: Any = "Say hello."
        if self.recipe.model.multimodal:
            content = [{"type": "text", "text": "Describe"},
                       {"type": "image_url", "image_url": {"url": self.recipe.smoke.image or _tiny_png()}}]
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": self.n,
                "stream": stream, "ignore_eos": True}

    def chat(self) -> str:
        status, body = post_json(self.url + "/v1/chat/completions", self._chat_body(False))
        text = body["choices"][0]["message"]["content"]
        require(status == 200 and text, f"status {status}: {body}")
        return f"{text[:40]!r}"

    def chat_stream(self) -> str:
        events = list(post_sse(self.url + "/v1/chat/completions", self._chat_body(True)))
        require(not any("error" in e for e in events), events[-1] if events else "no events")
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e.get("choices"))
        require(text, "empty streamed text")
        return f"{len(events)} events"

    def video(self, response_format: str) -> Callable[[], str]:
        """A short video, decoded back: its frame count, size and frame rate must be what was asked."""
        def run() -> str:
            d = self.recipe.diffusion
            frames = min(d.default_num_frames, 5)  # 5 = 1 + 4: a length every video VAE here makes
            body = {"model": self.model, "prompt": self.recipe.smoke.prompt,
                    "size": f"{d.default_width}x{d.default_height}", "num_frames": frames,
                    "num_inference_steps": min(d.default_num_inference_steps, 4), "fps": 8, "seed": 1,
                    "response_format": response_format}
            status, resp = post_json(self.url + "/v1/videos", body, timeout=self.recipe.smoke.timeout_s)
            require(status == 200 and resp.get("status") == "completed", f"status {status}: {resp}")
            item = resp["data"][0]
            if response_format == "b64_json":
                data = base64.b64decode(item["b64_json"])
            else:
                import urllib.request

                with urllib.request.urlopen(item["url"], timeout=30) as got:
                    data = got.read()
            shape, fps = _decode_mp4(data)
            want = (frames, d.default_height, d.default_width, 3)
            require(shape == want and fps == 8, f"decoded {shape} at {fps} fps, asked for {want} at 8 fps")
            return f"{len(data)} bytes: {shape[0]} frames of {shape[2]}x{shape[1]} at {fps:g} fps"
        return run

    def steps(self) -> tuple[tuple[str, Callable[[], str]], ...]:
        if self.recipe.modality == "video_diffusion":
            return (("health", self.health), ("models", self.models), ("video_url", self.video("url")),
                    ("video_b64_json", self.video("b64_json")))
        return (("health", self.health), ("models", self.models), ("completion", self.completion),
                ("completion_stream", self.completion_stream), ("chat", self.chat), ("chat_stream", self.chat_stream))


def run_smoke(manifest_path: str) -> dict[str, Any]:
    manifest = Manifest.load(manifest_path)
    ep = RunLayout.of(manifest.run_dir).read_endpoint("frontend")
    url = ep.url or "" if ep is not None else ""
    checks: list[dict[str, Any]] = []

    def check(name: str, fn: Callable[[], str]) -> None:
        t0 = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # a failed check is data for the verdict, not a crash
            detail, ok = f"{type(exc).__name__}: {exc}", False
        checks.append({"name": name, "ok": ok, "detail": detail, "seconds": round(time.monotonic() - t0, 3)})

    before = _worker_requests(manifest)
    for name, fn in _Checks(manifest.recipe, url).steps():
        check(name, fn)
    after = _worker_requests(manifest)

    def every_role_served() -> str:
        moved = {role: after.get(role, 0) - before.get(role, 0) for role in after}
        idle = [role for role, delta in moved.items() if delta <= 0]
        require(not idle, f"roles that served nothing: {idle} (requests per role: {moved})")
        return f"requests per role: {moved}"

    check("every_role_served", every_role_served)
    verdict = {"passed": all(c["ok"] for c in checks), "checks": checks, "finished": time.time(), "url": url}
    write_json(RunLayout.of(manifest.run_dir).smoke, verdict)
    return verdict


def run_smoke_when_ready(manifest_path: str, wait_ready_s: float) -> dict[str, Any]:
    """Wait (up to wait_ready_s) until readiness reports ready, then run the checks; no checks when it gave up (the
    launch said why, and stopped waiting for this job)."""
    ready_file = RunLayout.of(Path(manifest_path).parent).ready
    record: dict[str, Any] = {}

    def decided() -> bool:
        record.update(read_json(ready_file) or {})
        return bool(record.get("ready") or record.get("gave_up"))

    try:
        wait_until(decided, wait_ready_s, "readiness")
    except TimeoutError:
        pass  # the checks themselves then say what is not there
    if record.get("gave_up") and not record.get("ready"):
        return {"passed": False, "checks": [], "not_ready": record["gave_up"]}
    return run_smoke(manifest_path)


def print_verdict(verdict: dict[str, Any], out: Callable[[str], None] = print) -> None:
    for c in verdict["checks"]:
        out(f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']:<18} {c['detail']}")
    out(f"smoke: {'PASSED' if verdict['passed'] else 'FAILED'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.checks.smoke")
    parser.add_argument("manifest")
    parser.add_argument("--force", action="store_true", help="run even when hpc launch runs them via submitit")
    args = parser.parse_args(argv)
    run = RunDir(Path(args.manifest).parent)
    via = run.run_info().smoke_via
    # hpc launch's choice holds for the job it submitted, not for one submitted again with plain sbatch
    if via in ("submitit", "none") and run.job().get("submitted_by") != "sbatch" and not args.force:
        print(f"hpc: in-job smoke stage skipped (smoke: {via}, set by hpc launch)", flush=True)
        return 0
    verdict = run_smoke(args.manifest)
    print_verdict(verdict, lambda s: print(s, flush=True))
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
