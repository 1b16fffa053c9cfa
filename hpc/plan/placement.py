"""Placement: a pure function of (cluster, recipe) -> Plan."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from hpc.errors import UserError
from hpc.plan.topology import rank_coords
from hpc.spec.cluster import ClusterProfile
from hpc.spec.recipe import Recipe, RoleName

# Port layout within a job, from the cluster's port_base.
ETCD_CLIENT, ETCD_PEER, NATS_CLIENT, NATS_MONITOR = 0, 1, 2, 3
WORKER_PORTS_START, PORTS_PER_WORKER = 10, 3  # rpc, http (health/metrics), dist (torch.distributed)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServicePlan(_Frozen):
    name: Literal["etcd", "nats", "frontend"]
    node: int
    ports: dict[str, int]
    processes: int = 1  # the frontend's, on one port (its Slurm step gets a CPU for each)


class RankPlan(_Frozen):
    rank: int
    node: int
    local_rank: int
    gpu: int
    pp: int
    tp: int
    ep: int
    dp: int


class WorkerPlan(_Frozen):
    role: RoleName
    index: int  # within the role, counted on across its pools
    pool: str | None = None  # the role's pool this worker belongs to (frontend.global_router)
    nodes: list[int]
    tasks: int  # MPI world size = TP x PP
    tasks_per_node: int
    gpus_per_node: int  # GPUs this worker uses on each of its nodes
    gpu_offset: int  # first GPU index on a node shared with other workers of the role
    ports: dict[str, int]
    ranks: list[RankPlan]

    @property
    def name(self) -> str:
        return f"{self.role.value}-{self.index}"

    @property
    def group(self) -> str:
        """Its pool's name, or its role's: the key of its engine args and spec (Recipe.spec_of)."""
        return self.pool or self.role.value

    def gpu_text(self) -> str:
        """The GPUs this worker holds, per node: 'n0:0-3' or 'n1:2; n2:0'."""
        per_node: dict[int, list[int]] = {}
        for r in self.ranks:
            per_node.setdefault(r.node, []).append(r.gpu)
        return "; ".join(f"n{n}:{g[0]}-{g[-1]}" if len(g) > 1 else f"n{n}:{g[0]}" for n, g in per_node.items())


class Plan(_Frozen):
    job_nodes: int
    gpus_per_node: int  # what the job asks for per node
    services: list[ServicePlan]
    workers: list[WorkerPlan]
    readiness_order: list[str]

    @property
    def total_gpus(self) -> int:
        return sum(w.tasks for w in self.workers)

    @property
    def tasks_per_node(self) -> int:
        """The job's task slots per node (#SBATCH --ntasks-per-node): the most worker ranks any node holds."""
        return _tasks_per_node(self.workers)

    def worker(self, role: RoleName | str, index: int) -> WorkerPlan:
        role = RoleName(role)
        for w in self.workers:
            if w.role is role and w.index == index:
                return w
        raise KeyError(f"{role.value}-{index}")

    def service(self, name: str) -> ServicePlan:
        return next(s for s in self.services if s.name == name)


AUTO_FRONTEND_CORES_PER_PROCESS = 8  # two on a 16-core GPU box measured best (four: 12 % fewer tokens/s)
AUTO_FRONTEND_MAX = 4


def _tasks_per_node(workers: list[WorkerPlan]) -> int:
    per_node: dict[int, int] = {}
    for w in workers:  # workers packed on one node each need their own task slots (CPUs)
        for n in w.nodes:
            per_node[n] = per_node.get(n, 0) + w.tasks_per_node
    return max([*per_node.values(), 1])


def frontend_processes(setting: int | Literal["auto"], cluster: ClusterProfile, workers: list[WorkerPlan]) -> int:
    """frontend.processes as a count, each with a CPU of the job's own: "auto" is one per 8 cores of the node,
    1 to 4, within what the job holds there (a whole node when exclusive, else a CPU per task slot)."""
    held = cluster.cpus_per_node if cluster.exclusive or cluster.is_local else _tasks_per_node(workers)
    if setting == "auto":
        return max(1, min(AUTO_FRONTEND_MAX, cluster.cpus_per_node // AUTO_FRONTEND_CORES_PER_PROCESS, held))
    if setting > held and not cluster.is_local:  # a local run may oversubscribe its cores; a Slurm step may not
        raise UserError(f"{setting} frontend processes need a CPU each, but the job holds {held} on the frontend's "
                        f"node", field="frontend.processes",
                        hint=f"use at most {held}, 'auto', or a cluster profile with exclusive: true")
    return int(setting)


def plan(cluster: ClusterProfile, recipe: Recipe) -> Plan:
    """Which node runs etcd, NATS, the frontend and each worker; GPUs, ranks and ports."""
    local = cluster.is_local
    gpn = cluster.gpus_per_node
    base = cluster.port_base
    dedicated_infra = recipe.infra.placement == "dedicated" and not local

    services = []
    if recipe.infra.etcd and cluster.discovery == "etcd":
        services.append(ServicePlan(name="etcd", node=0, ports={"client": base + ETCD_CLIENT,
                                                                "peer": base + ETCD_PEER}))
    if recipe.infra.nats:
        services.append(ServicePlan(name="nats", node=0, ports={"client": base + NATS_CLIENT,
                                                                "monitor": base + NATS_MONITOR}))

    node, used_on_node = (1, 0) if dedicated_infra else (0, 0)
    floor = node  # the first node workers may use
    used: dict[int, int] = {}  # GPUs taken per node (pack: a worker takes the first node with room, first fit)
    workers: list[WorkerPlan] = []
    serial = 0
    next_index: dict[RoleName, int] = {}
    for role_name, pool, role in recipe.roles.groups():
        if used_on_node and not local and recipe.placement in ("spread", "hetjob"):
            node, used_on_node = node + 1, 0  # spread: each role (each pool) starts on a node of its own
        tasks = role.gpus_per_worker
        first_index = next_index.get(role_name, 0)
        next_index[role_name] = first_index + role.count
        for index in range(first_index, first_index + role.count):
            if not local and gpn and tasks <= gpn and recipe.placement == "pack":
                node = next(n for n in range(floor, max(used, default=floor) + 2) if used.get(n, 0) + tasks <= gpn)
                nodes, tasks_per_node, offset = [node], tasks, used.get(node, 0)
                used[node] = used.get(node, 0) + tasks
                used_on_node = used[node]
            elif local or tasks <= gpn or gpn == 0:
                if not local and gpn and used_on_node + tasks > gpn:
                    node, used_on_node = node + 1, 0
                nodes, tasks_per_node, offset = [node], tasks, used_on_node
                used_on_node += tasks
                used[node] = used_on_node
            else:
                if tasks % gpn:
                    raise UserError(
                        f"a worker of {tasks} GPUs spans nodes but is not a whole number of "
                        f"{gpn}-GPU nodes", field=f"roles.{role_name.value}",
                        hint=f"use a TP x PP that is a multiple of {gpn}")
                node = max([node] + [n + 1 for n, g in used.items() if g])  # whole nodes after every used one
                span = tasks // gpn
                nodes, tasks_per_node, offset = list(range(node, node + span)), gpn, 0
                used.update({n: gpn for n in nodes})
                node, used_on_node = node + span - 1, gpn
            ranks = []
            for rank in range(tasks):
                c = rank_coords(rank, tp=role.tensor_parallel_size, pp=role.pipeline_parallel_size,
                                ep=role.expert_parallel_size, attention_dp=role.enable_attention_dp,
                                tasks_per_node=tasks_per_node, gpu_offset=offset)
                ranks.append(RankPlan(rank=rank, node=nodes[c.node_offset], local_rank=c.local_rank,
                                      gpu=c.gpu, pp=c.pp, tp=c.tp, ep=c.ep, dp=c.dp))
            first = base + WORKER_PORTS_START + PORTS_PER_WORKER * serial
            workers.append(WorkerPlan(
                role=role_name, index=index, pool=pool, nodes=nodes, tasks=tasks, tasks_per_node=tasks_per_node,
                gpus_per_node=tasks_per_node, gpu_offset=offset,
                ports={"rpc": first, "http": first + 1, "dist": first + 2}, ranks=ranks))
            serial += 1
    job_nodes = 1 if local else max([0] + [n for w in workers for n in w.nodes]) + 1
    # after the workers: how many processes the frontend gets depends on the CPUs the job holds for them
    services.append(ServicePlan(name="frontend", node=0, ports={"http": recipe.frontend.port},
                                processes=frontend_processes(recipe.frontend.processes, cluster, workers)))
    order = [s.name for s in services if s.name != "frontend"] + ["frontend"] + [w.name for w in workers]
    return Plan(job_nodes=job_nodes, gpus_per_node=gpn, services=services, workers=workers,
                readiness_order=order)


def het_components(p: Plan) -> list[list[int]]:
    """placement: hetjob's components: consecutive nodes that run the same things (the services' node; each
    role's, or pool's, nodes), each a component of the heterogeneous job that Slurm places on its own."""
    owners: dict[int, set[str]] = {}
    for s in p.services:
        owners.setdefault(s.node, set()).add("services")
    for w in p.workers:
        for n in w.nodes:
            owners.setdefault(n, set()).add(f"{w.role.value}/{w.pool or ''}")
    components: list[list[int]] = []
    previous = None
    for n in range(p.job_nodes):
        owner = frozenset(owners.get(n, ()))
        if components and owner == previous:
            components[-1].append(n)
        else:
            components.append([n])
        previous = owner
    return components


def device_for(plan: WorkerPlan, rank: int, visible: int, whole_node: bool = False) -> tuple[str, bool]:
    """(device, shared). A process that sees the whole node's GPUs uses the planned index; one that sees only its
    worker's GPUs (Slurm binding) uses the position among them. A local launch on a machine with fewer GPUs than
    the plan places its workers round-robin on the ones there are — the stated fallback, reported as shared."""
    if visible == 0:
        return "cpu", False
    gpu = plan.ranks[rank].gpu
    if whole_node:
        return f"cuda:{gpu % visible}", gpu >= visible
    if visible > gpu and visible > plan.gpus_per_node:
        return f"cuda:{gpu}", False
    index = gpu - plan.gpu_offset
    if not 0 <= index < visible:
        raise RuntimeError(f"{plan.name} rank {rank}: planned GPU {gpu} but this task sees {visible} GPU(s)")
    return f"cuda:{index}", False
