"""`POST /v1/videos` (seed 004, the OpenAI-style videos API Dynamo serves): a prompt in, an MP4 out — as a URL
(`GET /v1/videos/{id}/content`, the file in the output directory) or inline (`b64_json`); `GET /v1/videos/{id}`
shows a job's status and progress while it runs. A client that disconnects cancels its video."""

from __future__ import annotations

import asyncio
import base64
import secrets
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hpc.runtime.frontend.openai import ApiError, new_id, now
from hpc.runtime.serve.http import Request, Response, json_loads, json_response
from hpc.runtime.serve.wire import VideoProgress, VideoRequest, VideoResult
from hpc.spec.diffusion import check_sizes, model_facts

MAX_JOBS_KEPT = 1024  # finished jobs remembered for GET /v1/videos/{id}


class VideoCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str = Field(min_length=1, max_length=20_000)
    negative_prompt: str = Field(default="", max_length=20_000)
    model: str
    size: str | None = Field(default=None, pattern=r"^[0-9]{1,5}x[0-9]{1,5}$", description="WxH")
    seconds: float | None = Field(default=None, gt=0, le=3600)
    fps: int | None = Field(default=None, ge=1, le=240)
    num_frames: int | None = Field(default=None, ge=1, le=4096)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    response_format: Literal["url", "b64_json"] = "url"


class VideoService:
    def __init__(self, frontend) -> None:
        self.frontend = frontend
        recipe = frontend.recipe
        self.spec = recipe.diffusion
        self.facts = model_facts(recipe.model.generate)
        self.out_dir = Path(self.spec.output_dir or Path(frontend.manifest.run_dir) / "videos").expanduser()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.counters = {"videos_total": 0, "videos_failed_total": 0, "video_steps_total": 0,
                         "video_transformer_calls_total": 0, "video_skipped_calls_total": 0,
                         "video_seconds_total": 0.0}

    def _body(self, req: Request) -> VideoCreate:
        try:
            data = json_loads(req.body)
            body = VideoCreate.model_validate(data)
        except ValueError as exc:
            if isinstance(exc, ValidationError):
                err = exc.errors()[0]
                param = ".".join(str(p) for p in err["loc"])
                raise ApiError(400, f"{param}: {err['msg']}", param=param) from None
            raise ApiError(400, "request body is not valid JSON") from None
        if body.model != self.frontend.model_name:
            raise ApiError(404, f"model '{body.model}' does not exist; this server serves "
                                f"'{self.frontend.model_name}'", param="model", code="model_not_found")
        return body

    def _job(self, body: VideoCreate) -> VideoRequest:
        spec = self.spec
        width, height = (int(x) for x in body.size.split("x")) if body.size else (spec.default_width,
                                                                                  spec.default_height)
        fps = body.fps or spec.default_fps
        frames = body.num_frames or (round(body.seconds * fps) if body.seconds else spec.default_num_frames)
        if body.seconds and not body.num_frames and (frames - 1) % self.facts.temporal:
            frames += self.facts.temporal - (frames - 1) % self.facts.temporal  # the nearest length the VAE makes
        problem = check_sizes(self.facts, height, width, frames)
        if problem:
            raise ApiError(400, f"{problem} (this model: multiples of {self.facts.spatial}, at most "
                                f"{self.facts.max_frames} frames)", param="size" if "x" in problem else "num_frames")
        codec = self.frontend.codec
        video_id = new_id("video").replace("-", "_")
        return VideoRequest(video_id=video_id, prompt_ids=codec.encode(body.prompt)[:4096],
                            negative_ids=codec.encode(body.negative_prompt)[:4096] if body.negative_prompt else [],
                            height=height, width=width, frames=frames,
                            steps=body.num_inference_steps or spec.default_num_inference_steps,
                            guidance=spec.default_guidance_scale if body.guidance_scale is None
                            else body.guidance_scale,
                            seed=body.seed if body.seed is not None else secrets.randbits(63),  # unseeded: new noise
                            fps=fps, output_path=str(self.out_dir / f"{video_id}.mp4"), prompt=body.prompt,
                            negative_prompt=body.negative_prompt)

    async def create(self, req: Request) -> Response:
        body = self._body(req)
        call = self._job(body)
        record = {"id": call.video_id, "object": "video", "model": self.frontend.model_name, "status": "queued",
                  "progress": 0, "created": now(), "seconds": round(call.frames / call.fps, 3), "size":
                  f"{call.width}x{call.height}", "error": None}
        self._remember(call.video_id, record)
        deadline = asyncio.get_running_loop().time() + self.frontend.recipe.frontend.request_timeout_s
        result: VideoResult | None = None
        try:
            record["status"] = "in_progress"
            async for out in self.frontend.router.generate("agg", call, deadline):
                if isinstance(out, VideoProgress):
                    record["progress"] = int(100 * out.step / out.steps)
                elif isinstance(out, VideoResult):
                    result = out
        except asyncio.CancelledError:  # the client went away: the worker stops at its next step
            record.update(status="cancelled")
            raise
        except Exception as exc:
            self.counters["videos_failed_total"] += 1
            err = self.frontend._failed(call.video_id, exc)
            record.update(status="failed", error={"message": err.message, "code": err.code or err.status})
            raise err from None
        if result is None:
            raise ApiError(502, "the worker ended without a video", "upstream_error")
        self._count(result)
        record.update(status="completed", progress=100, path=result.path, inference_time_s=result.inference_time_s,
                      teacache_skipped_calls=result.skipped_calls, transformer_calls=result.transformer_calls)
        if body.response_format == "b64_json":
            data = base64.b64encode(await asyncio.to_thread(Path(result.path).read_bytes)).decode()
            item = {"b64_json": data}
        else:
            host = req.headers.get("host") or "localhost"
            item = {"url": f"http://{host}/v1/videos/{call.video_id}/content"}
        return json_response({**self._public(record), "data": [item]})

    def _count(self, result: VideoResult) -> None:
        self.counters["videos_total"] += 1
        self.counters["video_transformer_calls_total"] += result.transformer_calls
        self.counters["video_skipped_calls_total"] += result.skipped_calls
        self.counters["video_steps_total"] += result.transformer_calls + result.skipped_calls
        self.counters["video_seconds_total"] += result.inference_time_s

    def _remember(self, video_id: str, record: dict[str, Any]) -> None:
        self.jobs[video_id] = record
        while len(self.jobs) > MAX_JOBS_KEPT:
            self.jobs.pop(next(iter(self.jobs)))

    @staticmethod
    def _public(record: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in record.items() if k != "path"}

    async def list(self, req: Request) -> Response:
        """GET /v1/videos: the jobs this frontend knows, newest first (how a client finds a running one's id)."""
        return json_response({"object": "list", "data": [self._public(r) for r in reversed(self.jobs.values())]})

    def get(self, rest: str) -> Response:
        """GET /v1/videos/{id} and GET /v1/videos/{id}/content."""
        video_id, _, what = rest.partition("/")
        record = self.jobs.get(video_id)
        if record is None or what not in ("", "content"):
            return ApiError(404, f"no video {video_id[:100]!r}", code="not_found").response()
        if not what:
            return json_response(self._public(record))
        if record["status"] != "completed":
            return ApiError(409, f"video {video_id} is {record['status']}", code="not_ready").response()
        try:
            data = Path(record["path"]).read_bytes()
        except OSError:
            return ApiError(410, f"video {video_id} is no longer in the output directory", code="gone").response()
        return Response(body=data, content_type="video/mp4")
