"""Where this process runs: its node's address, and reporting its phases into the run directory."""

from __future__ import annotations

import fcntl
import os
import platform
import socket
import sys
import struct
import time
from pathlib import Path
from typing import Any

from hpc.manifest import Manifest
from hpc.rundir import read_json, write_json


def interface_address(name: str) -> str:
    """IPv4 address of a network interface (SIOCGIFADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def node_address(manifest: Manifest) -> str:
    """The address services on this node bind to: never 0.0.0.0."""
    cluster = manifest.cluster
    if cluster.is_local:
        return "127.0.0.1"
    if cluster.network.interface:
        return interface_address(cluster.network.interface)
    family = socket.AF_INET6 if cluster.network.address_family == "ipv6" else socket.AF_INET
    host = socket.gethostname()
    for info in socket.getaddrinfo(host, None, family, socket.SOCK_STREAM):
        addr = info[4][0]
        if not addr.startswith("127.") and addr != "::1":
            return addr
    return socket.getaddrinfo(host, None, family)[0][4][0]


def process_start_time() -> float:
    """When this process was exec'd (so start-up imports count as the component's own time)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return time.time()


class Reporter:
    """Writes state/<component>.json: phase, times of each phase, node, pid. One writer per file."""

    def __init__(self, manifest: Manifest, component: str) -> None:
        self.path = Path(manifest.run_dir) / "state" / f"{component}.json"
        previous = read_json(self.path) or {}
        self.data: dict[str, Any] = {
            "component": component, "node": socket.gethostname(), "pid": os.getpid(), "phase": "starting",
            "python": f"{sys.executable} {platform.python_version()}",  # which interpreter: image or host
            "phases": {"process_start": process_start_time()}, "restarts": previous.get("restarts", 0),
            "history": previous.get("history", [])}

    def phase(self, name: str, **fields: Any) -> None:
        now = time.time()
        self.data["phase"] = name
        self.data["phases"][name] = now
        self.data["updated"] = now
        self.data.update(fields)
        write_json(self.path, self.data)


def endpoint_path(manifest: Manifest, name: str) -> Path:
    return Path(manifest.run_dir) / "endpoints" / f"{name}.json"


def publish_endpoint(manifest: Manifest, name: str, **data: Any) -> None:
    write_json(endpoint_path(manifest, name), data)


def wait_endpoint(manifest: Manifest, name: str, timeout: float = 600.0) -> dict[str, Any]:
    """Block until a service published where it listens (shared filesystem), or time out."""
    path = endpoint_path(manifest, name)
    deadline = time.monotonic() + timeout
    delay = 0.02
    while time.monotonic() < deadline:
        data = read_json(path)
        if data:
            return data
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)
    raise TimeoutError(f"{name} did not publish its endpoint in {timeout:.0f} s ({path})")


def nats_token(manifest: Manifest) -> str | None:
    return _secret(manifest, "nats.token")


def rpc_token(manifest: Manifest) -> str | None:
    """The job's token for worker RPC (written with the run directory, 0600 in a 0700 directory)."""
    return _secret(manifest, "rpc.token")


def _secret(manifest: Manifest, name: str) -> str | None:
    path = Path(manifest.run_dir) / "secrets" / name
    return path.read_text().strip() if path.is_file() else None
