"""The run directory: runs/<recipe>-<timestamp>/ with the manifest, engine configs, job.sbatch, logs/.

Components report into it (state/<component>.json); the launcher records submission in run.json.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

import yaml

from typing import TYPE_CHECKING

from hpc.errors import UserError
from hpc.manifest import ChainLink, Manifest

if TYPE_CHECKING:  # a Resolved is handed in; resolve sits above the run directory
    from hpc.resolve import Resolved

RUNS_DIR_NAME = "runs"
SCRAPE_TARGETS = "prometheus-targets.json"


def bundle_dir(runs_root: str | Path, python_version: str) -> Path:
    """hpc's runtime for a container image: beside the run directories (a shared filesystem by necessity), one per
    Python version (hpc.launch.bundle builds it)."""
    return Path(runs_root) / ".hpc-runtime" / f"py{python_version}"
QUEUED = "queued.json"  # a chain link's: the job the link before queued for it (ChainDir)
SERVING_PHASES = ("registered", "first_token", "draining")  # a worker phase with requests it may hold


def runs_root(cluster: Any = None) -> Path:
    """Where a run directory goes: HPC_RUNS_DIR, else the cluster profile's runs_dir (a directory its nodes
    see), else ./runs."""
    if "HPC_RUNS_DIR" in os.environ:
        return Path(os.environ["HPC_RUNS_DIR"])
    if cluster is not None and cluster.runs_dir:
        return Path(cluster.runs_dir).expanduser()
    return Path.cwd() / RUNS_DIR_NAME


def known_roots_file() -> Path:
    """This user's list of runs directories launches wrote to (XDG state): a profile given as a YAML path, or a
    HPC_RUNS_DIR set only for the launch, is in no place search_roots would otherwise look."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "hpc" / "runs-roots"


def known_roots() -> list[Path]:
    try:
        lines = known_roots_file().read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    return [Path(line) for line in dict.fromkeys(lines) if line.startswith("/")]


MAX_KNOWN_ROOTS = 32  # the most recent runs directories remembered; status, logs and cancel look in each


def remember_root(root: Path) -> None:
    """Adds `root` to known_roots, the most recent last, dropping directories that are gone and all but the
    newest MAX_KNOWN_ROOTS (the list grew by one a launch, forever); a list that cannot be written costs only that
    (the launch goes on)."""
    if "\n" in str(root):
        return
    before = known_roots()
    kept = [r for r in before if r != root and r.is_dir()][-(MAX_KNOWN_ROOTS - 1):] + [root]
    if kept == before:
        return
    try:
        write_atomic(known_roots_file(), "".join(f"{r}\n" for r in kept))
    except OSError:
        pass


def search_roots() -> list[Path]:
    """Where status, logs and cancel look for runs (they name a run, not a cluster): HPC_RUNS_DIR alone, else
    ./runs, every cluster profile's runs_dir and the runs directories earlier launches wrote to."""
    if "HPC_RUNS_DIR" in os.environ:
        return [runs_root()]
    from hpc.spec.base import load_yaml
    from hpc.spec.catalog import available, find

    roots = [runs_root()]
    for name in available("clusters"):
        try:  # only this key: a profile with an error elsewhere must not hide its runs
            value = load_yaml(find("clusters", name)).get("runs_dir")
        except (OSError, UserError, AttributeError):
            continue
        if isinstance(value, str) and Path(value).expanduser() not in roots:
            roots.append(Path(value).expanduser())
    roots += [root for root in known_roots() if root not in roots and root.is_dir()]
    return roots


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Readers on a shared filesystem never see a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any, mode: int | None = None) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n", mode)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a service of the run listens: endpoints/<service>.json, written by the service once it does (etcd,
    NATS, the frontend, a worker's rank-0 rendezvous), read by whoever needs it — each through this record."""

    host: str
    port: int
    url: str | None = None  # its base URL (the frontend's, NATS's)
    health: str | None = None  # a URL that answers 200 while it is healthy (etcd, NATS)

    @classmethod
    def parse(cls, data: Any) -> "Endpoint | None":
        """None for what is not one (a file half written by an older job, or of another shape)."""
        if not isinstance(data, dict) or not isinstance(data.get("host"), str) or \
                not isinstance(data.get("port"), int) or isinstance(data.get("port"), bool):
            return None
        url, health = data.get("url"), data.get("health")
        return cls(data["host"], data["port"], url if isinstance(url, str) else None,
                   health if isinstance(health, str) else None)

    def to_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}

    def base_url(self) -> str:
        """Its URL, of a service that always publishes one (the frontend, NATS)."""
        if self.url is None:
            raise RuntimeError(f"the endpoint at {self.host}:{self.port} published no url")
        return self.url


@dataclass(frozen=True)
class RunLayout:
    """Where a run's files are: one spelling for the launcher, the job's checks and the runtime."""

    root: Path

    state = property(lambda self: self.root / "state")  # state/<component>.json: each component's phase
    endpoints = property(lambda self: self.root / "endpoints")  # endpoints/<service>.json: where it listens
    logs = property(lambda self: self.root / "logs")
    ready = property(lambda self: self.root / "state" / "ready.json")  # the readiness stage's record
    smoke = property(lambda self: self.root / "smoke.json")  # the smoke verdict
    local_pids = property(lambda self: self.root / "local.json")  # a local run's process groups

    @classmethod
    def of(cls, run_dir: str | Path) -> "RunLayout":
        return cls(Path(run_dir))

    def component_state(self, component: str) -> Path:
        return self.state / f"{component}.json"

    def endpoint(self, service: str) -> Path:
        return self.endpoints / f"{service}.json"

    def read_endpoint(self, service: str) -> Endpoint | None:
        """Where `service` listens, once it has said so."""
        return Endpoint.parse(read_json(self.endpoint(service)))


@dataclass(frozen=True)
class RunInfo:
    """run.json: what hpc made of a run and did with it (the job's own record is job.json). Written by the
    launcher only; read once into this record, so a field's name and type are checked where it is written."""

    run_id: str = ""
    recipe: str = ""
    cluster: str = ""
    created: str = ""
    submitted: bool = False
    scheduler: Literal["local", "slurm"] | None = None  # the backend that started it (launch/backends.of_run)
    job_id: str | None = None  # a local run's is its run id
    submitted_at: float | None = None
    submit_error: str | None = None  # sbatch refused it
    cancelled_at: float | None = None
    smoke_via: Literal["none", "submitit", "job"] | None = None  # who runs its smoke checks
    smoke_job_id: str | None = None
    in_allocation: bool = False  # its script runs in an allocation the user holds
    script_pid: int | None = None  # that script's process (in_allocation)
    resubmitted_from: str | None = None  # its job's preflight left bad nodes out and resubmitted it

    @classmethod
    def from_json(cls, data: Any) -> "RunInfo":
        """A run.json as read; keys this hpc does not know (a newer one wrote it) are left out, and a job id is
        always a string."""
        if not isinstance(data, dict):
            return cls()
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("job_id", "smoke_job_id", "resubmitted_from"):
            if values.get(key) is not None:
                values[key] = str(values[key])
        return cls(**values)

    def with_fields(self, **changes: Any) -> "RunInfo":
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"run.json has no field {', '.join(sorted(unknown))}")
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.layout = RunLayout(path)

    manifest_path = property(lambda self: self.path / "manifest.json")
    script_path = property(lambda self: self.path / "job.sbatch")
    logs = property(lambda self: self.layout.logs)
    state = property(lambda self: self.layout.state)
    run_info_path = property(lambda self: self.path / "run.json")
    job_path = property(lambda self: self.path / "job.json")  # the running job's own record (checks/jobstart)
    secrets = property(lambda self: self.path / "secrets")
    # a job whose preflight left nodes out resubmitted itself (preflight.on_bad_node: exclude; job.sbatch.j2)
    resubmitted_path = property(lambda self: self.path / "resubmitted.json")

    def manifest(self) -> Manifest:
        return Manifest.load(self.manifest_path)

    @property
    def name(self) -> str:
        """The run's id as hpc shows it: the directory's name, or CHAIN.K for link K of a chain."""
        chain = self.chain()
        return f"{chain.path.name}.{self.path.name}" if chain is not None else self.path.name

    def chain(self) -> "ChainDir | None":
        """The chain this run is a link of (hpc launch --chain), from where it lies: CHAIN/links/K/."""
        if self.path.parent.name == ChainDir.LINKS and (self.path.parent.parent / ChainDir.RECORD).is_file():
            return ChainDir(self.path.parent.parent)
        return None

    def run_info(self) -> RunInfo:
        return RunInfo.from_json(read_json(self.run_info_path))

    def job(self) -> dict[str, Any]:
        """What the job that last started here recorded of itself: job_id, started_at, submitted_by."""
        return read_json(self.job_path) or {}

    def job_id(self) -> str | None:
        """The run's job: the one that last started here (a plain sbatch too), else the one a job's preflight
        resubmitted after it (not started yet), else the one hpc launch submitted."""
        job, again = self.job(), self.resubmitted()
        if again.get("job_id") and _number(again.get("at")) >= _number(job.get("started_at")):
            return str(again["job_id"])
        # a chain's later link: the job the link before queued for it (ChainDir), until it starts
        job_id = job.get("job_id") or self.run_info().job_id or self.queued().get("job_id")
        return None if job_id is None else str(job_id)

    def queued(self) -> dict[str, Any]:
        """job_id, from_job, at: the job the link before queued for this link of a chain (its script wrote it)."""
        found = read_json(self.path / QUEUED)
        return found if isinstance(found, dict) else {}

    def frontend_url(self) -> str | None:
        """Where the run's frontend listens, once it has said so (endpoints/frontend.json)."""
        found = self.layout.read_endpoint("frontend")
        return found.url if found is not None else None

    def resubmitted(self) -> dict[str, Any]:
        """from_job, job_id, excluded (the nodes, comma-separated), at: written by the job script."""
        found = read_json(self.resubmitted_path)
        return found if isinstance(found, dict) else {}

    def preflight(self, job_id: str | None) -> dict[str, Any]:
        """That job's preflight on every node (hpc.checks.node_health): nodes, bad_nodes, seconds."""
        if not job_id:
            return {}
        # a requeued job's later starts: JOB-rN.json (the script's HPC_PREFLIGHT_KEY); the last start's counts
        starts = [self.path / "preflight" / f"{job_id}.json"] + sorted(
            (self.path / "preflight").glob(f"{job_id}-r*.json"), key=lambda p: _number_in(p.stem.rsplit("-r", 1)[1]))
        found = next((data for data in map(read_json, reversed(starts)) if isinstance(data, dict)), None)
        return found or {}

    def submitted(self) -> bool:
        return bool(self.run_info().submitted or self.job_id())

    def update_run_info(self, **changes: Any) -> None:
        write_json(self.run_info_path, self.run_info().with_fields(**changes).to_json())

    def write_scrape_targets(self) -> Path:
        """Prometheus file-SD targets (prometheus-targets.json): the frontend's and each worker's /metrics, one
        group each, labelled by run and component, so that a Prometheus whose file_sd_configs globs the runs
        directory (runs/*/prometheus-targets.json) scrapes every run as it comes up."""
        from urllib.parse import urlsplit

        found = []
        frontend = self.frontend_url()
        if frontend is not None:
            found.append(("frontend", frontend))
        found += [(name, state["http"]) for name, state in sorted(self.component_states().items())
                  if isinstance(state.get("http"), str) and name != "frontend"]
        groups = [{"targets": [urlsplit(url).netloc], "labels": {"job": "hpc", "run": self.path.name,
                                                                  "component": name}}
                  for name, url in found if urlsplit(url).netloc]
        path = self.path / SCRAPE_TARGETS
        write_json(path, groups)
        return path

    def component_states(self) -> dict[str, dict[str, Any]]:
        states = {}
        for path in sorted(self.state.glob("*.json")):
            data = read_json(path)
            if isinstance(data, dict):
                states[path.stem] = data
        return states

    def workers_serving(self) -> list[str]:
        """The workers that may hold requests (registered, or draining what they hold): hpc cancel's first tier
        waits for none to be left. One not serving yet (loading, restarting) has nothing to finish."""
        states = self.component_states()
        return [w.name for w in self.manifest().plan.workers if states.get(w.name, {}).get("phase") in SERVING_PHASES]

    def log_path(self, component: str) -> Path:
        return self.logs / f"{component}.log"


@dataclass(frozen=True)
class ChainDir:
    """A chain of jobs serving one service past the time limit (hpc launch --chain N): chain.json (the launcher's
    record), links/K/ (each an ordinary run directory, its script rendered at launch), serving.json (the link that
    serves now: written by that link's job once its smoke checks passed; hpc endpoint follows it), links/K/queued.json
    (the job the link before queued for it) and `cancelled` (hpc cancel: no further link is queued)."""

    path: Path
    RECORD = "chain.json"
    LINKS = "links"

    @property
    def record(self) -> dict[str, Any]:
        found = read_json(self.path / self.RECORD)
        return found if isinstance(found, dict) else {}

    def link(self, index: int) -> RunDir:
        return RunDir(self.path / self.LINKS / str(index))

    def links(self) -> list[RunDir]:
        return [self.link(k) for k in range(1, int(self.record.get("links") or 0) + 1)]

    def serving(self) -> dict[str, Any]:
        """link, job_id, at: the link that serves now (none before the first is ready)."""
        found = read_json(self.serving_path)
        return found if isinstance(found, dict) and isinstance(found.get("link"), int) else {}

    def job_ids(self, link: RunDir) -> list[str]:
        """Every job id `link` has had: hpc launch's, the one the link before queued, the one that started."""
        ids = [link.run_info().job_id, link.queued().get("job_id"), link.job().get("job_id")]
        return list(dict.fromkeys(str(i) for i in ids if i))

    def current(self) -> RunDir:
        """The link that serves, else the newest one queued or started, else the first."""
        serving = self.serving()
        if serving:
            return self.link(serving["link"])
        begun = [link for link in self.links() if self.job_ids(link)]
        return begun[-1] if begun else self.link(1)

    @property
    def serving_path(self) -> Path:
        return self.path / "serving.json"

    @property
    def cancelled_path(self) -> Path:
        return self.path / "cancelled"


def bad_nodes_text(bad_nodes: dict[str, str]) -> str:
    """A preflight's bad nodes (RunDir.preflight's bad_nodes) as one line: `node2: ecc: ...; node3: ...`."""
    return "; ".join(f"{node}: {why}" for node, why in sorted(bad_nodes.items()))


def _number_in(text: str) -> int:
    return int(text) if text.isdigit() else -1


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) else 0.0


def new_run_id(recipe_name: str, now: _dt.datetime) -> str:
    return f"{recipe_name}-{now.strftime('%Y%m%d-%H%M%S')}"


def create(resolved: Resolved, script_renderer, root: Path | None = None,
           now: _dt.datetime | None = None, link: "tuple[ChainDir, int, int, int] | None" = None) -> RunDir:
    """Write a new run directory; render first, write under a temporary name and rename at the end, so an error
    (a render problem, a full disk) leaves nothing behind. `link` (chain, index, links, handover_s): link `index`
    of a chain, at CHAIN/links/INDEX (create_chain)."""
    now = now or _dt.datetime.now()
    chain = None
    if link is not None:
        chain_dir, index, links, handover_s = link
        root, path = chain_dir.path / ChainDir.LINKS, chain_dir.path / ChainDir.LINKS / str(index)
        root.mkdir(exist_ok=True)
        run_id = f"{chain_dir.path.name}.{index}"
        chain = ChainLink(root=str(chain_dir.path), index=index, links=links, handover_s=handover_s)
    else:
        if root is None:
            root = checked_root(resolved)
        else:
            root = root.resolve()
            _check_runs_root(root)
        path = unique_path(root, new_run_id(resolved.recipe.name, now))
        run_id = path.name
    manifest = resolved.manifest(path, run_id, now, chain)
    script = script_renderer(manifest)
    partial = root / f".{path.name}.partial"
    try:
        partial.mkdir(mode=0o700)  # the script may carry the cluster's env values: this user's eyes only
        (partial / "logs").mkdir()
        (partial / "state").mkdir()
        write_atomic(partial / "manifest.json", manifest.model_dump_json(indent=2) + "\n")
        for role, args in manifest.engine_args.items():
            write_atomic(partial / "engine_configs" / f"{role}.yaml", yaml.safe_dump(args, sort_keys=True))
        write_atomic(partial / "job.sbatch", script, mode=0o700)
        (partial / "secrets").mkdir(mode=0o700)
        write_atomic(partial / "secrets" / "rpc.token", secrets.token_urlsafe(24), mode=0o600)
        partial.rename(path)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"cannot write the run directory {path}: {exc.strerror or exc}", field="HPC_RUNS_DIR",
                        hint="point HPC_RUNS_DIR at a writable directory with free space") from None
    run = RunDir(path)
    run.update_run_info(run_id=run_id, recipe=resolved.recipe.name, cluster=resolved.cluster.name,
                        created=manifest.created, submitted=False)
    if link is None:
        remember_root(root)
    return run


def unique_path(root: Path, name: str) -> Path:
    path, suffix = root / name, 1
    while path.exists():
        suffix += 1
        path = root / f"{name}-{suffix}"
    return path


def create_chain(resolved: Resolved, script_renderer, links: int, handover_s: int,
                 now: _dt.datetime | None = None) -> ChainDir:
    """A chain's directory with all its links written (each link's script queues the next: a plain sbatch of the
    first link's job.sbatch runs the whole chain); nothing is left behind when one cannot be written."""
    now = now or _dt.datetime.now()
    root = checked_root(resolved)
    chain = ChainDir(unique_path(root, new_run_id(resolved.recipe.name, now)))
    try:
        chain.path.mkdir(mode=0o700)
        write_json(chain.path / ChainDir.RECORD, {"links": links, "handover_s": handover_s,
                                                  "recipe": resolved.recipe.name, "cluster": resolved.cluster.name,
                                                  "created": now.isoformat(timespec="seconds")})
        for index in range(1, links + 1):
            create(resolved, script_renderer, now=now, link=(chain, index, links, handover_s))
    except BaseException:
        shutil.rmtree(chain.path, ignore_errors=True)
        raise
    remember_root(root)
    return chain


def checked_root(resolved: Resolved) -> Path:
    """This launch's runs directory (runs_root), made if need be; a problem names where it was set."""
    if "HPC_RUNS_DIR" not in os.environ and resolved.cluster.runs_dir is not None:
        root = runs_root(resolved.cluster).resolve()
        _check_runs_root(root, file=str(resolved.cluster_file), field="runs_dir")
    else:
        root = runs_root().resolve()
        _check_runs_root(root)
    return root


def _check_runs_root(root: Path, file: str | None = None, field: str = "HPC_RUNS_DIR") -> None:
    """A profile's runs_dir is made only where its parent exists: a mistyped shared path, or a shared filesystem
    this machine does not mount, is an error, not a new tree on the login node's own disk."""
    problem = None
    if len(str(root)) > 3000:
        problem = "the path is too long"
    elif root.exists() and not root.is_dir():
        problem = "it is a file, not a directory"
    elif field == "runs_dir" and not root.parent.is_dir():
        raise UserError(f"runs directory {str(root)[:200]}: {root.parent} does not exist on this machine",
                        file=file, field=field, hint="mount the shared filesystem here or fix the path")
    else:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            problem = exc.strerror or str(exc)
        else:
            if not os.access(root, os.W_OK | os.X_OK):
                problem = "it is not writable"
    if problem:
        raise UserError(f"runs directory {str(root)[:200]}: {problem}", file=file, field=field,
                        hint=f"point {field} at a writable directory")


# a run id (tiny-disagg-20261202-153443) or a Slurm job id (42, an array task 42_3, a het component 42+1)
RUN_REF = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,199}")


def shown(text: str, most: int = 80) -> str:
    """A user's string as an error message may quote it: control characters escaped, the length bounded."""
    quoted = repr(text)[1:-1] if any(ord(c) < 32 or ord(c) == 127 for c in text) else text
    return quoted if len(quoted) <= most else quoted[:most] + f"... ({len(text)} characters)"


def _is_dir(ref: str) -> bool:
    """Whether `ref` names a directory; a name no filesystem takes (a NUL, a part past 255 bytes) names none."""
    try:
        return len(ref) <= 4096 and "\0" not in ref and Path(ref).is_dir()
    except OSError:
        return False


def find_run(ref: str | None) -> RunDir:
    """A run directory by path, run id, or Slurm job id; the newest run when `ref` is None."""
    from hpc.errors import UserError

    if ref is not None and _is_dir(ref):
        if (Path(ref) / "manifest.json").is_file():
            return RunDir(Path(ref).resolve())
        if (Path(ref) / ChainDir.RECORD).is_file():
            return ChainDir(Path(ref).resolve()).current()
    if ref is not None and not RUN_REF.fullmatch(ref):
        raise UserError(f"'{shown(ref)}' is not a run id, a job id or a run directory", field="RUN",
                        hint="a run id or job id is letters, digits and . _ + - (at most 200); hpc status lists them")
    roots = search_roots()
    where = " or ".join(str(root) for root in roots)
    runs = list_runs(roots)
    if ref is None:
        if not runs:
            raise UserError(f"no runs under {where}", hint="start one with: hpc launch --recipe tiny-disagg")
        return runs[0]
    for run in runs:  # a job id: the one hpc launch submitted, or one that started here later (plain sbatch)
        ids = (run.run_info().job_id, run.job().get("job_id"))  # a local run has none: "None" matches nothing
        chain = run.chain()
        if chain is not None and ref == chain.path.name:
            return chain.current()
        if ref == run.name or ref in {str(i) for i in ids if i is not None} or (
                chain is not None and ref in chain.job_ids(run)):
            return run
    raise UserError(f"no run '{ref}' under {where}", hint="hpc status lists recent runs")


def list_runs(roots: list[Path] | None = None) -> list[RunDir]:
    """Newest first, from every root that exists."""
    runs = [RunDir(p) for root in (search_roots() if roots is None else roots) if root.is_dir()
            for top in root.iterdir() if not top.name.startswith(".")
            for p in ([top] if (top / "manifest.json").is_file() else
                      sorted((top / ChainDir.LINKS).glob("*"), key=lambda p: _number_in(p.name), reverse=True)
                      if (top / ChainDir.RECORD).is_file() else [])
            if (p / "manifest.json").is_file()]
    return sorted(runs, key=lambda r: r.manifest_path.stat().st_mtime, reverse=True)
