"""`python -m hpc.runtime.services.infra MANIFEST --service etcd|nats`: start a job-scoped etcd or NATS server.

It binds the node's own address, keeps its data in a job-scoped directory, writes per-job credentials
(mode 0600) and its endpoint into the run directory once its health probe passes, and forwards SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import shutil
import sys
import tempfile
import urllib.request
from pathlib import Path

from hpc.manifest import Manifest
from hpc.rundir import Endpoint, write_atomic
from hpc.waiting import wait_until
from hpc.runtime.services.binaries import etcd_binary, nats_binary
from hpc.runtime.services.node import Reporter, node_address, publish_endpoint


def scratch_dir(manifest: Manifest, name: str) -> Path:
    """Node-local data (etcd fsyncs; a parallel filesystem would make it crawl), in a fresh private directory:
    a predictable /tmp path could be planted in advance as a link to somewhere else."""
    return Path(tempfile.mkdtemp(prefix=f"hpc-{manifest.run_id}-{name}-"))


def etcd_command(manifest: Manifest, host: str) -> tuple[list[str], str, Path]:
    ports = manifest.plan.service("etcd").ports
    client = f"http://{host}:{ports['client']}"
    peer = f"http://{host}:{ports['peer']}"
    data = scratch_dir(manifest, "etcd")
    cmd = [etcd_binary(), "--name", "hpc", "--data-dir", str(data), "--listen-client-urls", client,
           "--advertise-client-urls", client, "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
           "--initial-cluster", f"hpc={peer}", "--initial-cluster-state", "new",
           # Short heartbeats allow 1 s leases, so a dead worker leaves discovery fast.
           "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn"]
    return cmd, f"{client}/health", data


def job_secret(manifest: Manifest, name: str) -> str:
    """A per-job secret, generated at job start: 0600 in the run directory's 0700 secrets/ (never on a command
    line, never in job.sbatch)."""
    path = Path(manifest.run_dir) / "secrets" / name
    path.parent.mkdir(mode=0o700, exist_ok=True)
    if not path.exists():
        write_atomic(path, secrets.token_urlsafe(24), mode=0o600)  # replaces a planted link, never writes through
    return path.read_text().strip()


def enable_etcd_auth(manifest: Manifest, client_url: str) -> None:
    """etcd listens on the node's address: only the job's own processes (which can read its 0600 password) may
    use it. The root user gets the password on stdin (`--interactive=false`), then auth is switched on."""
    password = job_secret(manifest, "etcd.password")
    etcdctl = str(Path(etcd_binary()).with_name("etcdctl"))
    base = [etcdctl, f"--endpoints={client_url}", "--dial-timeout=5s"]
    for args, stdin in ((["user", "add", "root", "--interactive=false"], password + "\n"),
                        (["user", "grant-role", "root", "root"], None), (["auth", "enable"], None)):
        done = subprocess.run(base + args, input=stdin, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SystemExit(f"etcdctl {' '.join(args[:2])} failed: {done.stderr.strip() or done.stdout.strip()}")


def nats_command(manifest: Manifest, host: str) -> tuple[list[str], str, Path]:
    ports = manifest.plan.service("nats").ports
    token = job_secret(manifest, "nats.token")
    scratch = scratch_dir(manifest, "nats")
    config = scratch / "nats.conf"
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as handle:  # the token goes in a 0600 file, not on the command line
        handle.write(f'authorization {{ token: "{token}" }}\n')
    cmd = [nats_binary(), "-a", host, "-p", str(ports["client"]), "-m", str(ports["monitor"]), "-c", str(config)]
    return cmd, f"http://{host}:{ports['monitor']}/healthz", scratch


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    def healthy() -> bool | None:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with status {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return None

    try:
        wait_until(healthy, timeout, url)
    except TimeoutError:
        raise SystemExit(f"no healthy answer from {url} in {timeout:.0f} s") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc.runtime.services.infra")
    parser.add_argument("manifest")
    parser.add_argument("--service", choices=["etcd", "nats"], required=True)
    args = parser.parse_args(argv)
    manifest = Manifest.load(args.manifest)
    reporter = Reporter(manifest, args.service)
    reporter.phase("started")
    host = node_address(manifest)
    cmd, health, scratch = (etcd_command if args.service == "etcd" else nats_command)(manifest, host)
    try:
        return _run_server(manifest, reporter, args.service, host, cmd, health)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # etcd's data and NATS's config leave with the server


def _run_server(manifest: Manifest, reporter: Reporter, service: str, host: str, cmd: list[str],
                health: str) -> int:
    """Run the server; if it dies on its own, start it again (same data directory, same address: etcd keeps its
    keys, leases and users; NATS clients reconnect by themselves), up to `infra.max_restarts` times."""
    from hpc.runtime.services.supervise import supervise

    most = manifest.recipe.infra.max_restarts
    port = manifest.plan.service(service).ports["client"]
    url = f"http://{host}:{port}" if service == "etcd" else f"nats://{host}:{port}"

    def started(proc: subprocess.Popen, attempt: int) -> None:
        try:
            wait_healthy(health, proc)
            if service == "etcd" and attempt == 0:
                enable_etcd_auth(manifest, url)  # kept in etcd's data directory: a restart has it already
        except SystemExit as exc:
            proc.terminate()
            reporter.phase("failed", error=f"restart {attempt}: {exc}" if attempt else str(exc))
            raise
        if attempt == 0:
            publish_endpoint(manifest, service, Endpoint(host, port, url, health))
        reporter.phase("ready", address=f"{host}:{port}", server_pid=proc.pid, restarts=attempt)

    def after_failure(code: int, attempt: int) -> int | None:
        if attempt >= most:
            reporter.phase("stopped", exit_code=code)
            return code if code > 0 else 1
        print(f"hpc: {service} exited with status {code}; restart {attempt + 1} of {most}", file=sys.stderr,
              flush=True)
        return None

    code = supervise(lambda attempt: cmd, after_failure, started)
    if reporter.data["phase"] != "stopped":  # told to stop: the server ended with it
        reporter.phase("stopped", exit_code=0)
    return code


if __name__ == "__main__":
    sys.exit(main())
