"""Recipes: what to serve and how (recipes/*.yaml)."""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import Field, field_validator, model_validator

from hpc.spec.base import EnvMap, SingleLine, StrictModel
from hpc.spec.diffusion import DiffusionSpec


class Backend(str, Enum):
    TRTLLM = "trtllm"
    TORCH = "torch"
    MOCK = "mock"


class RoleName(str, Enum):
    """Also the disaggregation mode the role's workers run in."""

    AGG = "agg"
    AGGREGATED = "agg"  # alias: TensorRT-LLM's and Dynamo's name for the same mode
    PREFILL = "prefill"
    DECODE = "decode"
    ENCODE = "encode"


class RouterPolicy(str, Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    KV_AWARE = "kv_aware"  # prefill/agg: to the worker holding most of the prompt's prefix, weighed against load


class OnFailure(str, Enum):
    FAIL_JOB = "fail-job"
    CONTINUE = "continue"
    RESTART = "restart"


# generated models (ModelSpec.generate) whose weights only a GPU's memory holds: made there at load
GPU_ONLY_MODELS = {"llama-8b-shape": "16 GB of bf16 weights made on each worker's GPU"}


class ModelSpec(StrictModel):
    path: SingleLine = Field(min_length=1, description="weights directory (HF layout) or hub id")
    served_name: SingleLine = Field(min_length=1, max_length=256)
    tokenizer: str | None = Field(default=None, description="defaults to the model path")
    multimodal: bool = False
    generate: Literal["tiny", "tiny-multimodal", "tiny-moe", "tiny-video", "llama-8b-shape"] | None = Field(
        default=None, description="build this random-weight model at `path` before launch if it is missing")
    chat_template: str | None = Field(default=None, description="a Jinja file replacing the tokenizer's template")
    reasoning_parser: Literal["deepseek_r1", "qwen3", "gpt_oss"] | None = Field(
        default=None,
        description="split the model's reasoning into reasoning_content (the seeds' --dyn-reasoning-parser)")
    tool_call_parser: Literal["hermes", "qwen3", "llama3_json", "deepseek_v3", "harmony"] | None = Field(
        default=None,
        description="turn the model's tool-call markup into tool_calls (the seeds' --dyn-tool-call-parser)")
    canned_completion: str | None = Field(
        default=None, max_length=4096,
        description="test knob, torch backend: every answer is this text, produced through "
                    "the real sampler (for testing parsers on a random-weight model)")


class HttpSpec(StrictModel):
    """What the frontend's HTTP server accepts: beyond these a client gets 408/413/431/503, not a hung socket."""

    max_concurrent_requests: int = Field(default=4096, ge=1, le=1_000_000,
                                         description="beyond this, 503 with Retry-After")
    max_request_body_mb: float = Field(default=64.0, gt=0, le=1024, allow_inf_nan=False)
    header_timeout_s: float = Field(default=10.0, gt=0, le=3600, allow_inf_nan=False)
    body_timeout_s: float = Field(default=30.0, gt=0, le=3600, allow_inf_nan=False,
                                  description="longest silence while a request body arrives")
    keepalive_timeout_s: float = Field(default=15.0, gt=0, le=3600, allow_inf_nan=False)


def _int_or_auto(value: Any, low: int, high: int, what: str) -> Any:
    """An int field that also takes 'auto': one message for both forms (pydantic would report each branch of the
    union on a line of its own)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        return value
    raise ValueError(f"expected {what} from {low} to {high} or 'auto'")


class FrontendSpec(StrictModel):
    port: int = Field(default=8000, ge=1024, le=65535)
    router: RouterPolicy = RouterPolicy.ROUND_ROBIN
    # 2, not Dynamo's 1: on benchmarks/kv_routing.py's shared-prefix workload 1 sent a popular prefix to other
    # workers whenever its own was a little busy, and every copy cost cache room (1.6x fewer prompt tokens
    # computed than round robin and a worse TTFT p50; 2: 3.95x and 79 % of round robin's p50)
    kv_overlap_weight: float = Field(
        default=2.0, ge=0, le=100, allow_inf_nan=False,
        description="kv_aware: cost = weight x prompt blocks to compute + blocks queued for prefill on the worker")
    router_temperature: float = Field(
        default=0.0, ge=0, le=100, allow_inf_nan=False,
        description="kv_aware: 0 picks the cheapest worker; above 0 draws one with weight exp(-cost / temperature), "
                    "spreading near-ties (Dynamo's --router-temperature)")
    global_router: str | dict[str, Any] | None = Field(
        default=None,
        description="seed 003's global router over the roles' pools: Dynamo's global_router JSON, as a file "
                    "(relative to the recipe or the project) or inline; its pool names are the recipe's")
    request_timeout_s: float = Field(default=600.0, gt=0, le=86400, allow_inf_nan=False)
    max_restarts: int = Field(default=3, ge=0, le=1000,
        description="times the frontend is started again if it dies (the "
                    "workers stay and resend their cached blocks to its "
                    "KV-aware index; the job goes on)")
    processes: Annotated[int, Field(ge=1, le=64)] | Literal["auto"] = Field(
        default="auto",
        description="frontend processes on one port (process 0 deals each connection to the one holding "
                    "the fewest); one Python process saturates its core at tens of thousands of tokens/s. "
                    "auto: one per 8 cores the frontend may use, 1 to 4")
    http: HttpSpec = Field(default_factory=HttpSpec)

    @field_validator("processes", mode="before")
    @classmethod
    def _count_or_auto(cls, value: Any) -> Any:
        return _int_or_auto(value, 1, 64, "a count")


class InfraSpec(StrictModel):
    etcd: bool = True
    nats: bool = True
    placement: Literal["shared", "dedicated"] = Field(
        default="shared", description="dedicated: etcd, NATS and the frontend get a node of their own")
    max_restarts: int = Field(default=3, ge=0, le=1000, description="times etcd/NATS are started again if they die")


class FailurePolicy(StrictModel):
    on_failure: OnFailure = OnFailure.FAIL_JOB
    max_restarts: int = Field(default=3, ge=0, le=1000)


class RoleSpec(StrictModel):
    count: int = Field(default=1, ge=1, le=4096, description="number of independent workers (engines) of this role")
    tensor_parallel_size: int = Field(default=1, ge=1, le=1024)
    pipeline_parallel_size: int = Field(default=1, ge=1, le=128)
    expert_parallel_size: int = Field(default=1, ge=1, le=1024)
    enable_attention_dp: bool = False
    engine_config: str | None = Field(default=None, description="TensorRT-LLM LLM-API YAML (--extra-engine-args)")
    override_engine_args: dict[str, Any] | None = Field(
        default=None, description="a mapping, or a JSON object string (--override-engine-args)")
    env: EnvMap = Field(default_factory=dict)
    failure: FailurePolicy = Field(default_factory=FailurePolicy)
    pools: list["PoolSpec"] | None = Field(
        default=None, min_length=1,
        description="named groups of this role's workers, each with its own size and engine "
                    "config, chosen per request by frontend.global_router; a field a pool "
                    "leaves out comes from the role")

    @field_validator("override_engine_args", mode="before")
    @classmethod
    def _parse_json(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"malformed JSON ({exc.msg} at column {exc.colno}); "
                                 "pass a JSON object such as '{\"max_batch_size\": 64}'") from None
            if not isinstance(value, dict):
                raise ValueError("override_engine_args must be a JSON object")
        return value

    @model_validator(mode="after")
    def _pooled(self) -> "RoleSpec":
        if not self.pools:
            return self
        if self.count != 1:
            raise ValueError("with pools, each pool gives its own count; remove the role's count")
        # A pool inherits what it leaves out from its role, resolved here once: the manifest then carries every
        # pool whole, and reading it back changes nothing.
        role = {f: getattr(self, f) for f in type(self).model_fields if f not in ("pools", "count")}
        resolved = [p.model_copy(update={f: v for f, v in role.items() if f not in p.model_fields_set})
                    for p in self.pools]
        for pool in resolved:
            object.__setattr__(pool, "__pydantic_fields_set__", set(type(pool).model_fields))
        object.__setattr__(self, "pools", resolved)
        return self

    @property
    def gpus_per_worker(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def total_count(self) -> int:
        """Workers of this role, over its pools when it has them."""
        return sum(p.count for p in self.pools) if self.pools else self.count

    def pool_specs(self) -> list[tuple[str | None, "RoleSpec"]]:
        """(pool name, its spec) — one (None, self) without pools."""
        if not self.pools:
            return [(None, self)]
        return [(p.name, RoleSpec.model_validate(p.model_dump(exclude={"name"}))) for p in self.pools]


POOL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class PoolSpec(RoleSpec):
    name: str = Field(pattern=POOL_PATTERN, max_length=64, description="the global router's name for this pool")

    @model_validator(mode="after")
    def _flat(self) -> "PoolSpec":
        if self.pools:
            raise ValueError("a pool has no pools of its own")
        return self


class WorkerGroup(NamedTuple):
    role: "RoleName"
    pool: str | None
    spec: RoleSpec

    @property
    def key(self) -> str:
        """Where this group's engine args are kept in the manifest: the pool's name, or the role's."""
        return self.pool or self.role.value


class Roles(StrictModel):
    agg: RoleSpec | None = None
    prefill: RoleSpec | None = None
    encode: RoleSpec | None = None
    decode: RoleSpec | None = None

    def items(self) -> list[tuple[RoleName, RoleSpec]]:
        """Present roles in start order: encode before prefill before decode."""
        order = (RoleName.AGG, RoleName.ENCODE, RoleName.PREFILL, RoleName.DECODE)
        return [(name, getattr(self, name.value)) for name in order if getattr(self, name.value)]

    def groups(self) -> list[WorkerGroup]:
        """Each role's workers by pool (one group per role without pools), in start order."""
        return [WorkerGroup(name, pool, spec) for name, role in self.items() for pool, spec in role.pool_specs()]

    def spec(self, group: str) -> RoleSpec:
        """The effective spec of a worker group: a role's name, or one of its pools' (WorkerPlan.group)."""
        for g in self.groups():
            if g.key == group:
                return g.spec
        raise KeyError(group)

    def required(self, role: "RoleName | str") -> RoleSpec:
        """A role the caller's mode has (validation made sure of it): a KeyError names it where not."""
        spec = getattr(self, RoleName(role).value)
        if spec is None:
            raise KeyError(f"the recipe has no {RoleName(role).value} role")
        return spec

    def pools(self, role: "RoleName | str") -> list[str]:
        spec = getattr(self, RoleName(role).value)
        return [p.name for p in spec.pools or []] if spec is not None else []


class MockSpec(StrictModel):
    prefill_delay_ms: float = Field(default=0.0, ge=0, le=600_000, allow_inf_nan=False)
    per_token_delay_ms: float = Field(default=0.0, ge=0, le=600_000, allow_inf_nan=False)


class TorchEngineSpec(StrictModel):
    """The torch reference engine's own switches, beside its LLM-API engine args (TensorRT-LLM has none of these):
    the defaults are what the measurements in docs/performance-log.md chose; the others are for comparisons."""

    decode_steps_per_graph: int = Field(
        default=8, ge=1, le=64,
        description="decode steps one CUDA-graph replay runs at most where its rows allow (eight: "
                    "295-306k tok/s against 245-268k at four, two H200); 1: a step a replay")
    decode_graph_copies: bool = Field(
        default=True,
        description="the decode graphs capture their own input and output copies (a c=64 step's host time "
                    "456 -> 384 us on an H200); false: the host launches them")
    mixed_steps: bool = Field(
        default=True,
        description="a prompt's tokens and the decoding rows in one forward pass (TensorRT-LLM's in-flight "
                    "batching); false: the prompt's pass, then the decode step")
    gil_switch_interval_s: float | None = Field(
        default=None, gt=0, le=1.0, allow_inf_nan=False,
        description="Python's switch interval in the engine's process: how long a thread that wants the GIL waits "
                    "before it asks the holder to drop it (unset: Python's 5 ms)")


class Limits(StrictModel):
    max_input_tokens: int = Field(default=4096, ge=1, le=10_000_000, description="longest prompt the frontend accepts")
    max_output_tokens: int = Field(default=1024, ge=1, le=10_000_000)


class SmokeSpec(StrictModel):
    enabled: bool = True
    prompt: str = "The capital of France is"
    max_tokens: int = Field(default=16, ge=1, le=100_000)
    image: str | None = Field(default=None, description="image for multimodal smoke requests")
    timeout_s: float = Field(default=120.0, gt=0, le=86400, allow_inf_nan=False)


class BenchShape(StrictModel):
    input_tokens: int = Field(default=128, ge=1, le=10_000_000)
    output_tokens: int = Field(default=64, ge=1, le=10_000_000)


class BenchmarkSpec(StrictModel):
    concurrency: list[Annotated[int, Field(ge=1, le=100_000)]] = Field(default_factory=lambda: [1, 4, 16],
                                                                         min_length=1)
    shapes: list[BenchShape] = Field(default_factory=lambda: [BenchShape()])
    requests_per_level: int = Field(default=64, ge=1, le=1_000_000)
    warmup_requests: int = Field(default=4, ge=0, le=100_000)
    streaming: bool = True


class RuntimeSpec(StrictModel):
    publish_kv_events: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="every component's, and TensorRT-LLM's (TLLM_LOG_LEVEL)")
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one object a line (ts, level, run, component, logger, message, request_id), "
                                    "for a log stack")
    readiness_timeout_s: float = Field(default=1800.0, gt=0, le=7 * 86400, allow_inf_nan=False)
    allowed_local_media_path: str | None = None
    media_allowed_hosts: list[SingleLine] = Field(
        default_factory=list, description="image URLs may reach these hosts or CIDRs even when they are loopback, "
                                          "link-local or private (by default only public addresses)")
    max_file_size_mb: float = Field(default=16.0, gt=0, le=4096, allow_inf_nan=False)
    kv_transport: Literal["auto", "bytes", "nixl"] = Field(
        default="auto",
        description="how the torch engine's KV moves prefill -> decode. auto: CUDA IPC on one node's GPUs, "
                    "NIXL between GPUs of different nodes when installed, else bytes over the RPC "
                    "connection; nixl: always NIXL (host or GPU memory, any two nodes); bytes: always bytes")
    kv_transfer_min_s: float = Field(
        default=10.0, gt=0, le=3600, allow_inf_nan=False,
        description="a KV transfer prefill -> decode may take this long plus its size at kv_transfer_floor_gb_s; "
                    "past it the request fails with a 504 naming the prefill worker (counted per worker)")
    kv_transfer_floor_gb_s: float = Field(default=0.5, gt=0, le=10_000, allow_inf_nan=False)
    kv_transfer_retries: int = Field(
        default=1, ge=0, le=8,
        description="a request whose KV transfer passed its deadline is prefilled again and decoded "
                    "on another prefill -> decode pair, this many times, before it fails (504)")
    kv_pair_bench_after: int = Field(
        default=2, ge=1, le=1000,
        description="timed-out transfers in a row after which a prefill -> decode pair leaves "
                    "routing (that decode is not picked for that prefill's KV)")
    kv_pair_cooldown_s: float = Field(
        default=30.0, gt=0, le=3600, allow_inf_nan=False,
        description="how long such a pair sits out before one request tries it again (doubled each time it fails "
                    "again, up to 600 s; a success puts it back)")
    engine_process: Literal["auto", "own", "worker"] = Field(
        default="auto",
        description="where the torch engine of an aggregated, prefill or decode worker of one rank runs "
                    "(text only). own: a process of its own beside the worker's RPC and HTTP servers, so the "
                    "scheduler and the output path do not share one GIL; worker: in the worker's process; "
                    "auto: own on a GPU")
    idle_spin_us: Annotated[int, Field(ge=0, le=100_000)] | Literal["auto"] = Field(
        default="auto",
        description="each frontend process and each worker keeps polling its sockets without sleeping "
                    "while a call is in flight (a worker whose engine shares its process: after a call's "
                    "start) and this long after the last one ends, and an engine process's scheduler this "
                    "long after its last work, so that the next message finds its "
                    "CPU awake (a CPU idle for a millisecond takes 40-50 us more to wake, up to 0.5 ms, on "
                    "the GPU machines' VMs: benchmarks/hop_latency.py --gap-us); 0: off. auto: 2000 (10000 "
                    "for a prefill worker whose engine has a process of its own, and that process: its next "
                    "call comes a whole decode after its last) where the "
                    "process may use 8 CPUs or more, else 0 (on a small machine the spin takes the CPU from "
                    "the work)")

    @field_validator("idle_spin_us", mode="before")
    @classmethod
    def _microseconds_or_auto(cls, value: Any) -> Any:
        return _int_or_auto(value, 0, 100_000, "microseconds")


NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"  # it names the Slurm job and the run directory


class Recipe(StrictModel):
    name: str = Field(pattern=NAME_PATTERN, max_length=64)
    description: str = ""
    model: ModelSpec
    modality: Literal["text", "multimodal", "video_diffusion"] = Field(
        default="text", description="what the workers serve (seed 004's --modality); video_diffusion needs `diffusion`")
    diffusion: DiffusionSpec | None = None
    backend: Backend
    time_limit: str | None = Field(default=None, description="overrides the cluster's default time limit")
    drain_before_end_s: int = Field(
        default=120, ge=0, le=3600,
        description="seconds before the time limit at which Slurm asks the workers to drain (SIGUSR1, as hpc "
                    "cancel's first tier): they leave routing, so new requests get a clear 503 instead of a stream "
                    "cut at the end, and finish what they are serving. Slurm may send it up to 60 s earlier. "
                    "0: no warning, the job ends at its limit")
    frontend: FrontendSpec = Field(default_factory=FrontendSpec)
    infra: InfraSpec = Field(default_factory=InfraSpec)
    roles: Roles
    placement: Literal["pack", "spread", "hetjob"] = Field(
        default="pack",
        description="pack: workers of different roles share a node when its GPUs allow (each GPU "
                    "held by one worker); spread: each role starts on a node of its own; hetjob: as "
                    "spread, as a heterogeneous Slurm job, one component per role (#SBATCH hetjob, srun "
                    "--het-group), so Slurm may place each role's nodes apart")
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    limits: Limits = Field(default_factory=Limits)
    mock: MockSpec = Field(default_factory=MockSpec)
    torch_engine: TorchEngineSpec = Field(default_factory=TorchEngineSpec)
    smoke: SmokeSpec = Field(default_factory=SmokeSpec)
    benchmark: BenchmarkSpec = Field(default_factory=BenchmarkSpec)

    @model_validator(mode="after")
    def _role_shape(self) -> "Recipe":
        roles = self.roles
        if roles.agg is not None and (roles.prefill or roles.decode):
            raise ValueError("roles: 'agg' cannot be mixed with 'prefill'/'decode'; pick one serving mode")
        if (roles.prefill is None) != (roles.decode is None):
            raise ValueError("roles: disaggregated serving needs both 'prefill' and 'decode'")
        if roles.agg is None and roles.decode is None:
            raise ValueError("roles: define 'agg' (aggregated) or 'prefill' + 'decode' (disaggregated)")
        if self.modality == "video_diffusion":
            if self.diffusion is None:
                raise ValueError("modality video_diffusion needs a diffusion section (its flags; {} for defaults)")
            if roles.agg is None or roles.encode is not None:
                raise ValueError("roles: a video_diffusion recipe serves with 'agg' workers only (one diffusion "
                                 "pipeline per worker)")
        elif self.diffusion is not None:
            raise ValueError(f"diffusion: only for modality video_diffusion (this recipe is {self.modality})")
        if self.modality == "multimodal" and not self.model.multimodal:
            raise ValueError("modality multimodal needs model.multimodal: true")
        seen: set[str] = {r.value for r in RoleName}
        for name, spec in roles.items():
            for pool in spec.pools or []:
                if pool.name in seen:
                    raise ValueError(f"roles.{name.value}.pools: the name {pool.name!r} is taken (by a role or "
                                     "another pool); pool names are unique in a recipe")
                seen.add(pool.name)
        return self

    @property
    def disaggregated(self) -> bool:
        return self.roles.prefill is not None
