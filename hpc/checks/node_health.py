"""The hardware and fabric preflight: on every node of the job, in the preflight step (hpc.checks.preflight),
before any server starts, what real clusters break and a software check cannot see:

- the GPUs the plan puts on this node are visible, hold no memory yet (a stale process from an earlier job keeps
  its memory for as long as it lives) and report no uncorrected ECC error or pending page retirement (nvidia-smi);
- the model's largest weight file reads, at how many MB/s (a bounded read: a slow shared filesystem shows here,
  not as a load timeout twenty minutes later);
- the run directory's and TMPDIR's filesystems have room;
- every other node of the job is reachable at the address its servers will publish (a route or firewall that
  drops traffic between two nodes, or a hostname that resolves to 127.0.1.1, is what makes disaggregated requests
  hang while aggregated ones work);
- each planned prefill -> decode pair of nodes moves `transfer_mb` as KV moves, prefill to decode, at the same
  addresses: a link that connects but drops large frames (jumbo frames on one side only) passes a hello and hangs
  on the first KV; a link far slower than it should be shows its MB/s.

Each check is skipped where it cannot apply (no nvidia-smi, no GPU planned on the node, a model the job builds).
Every failure is one line naming the node, the check, the figure and the fix. The nodes meet through files in the
run directory (RUN/preflight/JOB/), the filesystem they share by necessity; the first task gathers every node's
result into RUN/preflight/JOB.json, and the nodes to leave out into RUN/preflight/JOB.bad-nodes, which the
script reads when the profile says `preflight.on_bad_node: exclude`.

Standard library only: it runs before the packages it checks for are known to be there.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from hpc.net.addresses import advertised_address

GPU_QUERY = "index,uuid,memory.used,memory.total,ecc.errors.uncorrected.volatile.total,retired_pages.pending"
SMI_TIMEOUT_S = 15.0
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
READ_CHUNK = 8 << 20
READ_TIME_LIMIT_S = 10.0  # a read this slow has said what it needed to
HELLO = b"hpc-preflight "
SEND = b"hpc-send "  # then a number of bytes: the listener sends that many, as a prefill sends its KV
SEND_CHUNK = 1 << 20
CRAWL_MB_S = 10.0  # the kv path's transfer ends by peer_timeout_s plus its size at this rate


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    figure: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.check}: {self.figure}" + (f"; {self.fix}" if self.fix and not self.ok else "")


def leave_out(node: str) -> str:
    return (f"drain {node} (scontrol update NodeName={node} State=DRAIN Reason=hpc-preflight) or set "
            "preflight.on_bad_node: exclude in the cluster profile")


def gpus_needed(manifest: dict, node_index: int) -> int:
    """The GPUs the plan puts on this node (the mock engine uses none)."""
    if manifest["recipe"]["backend"] == "mock":
        return 0
    return max((w["gpu_offset"] + w["gpus_per_node"] for w in manifest["plan"]["workers"]
                if node_index in w["nodes"]), default=0)


def _job_gpu_indices() -> set[str] | None:
    """The GPUs Slurm gave this job on this node, where it says (a node shared with other jobs has GPUs whose
    memory is not ours to judge); None: all of them."""
    for name in ("SLURM_STEP_GPUS", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS"):
        value = os.environ.get(name, "").strip()
        if value and all(part.strip().isdigit() for part in value.split(",")):
            return {part.strip() for part in value.split(",")}
    return None


def _number(text: str) -> int:
    try:
        return int(float(text))
    except ValueError:  # [N/A], [Not Supported]: the GPU does not report it
        return 0


def gpu_findings(needed: int, node: str, max_used_mib: int,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> list[Finding]:
    if needed == 0:
        return []
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [Finding("gpus", True, "no nvidia-smi here, GPU checks skipped")]
    try:
        done = run([smi, f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"], capture_output=True,
                   text=True, timeout=SMI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [Finding("gpus", False, f"nvidia-smi did not answer in {SMI_TIMEOUT_S:.0f} s (a wedged GPU or "
                                       "driver)", leave_out(node))]
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        return [Finding("gpus", False, f"nvidia-smi failed (exit {done.returncode}): "
                                       f"{said[-1][:200] if said else 'no message'}", leave_out(node))]
    rows = [[cell.strip() for cell in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    rows = [row for row in rows if len(row) >= 6]
    ours = _job_gpu_indices()
    if ours is not None and len(ours) >= needed:
        rows = [row for row in rows if row[0] in ours] or rows
    if len(rows) < needed:
        return [Finding("gpus", False, f"{len(rows)} visible, the plan puts {needed} on this node", leave_out(node))]
    bad = []
    for index, _uuid, used, total, ecc, pending, *_ in rows:
        if _number(ecc) > 0:
            bad.append(Finding("ecc", False, f"GPU {index} reports {_number(ecc)} uncorrected ECC errors",
                               leave_out(node)))
        if pending.lower() == "yes":
            bad.append(Finding("ecc", False, f"GPU {index} has retired pages pending (it needs a reset)",
                               leave_out(node)))
        if _number(used) > max_used_mib:
            bad.append(Finding("gpu memory", False, f"GPU {index} holds {_number(used)} MiB of {_number(total)} "
                                                    "before any server started (a stale process)",
                               "end it (nvidia-smi --query-compute-apps=pid,used_memory --format=csv) or "
                               + leave_out(node)))
    return bad or [Finding("gpus", True, f"{len(rows)} GPUs free, no ECC errors")]


def _largest_weight_file(folder: Path) -> Path | None:
    found = [p for pattern in ("*", "*/*") for p in folder.glob(pattern)
             if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    return max(found, key=lambda p: p.stat().st_size, default=None)


def model_read_finding(manifest: dict, node: str, read_mb: int, min_mb_s: float | None) -> Finding | None:
    """A bounded read of the largest weight file; None where there is none to read (a model the job builds,
    a hub id, a directory that is not there, which the software check reports)."""
    model = manifest["recipe"]["model"]
    path = model.get("path")
    if model.get("generate") or not path or not path.startswith(("/", "~", ".")):
        return None
    folder = Path(path).expanduser()
    try:
        largest = _largest_weight_file(folder) if folder.is_dir() else None
    except OSError:
        largest = None
    if largest is None:
        return None
    wanted, got = read_mb << 20, 0
    t0 = time.monotonic()
    try:
        with open(largest, "rb", buffering=0) as f:
            while got < wanted and time.monotonic() - t0 < READ_TIME_LIMIT_S:
                chunk = f.read(min(READ_CHUNK, wanted - got))
                if not chunk:
                    break
                got += len(chunk)
    except OSError as exc:
        return Finding("model read", False, f"cannot read {largest}: {exc.strerror or exc}",
                       "check the mount and its permissions on this node, or " + leave_out(node))
    seconds = max(time.monotonic() - t0, 1e-6)
    speed = got / 1e6 / seconds
    figure = f"{largest.name} {got / 1e6:.0f} MB in {seconds:.2f} s, {speed:.0f} MB/s"
    if min_mb_s is not None and speed < min_mb_s:
        return Finding("model read", False, f"{figure}, under the profile's floor {min_mb_s:g} MB/s",
                       "copy the model to a faster filesystem (node-local NVMe, a Lustre stripe) or " + leave_out(node))
    return Finding("model read", True, figure)


def scratch_findings(run_dir: str, min_free_gb: float) -> list[Finding]:
    seen, found = set(), []
    for label, path in (("run directory", run_dir), ("TMPDIR", os.environ.get("TMPDIR") or "/tmp")):
        try:
            device = os.stat(path).st_dev
            free = shutil.disk_usage(path).free / 1e9
        except OSError:
            continue
        if device in seen:
            continue
        seen.add(device)
        if free < min_free_gb:
            found.append(Finding("scratch", False, f"{label} {path} has {free:.1f} GB free, under "
                                                   f"{min_free_gb:g} GB", "free space there or set "
                                                   "preflight.min_free_gb in the cluster profile"))
    return found


class Mesh:
    """Every node listens at the address its servers will publish and connects to every other node's."""

    def __init__(self, folder: Path, node: str, index: int, address: str, expected: int,
                 peer_timeout_s: float, gather_timeout_s: float) -> None:
        self.folder, self.node, self.index, self.address = folder, node, index, address
        self.expected, self.peer_timeout_s, self.gather_timeout_s = expected, peer_timeout_s, gather_timeout_s
        self.listener = socket.socket()  # replaced by start()'s, bound to the published address
        self.heard: set[str] = set()
        self.peers: dict[str, dict] = {}  # every node's listener, once probe() gathered them

    def open(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        self.listener = socket.socket(family, socket.SOCK_STREAM)
        self.listener.bind((self.address, 0))
        self.listener.listen(64)
        threading.Thread(target=self._answer, daemon=True).start()
        _write(self.folder / f"{self.node}.addr.json",
               {"node": self.node, "index": self.index, "address": self.address,
                "port": self.listener.getsockname()[1]})

    def _answer(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.peer_timeout_s)
            try:
                hello = conn.recv(256)
                if hello.startswith(HELLO):
                    self.heard.add(hello[len(HELLO):].decode(errors="replace").strip())
                    conn.sendall(b"ok\n")
                elif hello.startswith(SEND) and hello[len(SEND):].strip().isdigit():
                    left = min(int(hello[len(SEND):].strip()), 1024 * SEND_CHUNK)
                    block = bytes(SEND_CHUNK)
                    while left > 0:
                        conn.sendall(block[:left])
                        left -= min(left, SEND_CHUNK)
            except OSError:
                pass

    def probe(self) -> tuple[Finding, list[str]]:
        found = _gather(self.folder, ".addr.json", self.expected, self.gather_timeout_s)
        self.peers = found
        others = [rec for name, rec in sorted(found.items(), key=lambda kv: kv[1]["index"]) if name != self.node]
        failed, slowest = [], 0.0
        for rec in others:
            t0 = time.monotonic()
            try:
                with socket.create_connection((rec["address"], rec["port"]), timeout=self.peer_timeout_s) as s:
                    s.sendall(HELLO + self.node.encode() + b"\n")
                    if not s.recv(16).startswith(b"ok"):
                        raise OSError("no answer")
                slowest = max(slowest, time.monotonic() - t0)
            except OSError as exc:
                reason = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
                failed.append((rec, f"{reason} after {time.monotonic() - t0:.1f} s"))
        missing = self.expected - len(found)
        if failed:
            rec, why = failed[0]
            more = f" (and {len(failed) - 1} more nodes)" if len(failed) > 1 else ""
            return Finding("peers", False, f"cannot reach {rec['node']} at {rec['address']}:{rec['port']} "
                                           f"({why}){more}",
                           f"check the route and firewall between the nodes (ip route get {rec['address']} on "
                           f"{self.node}) and the profile's network.interface"), [r["node"] for r, _ in failed]
        if missing > 0:
            return Finding("peers", False, f"{missing} of {self.expected} nodes did not report in "
                                           f"{self.gather_timeout_s:.0f} s",
                           "see logs/preflight.log for the nodes that did not start their check"), []
        return Finding("peers", True, f"{len(others)}/{len(others)} nodes reachable, slowest "
                                      f"{slowest * 1000:.0f} ms"), []

    def fetch(self, peers: dict[str, dict], sources: list[str], mb: int,
              min_mb_s: float | None) -> tuple[Finding | None, list[str]]:
        """`mb` from each node in `sources` (the prefill nodes this decode node takes KV from), timed; a stall
        past peer_timeout_s or a rate under `min_mb_s` fails the pair."""
        failed, rates = [], []
        for name in sources:
            rec = peers.get(name)
            if rec is None:
                continue  # not reported: the peers check says so
            want, got, t0 = mb * SEND_CHUNK, 0, time.monotonic()
            deadline = t0 + self.peer_timeout_s + mb / CRAWL_MB_S  # a crawl is bounded too, not only a stall
            try:
                conn = socket.create_connection((rec["address"], rec["port"]), timeout=self.peer_timeout_s)
            except OSError as exc:
                why = "timed out" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
                failed.append((name, f"cannot connect to {name} for its {mb} MB ({why})"))
                continue
            try:
                with conn as s:
                    s.sendall(SEND + str(want).encode() + b"\n")
                    while got < want:
                        s.settimeout(max(0.01, min(self.peer_timeout_s, deadline - time.monotonic())))
                        if time.monotonic() >= deadline:
                            raise socket.timeout()
                        chunk = s.recv(min(SEND_CHUNK, want - got))
                        if not chunk:
                            raise OSError("the sender closed early")
                        got += len(chunk)
            except OSError as exc:
                why = "stalled" if isinstance(exc, socket.timeout) else (exc.strerror or str(exc))
                failed.append((name, f"{got / SEND_CHUNK:.1f} of {mb} MB from {name} ({why} after "
                                     f"{time.monotonic() - t0:.1f} s)"))
                continue
            rate = mb / max(time.monotonic() - t0, 1e-6)
            rates.append(rate)
            if min_mb_s is not None and rate < min_mb_s:
                failed.append((name, f"{mb} MB from {name} at {rate:.0f} MB/s, under min_transfer_mb_s "
                                     f"{min_mb_s:g}"))
        if failed:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            return Finding("kv path", False, failed[0][1] + more,
                           "a link that connects but stalls on bulk data drops large frames: check that both "
                           "nodes' interfaces have the same MTU (ip link), and the profile's network.interface"), \
                [name for name, _ in failed]
        if not rates:
            return None, []
        return Finding("kv path", True, f"{mb} MB from {len(rates)} prefill node(s), slowest {min(rates):.0f} MB/s"), []

    def close(self) -> None:
        if self.listener is not None:
            try:  # wakes the thread blocked in accept(), which close() alone would not
                self.listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.listener.close()


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, sort_keys=True))
    os.replace(tmp, path)


def _gather(folder: Path, suffix: str, expected: int, timeout_s: float) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = {}
        for path in folder.glob(f"*{suffix}"):
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            found[record["node"]] = record
        if len(found) >= expected or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def bad_nodes(results: dict[str, dict], expected: int) -> dict[str, str]:
    """node -> why it should be left out: its own failed checks; for nodes that cannot reach each other, the one
    in most failed pairs (of a pair alone, the later one: the first node holds the job's services). A node that
    did not report is left out too."""
    bad = {name: (rec.get("problems") or rec["lines"])[0] for name, rec in results.items() if rec.get("local_failed")}
    pairs: dict[str, set[str]] = {}
    for name, rec in results.items():
        for peer in rec.get("unreachable", []):
            pairs.setdefault(name, set()).add(peer)
            pairs.setdefault(peer, set()).add(name)
    if pairs:
        most = max(len(p) for p in pairs.values())
        index = {name: rec.get("index", 0) for name, rec in results.items()}
        worst = sorted((n for n, p in pairs.items() if len(p) == most), key=lambda n: index.get(n, 0))
        for name in (worst if len(worst) != 2 else worst[-1:]):
            bad.setdefault(name, f"cannot reach {', '.join(sorted(pairs[name]))}")
    if len(results) < expected:
        bad.setdefault("?", f"{expected - len(results)} nodes did not report")
    return bad


def kv_sources(manifest: dict, index: int) -> list[int]:
    """The nodes (plan indices) whose prefill workers send KV to a decode worker on node `index`, not itself."""
    workers = manifest["plan"]["workers"]
    if not any(index in w["nodes"] for w in workers if w["role"] == "decode"):
        return []
    return sorted({n for w in workers if w["role"] == "prefill" for n in w["nodes"]} - {index})


def node_findings(manifest: dict, node: str, index: int) -> list[Finding]:
    """This node's own checks (no other node involved)."""
    settings = manifest["cluster"]["preflight"]  # every field is in the manifest: its defaults are the profile's
    found = gpu_findings(gpus_needed(manifest, index), node, settings["gpu_memory_used_max_mib"])
    read = model_read_finding(manifest, node, settings["model_read_mb"], settings["min_read_mb_s"])
    found += [read] if read else []
    return found + scratch_findings(manifest["run_dir"], settings["min_free_gb"])


@dataclass(frozen=True)
class JobNode:
    """This node among the job's: its Slurm name (what --exclude takes; the hostname may be another), its place
    and how many there are. HPC_JOB_NODES is the script's NODES array, exported: a heterogeneous job runs its
    preflight as a step per component, whose own SLURM_NODEID and node counts are the component's."""

    name: str
    index: int
    count: int

    @property
    def first(self) -> bool:
        return self.index == 0


def job_node() -> JobNode:
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    listed = os.environ.get("HPC_JOB_NODES", "").split()
    if name in listed:
        return JobNode(name, listed.index(name), len(listed))
    count = int(os.environ.get("SLURM_STEP_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    return JobNode(name, int(os.environ.get("SLURM_NODEID", "0")), count)


def run_checks(manifest: dict, software_ok: bool, software_line: str,
               t0: float | None = None) -> tuple[list[Finding], dict]:
    """This node's findings and, on the first task, the whole job's record (RUN/preflight/JOB.json); `t0`: when
    the preflight started (time.monotonic), for the seconds it took."""
    settings = manifest["cluster"]["preflight"]
    t0 = time.monotonic() if t0 is None else t0
    here = job_node()
    node, index, expected = here.name, here.index, here.count
    job = os.environ.get("SLURM_JOB_ID", "nojob")
    key = os.environ.get("HPC_PREFLIGHT_KEY") or job  # the script's: the job id, and its restart count if requeued
    folder = Path(manifest["run_dir"]) / "preflight" / key
    network = manifest["cluster"].get("network") or {}
    mesh = None
    if expected > 1:
        mesh = Mesh(folder, node, index, advertised_address(network.get("interface"),
                                                            network.get("address_family", "ipv4")),
                    expected, settings["peer_timeout_s"], settings["gather_timeout_s"])
        mesh.open()
    found = node_findings(manifest, node, index)
    local_failed = not software_ok or any(not f.ok for f in found)
    unreachable: list[str] = []
    if mesh is not None:
        peers, unreachable = mesh.probe()
        found.append(peers)
        sources = kv_sources(manifest, index)
        if sources and settings.get("transfer_mb"):
            names = {rec["index"]: name for name, rec in mesh.peers.items()}
            # a node the peers check could not reach is named there already: not twice, and not as a stall
            kv, stalled = mesh.fetch(mesh.peers, [names[i] for i in sources if i in names and names[i] not in unreachable],
                                     settings["transfer_mb"], settings.get("min_transfer_mb_s"))
            found += [kv] if kv else []
            unreachable += [n for n in stalled if n not in unreachable]
    lines = ([] if software_ok else [software_line]) + [f.line() for f in found if not f.ok]
    problems = ([] if software_ok else [software_line.split(": ", 1)[-1]]) + [
        f"{f.check}: {f.figure}" for f in found if not f.ok]  # without the fixes, for the lists of bad nodes
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / f"{node}.result.json", {"node": node, "index": index, "local_failed": local_failed,
                                             "unreachable": unreachable, "lines": lines or ["ok"], "problems": problems,
                                             "findings": [asdict(f) for f in found],
                                             "seconds": round(time.monotonic() - t0, 2)})
    record: dict = {}
    gather_s = settings["gather_timeout_s"] + 10  # the others' results come after their own gathering
    if here.first:
        results = _gather(folder, ".result.json", expected, gather_s)
        record = {"job_id": job, "nodes": results, "expected": expected,
                  "bad_nodes": bad_nodes(results, expected), "seconds": round(time.monotonic() - t0, 2)}
        _write(folder.parent / f"{key}.json", record)
        named = sorted(n for n in record["bad_nodes"] if n != "?")
        (folder.parent / f"{key}.bad-nodes").write_text("".join(f"{n}\n" for n in named))
    elif mesh is not None:  # stay reachable until the first task has heard from every node
        deadline = time.monotonic() + gather_s
        while not (folder.parent / f"{key}.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    if mesh is not None:
        mesh.close()
    return found, record
