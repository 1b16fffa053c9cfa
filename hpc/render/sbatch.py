"""Render one sbatch script per job from templates/job.sbatch.j2 (pure: manifest in, text out)."""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

import jinja2

from hpc.errors import UserError
from hpc.rundir import SERVING_PHASES, ChainDir, RunLayout, bundle_dir
from hpc.plan.placement import WorkerPlan, het_components
from hpc.manifest import Manifest
from hpc.spec.catalog import project_root
from hpc.spec.cluster import GpuRequest, SecretRef, time_to_minutes


def shell_quote(value: object) -> str:
    """Every value in a template goes through this: the script treats it as inert data."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    text = str(value)
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        # ANSI-C quoting keeps the word on one line, so no line of the script can start inside a value.
        escaped = "".join(
            "\\\\" if ch == "\\" else "\\'" if ch == "'" else
            (f"\\x{ord(ch):02x}" if ord(ch) < 32 or ord(ch) == 127 else ch) for ch in text)
        return f"$'{escaped}'"
    return shlex.quote(text)


def comment_text(value: object) -> str:
    """Text inside a `#` comment: one line, so nothing after it can become a command."""
    return " ".join(str(value).split())


def template_env(root: Path | None = None) -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str((root or project_root()) / "templates")),
        undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True,
        trim_blocks=True, lstrip_blocks=True)
    env.filters["q"] = shell_quote
    env.filters["comment"] = comment_text
    return env


@dataclass(frozen=True)
class Step:
    """One srun step: its flags (already split into words) and its command words."""

    name: str
    comment: str
    srun_flags: list[str]
    nodelist: str  # bash expression over the NODES array, e.g. ${NODES[1]},${NODES[2]}
    command: list[str]
    # A multi-rank worker's failure policy is applied to the whole step (all ranks at once): a single rank
    # cannot rejoin its TP group, so the step is restarted as a unit by the script.
    unit_restarts: int = 0
    unit_continue: bool = False
    log: str = ""  # its --output: a restarted unit's attempts append to it, so the failed one's lines stay
    nodes: tuple[int, ...] = ()  # the plan's node indices it runs on


@dataclass(frozen=True)
class Secret:
    """A cluster env value read when the job starts (its name is a validated shell name)."""

    name: str
    from_env: str | None
    from_file: str | None


@dataclass(frozen=True)
class ChainView:
    """A chain link's part of the script (hpc launch --chain; rundir.ChainDir has the files it writes)."""

    index: int
    links: int
    handover_s: int
    serving: str  # CHAIN/serving.json: this link serves once its checks passed
    cancelled: str  # CHAIN/cancelled: hpc cancel ended the chain, queue nothing more
    next_script: str | None  # the next link's job.sbatch (None: the last link)
    next_queued: str | None  # where the job queued for it is recorded
    worker_states: list[str]  # this link's workers' state files, read to see them drained
    serving_pattern: str  # a worker state's phase while it may hold requests (grep -E)
    next_serves: str  # serving.json once the next link serves (grep)
    drain_s: int  # the longest its workers are given to finish what they hold after the handover


@dataclass(frozen=True)
class View:
    """The small view-model the template sees."""

    title: str
    sbatch_flags: list[str]
    env: dict[str, str]
    secrets: list[Secret]
    python_env: str | None
    slurm_conf: str | None
    run_dir: str
    manifest: str
    python: str
    services: list[Step] = field(default_factory=list)
    workers: list[Step] = field(default_factory=list)
    ready_command: list[str] = field(default_factory=list)
    smoke_command: list[str] | None = None
    # the preflight's command (its first task records the job id in the run directory, moves an earlier job's
    # states aside)
    start_command: list[str] = field(default_factory=list)
    # on every node (in its container, where there is one), a step per component of a heterogeneous job; the
    # first node records the job
    preflight: list[Step] = field(default_factory=list)
    het_components: int = 0  # placement: hetjob
    exclude_bad_nodes: bool = False  # preflight.on_bad_node: exclude
    in_container: bool = False
    preflight_log: str = ""
    generated_model: str | None = None  # created before the containers mount it
    ready_step: Step | None = None
    smoke_step: Step | None = None
    # flags every step shares (the container's, the profile's srun_args): written once, as the SRUN_COMMON array
    common_flags: list[str] = field(default_factory=list)
    chain: ChainView | None = None


def _sbatch_flags(m: Manifest, logs: str, components: list[list[int]] | None) -> list[str]:
    """The #SBATCH lines; a heterogeneous job's as components separated by `hetjob`, the job's name, log and
    signal on the first (Slurm propagates them), nodes, tasks, GPUs and the partition's flags on each."""
    c, plan = m.cluster, m.plan
    job = [f"--job-name={m.job_name}"]
    logged = [f"--output={logs}/job.out", f"--error={logs}/job.out"]
    if m.recipe.drain_before_end_s:  # every step gets it (not the batch shell): the workers drain, the rest ignore it
        logged.append(f"--signal=USR1@{m.recipe.drain_before_end_s}")
    uses_gpus = bool(plan.gpus_per_node and any(w.tasks for w in plan.workers) and m.recipe.backend.value != "mock")
    rest = [f"--{key}={getattr(c, key)}" for key in ("partition", "account", "qos") if getattr(c, key)]
    rest += [f"--mem={c.memory}"] if c.memory else []
    rest += ["--exclusive"] if c.exclusive else []
    rest += list(c.sbatch_args)
    time = f"--time={time_to_minutes(m.time_limit)}"
    if components is None:
        gpus = _gpu_flag(c.gpu_request, plan.gpus_per_node) if uses_gpus else []
        return [*job, f"--nodes={plan.job_nodes}", f"--ntasks-per-node={plan.tasks_per_node}", time, *logged,
                *gpus, *rest]
    flags = [*job, *logged]
    for i, nodes in enumerate(components):
        holds_workers = any(n in w.nodes for w in plan.workers for n in nodes)
        gpus = _gpu_flag(c.gpu_request, plan.gpus_per_node) if uses_gpus and holds_workers else []
        flags += (["hetjob"] if i else []) + [f"--nodes={len(nodes)}", f"--ntasks-per-node={plan.tasks_per_node}",
                                               time, *gpus, *rest]
    return flags


def _in_component(step: Step, components: list[list[int]]) -> Step:
    """A heterogeneous job's step runs in the component that holds its nodes (srun --het-group)."""
    group = next(i for i, nodes in enumerate(components) if step.nodes[0] in nodes)
    return replace(step, srun_flags=[f"--het-group={group}", *step.srun_flags])


def _nodelist(nodes: list[int]) -> str:
    return ",".join(f"${{NODES[{n}]}}" for n in nodes)


def _gpu_flag(style: GpuRequest, count: int) -> list[str]:
    if style is GpuRequest.GPUS_PER_NODE:
        return [f"--gpus-per-node={count}"]
    if style is GpuRequest.GRES:
        return [f"--gres=gpu:{count}"]
    return []


def service_argv(m: Manifest, name: str, python: str) -> list[str]:
    """The command of a service step (etcd, nats, frontend): the same under Slurm and on the local profile."""
    manifest = f"{m.run_dir}/manifest.json"
    if name == "frontend":
        return [python, "-m", "hpc.runtime.frontend", manifest]
    return [python, "-m", "hpc.runtime.services.infra", manifest, "--service", name]


TRTLLM_LAUNCHER = "trtllm-llmapi-launch"


def mpi_launcher(m: Manifest, w: WorkerPlan) -> str | None:
    """The launcher a worker's ranks start under, if any. TensorRT-LLM under Slurm: its trtllm-llmapi-launch
    (upstream tensorrt_llm/llmapi/trtllm-llmapi-launch) runs our worker on rank 0 and keeps the other ranks in
    TensorRT-LLM's own MPI worker loop. On the local profile there is no MPI launcher: one process runs the worker
    and the LLM spawns its ranks itself (MpiPoolSession, tensorrt_llm/executor/proxy.py)."""
    if m.recipe.backend.value == "trtllm" and w.tasks > 1 and not m.cluster.is_local:
        return TRTLLM_LAUNCHER
    return None


def worker_argv(m: Manifest, w: WorkerPlan, python: str) -> list[str]:
    argv = [python, "-m", "hpc.runtime.worker", f"{m.run_dir}/manifest.json", "--role", w.role.value,
            "--index", str(w.index)]
    launcher = mpi_launcher(m, w)
    if launcher:
        # The worker starts the launcher itself, with SIGUSR1 (the drain signal Slurm sends every process of the
        # step) ignored in everything the launcher starts: only our worker drains; the launcher's shell and
        # TensorRT-LLM's rank processes would otherwise die of it.
        argv += ["--mpi-launcher", launcher]
    return argv


def build_view(m: Manifest) -> View:
    c, plan = m.cluster, m.plan
    run_dir = m.run_dir
    if any(ord(ch) < 32 for ch in run_dir):
        raise UserError(f"the run directory {run_dir!r} contains a newline or control character, which "
                        "#SBATCH lines cannot carry", field="HPC_RUNS_DIR", hint="use another runs directory")
    split = [w.name for w in plan.workers if mpi_launcher(m, w)]
    if split and any(ch.isspace() or ch in "*?[" for ch in run_dir):
        # trtllm-llmapi-launch runs its command as an unquoted $task_with_command: the shell splits it at spaces
        # and expands wildcards, so the worker would get a broken manifest path.
        raise UserError(f"the run directory {run_dir!r} has a space or wildcard, which {TRTLLM_LAUNCHER} (the "
                        f"TensorRT-LLM launcher of {split[0]}'s ranks) splits apart", field="HPC_RUNS_DIR",
                        hint="use a runs directory (runs_dir or HPC_RUNS_DIR) without spaces or * ? [")
    logs = f"{run_dir}/logs"
    manifest = f"{run_dir}/manifest.json"
    components = het_components(plan) if m.recipe.placement == "hetjob" and not c.is_local else None
    flags = _sbatch_flags(m, logs, components)

    container = container_flags(m)
    env = {k: v for k, v in c.env.items() if isinstance(v, str)}
    secrets = [Secret(name=k, from_env=v.from_env, from_file=v.from_file) for k, v in sorted(c.env.items())
               if isinstance(v, SecretRef)]
    if c.container:
        env["PYTHONPATH"] = str(bundle_dir(Path(run_dir).parent, c.container.python_version))
    py = [c.python, "-m"]
    services = []
    for s in plan.services:
        services.append(Step(
            name=s.name, comment=f"{s.name} on node {s.node}, ports {s.ports}"
                                 + (f", {s.processes} processes" if s.processes > 1 else ""),
            srun_flags=["--overlap", f"--job-name={s.name}", "--nodes=1", "--ntasks=1",
                        *([f"--cpus-per-task={s.processes}"] if s.processes > 1 else []),
                        f"--output={logs}/{s.name}.log"],
            nodelist=_nodelist([s.node]), nodes=(s.node,), command=service_argv(m, s.name, c.python)))
    workers = [_worker_step(m, w, logs) for w in plan.workers]
    smoke = [*py, "hpc.checks.smoke", manifest] if m.recipe.smoke.enabled else None
    ready = [*py, "hpc.checks.ready", manifest]
    start = [*py, "hpc.checks.preflight", manifest]
    title = f"recipe {m.recipe.name} on cluster {c.name}, {plan.job_nodes} node(s), {plan.total_gpus} GPU(s)"
    view = View(title=title, sbatch_flags=flags, env=env, secrets=secrets, python_env=c.python_env,
                slurm_conf=c.slurm_conf,
                run_dir=run_dir, manifest=manifest, python=c.python, services=services, workers=workers,
                ready_command=ready, smoke_command=smoke, start_command=start, preflight_log=f"{logs}/preflight.log",
                common_flags=[*container, *c.srun_args])
    def check_step(name: str, command: list[str], nodes: list[int], append: bool = False) -> Step:
        return Step(name=name, comment=name, nodelist=_nodelist(nodes), nodes=tuple(nodes), command=command,
                    srun_flags=["--overlap", f"--job-name={name}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}",
                                "--ntasks-per-node=1", f"--output={logs}/{name}.log",
                                *(["--open-mode=append"] if append else [])])
    # every node checks itself (software, GPUs, the model's read, the nodes reaching each other), with or
    # without a container; a heterogeneous job's components side by side, a step each
    preflight = [check_step("preflight", start, nodes, append=True) for nodes in components] if components else \
        [check_step("preflight", start, list(range(plan.job_nodes)))]
    view = replace(view, preflight=preflight, het_components=len(components or []),
                   exclude_bad_nodes=c.preflight.hardware and c.preflight.on_bad_node == "exclude",
                   chain=_chain_view(m))
    if c.container:
        generated = str(Path(m.recipe.model.path).expanduser()) if m.recipe.model.generate else None
        view = replace(view, in_container=True, generated_model=generated, ready_step=check_step("ready", ready, [0]),
                       smoke_step=check_step("smoke", smoke, [0]) if smoke else None)
    if not components:
        return view
    return replace(view, services=[_in_component(s, components) for s in view.services],
                   workers=[_in_component(w, components) for w in view.workers],
                   preflight=[_in_component(s, components) for s in view.preflight],
                   ready_step=view.ready_step and _in_component(view.ready_step, components),
                   smoke_step=view.smoke_step and _in_component(view.smoke_step, components))


HANDOVER_DRAIN_MIN_S = 30


def _chain_view(m: Manifest) -> ChainView | None:
    link = m.chain
    if link is None:
        return None
    chain = ChainDir(Path(link.root))
    following = chain.link(link.index + 1).path if link.index < link.links else None
    return ChainView(index=link.index, links=link.links, handover_s=link.handover_s,
                     serving=str(chain.serving_path), cancelled=str(chain.cancelled_path),
                     next_script=following and str(following / "job.sbatch"),
                     next_queued=following and str(following / "queued.json"),
                     worker_states=[str(RunLayout.of(m.run_dir).component_state(w.name)) for w in m.plan.workers],
                     serving_pattern=f'"phase": "({"|".join(SERVING_PHASES)})"',
                     next_serves=f'"link": {link.index + 1},',
                     drain_s=max(m.recipe.drain_before_end_s, HANDOVER_DRAIN_MIN_S))


def container_flags(m: Manifest) -> list[str]:
    """pyxis flags of every containerized step: the profile's mounts plus the run directory (same path inside),
    hpc's runtime bundle (read-only) and a model hpc generated; PYTHONPATH from the job wins over the image's."""
    c = m.cluster.container
    if c is None:
        return []
    if any(ch in m.run_dir for ch in ",:"):
        raise UserError(f"the run directory {m.run_dir!r} contains ',' or ':', which pyxis mounts cannot carry",
                        field="HPC_RUNS_DIR", hint="use a runs directory without ',' and ':'")
    bundle = bundle_dir(Path(m.run_dir).parent, c.python_version)
    mounts = list(c.mounts) + [f"{m.run_dir}:{m.run_dir}", f"{bundle}:{bundle}:ro"]
    if m.recipe.model.generate:
        model = str(Path(m.recipe.model.path).expanduser())
        mounts.append(f"{model}:{model}")  # writable: the job's first process builds it there
    flags = [f"--container-image={c.image}", f"--container-mounts={','.join(mounts)}", "--container-env=PYTHONPATH"]
    if c.reuse:
        # The name follows the image, so another image never runs in a container unpacked from this one.
        flags.append(f"--container-name=hpc-{hashlib.sha256(c.image.encode()).hexdigest()[:12]}")
    if c.workdir:
        flags.append(f"--container-workdir={c.workdir}")
    if c.writable:
        flags.append("--container-writable")
    return flags


def _worker_step(m: Manifest, w: WorkerPlan, logs: str) -> Step:
    c = m.cluster
    flags = [f"--job-name={w.name}", f"--nodes={len(w.nodes)}", f"--ntasks={w.tasks}", f"--ntasks-per-node={w.tasks_per_node}",
             f"--output={logs}/{w.name}.log", "--label"]
    if w.tasks > 1:
        flags += [f"--mpi={c.mpi}", "--kill-on-bad-exit=1"]  # one rank down ends its siblings, not a hang
    if m.recipe.backend.value != "mock" and c.gpus_per_node:
        # --exact: only the CPUs and GPUs this step asks for, so workers packed on a node run side by side
        # on distinct GPUs (without it a step takes the whole node and the next one waits).
        flags += ["--exact", *_gpu_flag(c.gpu_request, w.gpus_per_node)]
    else:
        flags.append("--overlap")
    ranks = ", ".join(f"r{r.rank}:n{r.node}/gpu{r.gpu}" for r in w.ranks[:8]) + (" ..." if w.tasks > 8 else "")
    policy = m.recipe.roles.spec(w.group).failure
    as_unit = w.tasks > 1
    restarts = policy.max_restarts if as_unit and policy.on_failure.value == "restart" else 0
    launcher = mpi_launcher(m, w)
    if restarts:  # srun truncates its --output by default: a restart would erase why the last attempt failed
        flags.append("--open-mode=append")
    return Step(
        name=w.name, comment=f"{w.name}: TPxPP={w.tasks} on nodes {w.nodes} ({ranks})" + (
            f"; the worker starts {launcher}, which runs it on rank 0 and TensorRT-LLM's own loop on the others"
            if launcher else ""),
        srun_flags=flags, nodelist=_nodelist(w.nodes), nodes=tuple(w.nodes),
        command=worker_argv(m, w, c.python),
        unit_restarts=restarts, unit_continue=as_unit and policy.on_failure.value == "continue",
        log=f"{logs}/{w.name}.log")


def render_sbatch(m: Manifest, root: Path | None = None) -> str:
    return template_env(root).get_template("job.sbatch.j2").render(v=build_view(m))
