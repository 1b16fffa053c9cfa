"""etcd/NATS scratch space: private, unpredictable, and never through a planted link."""

from __future__ import annotations

import datetime as dt
import tempfile
from pathlib import Path

import pytest

from hpc.resolve import resolve
from hpc.runtime.services.infra import nats_command

pytestmark = pytest.mark.unit


def test_nats_config_goes_to_a_fresh_private_directory(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manifest = resolve("local", "tiny-agg").manifest(run_dir, "planted-run", dt.datetime(2026, 1, 1))
    target = tmp_path / "attacker"
    target.mkdir()
    planted = Path(tempfile.gettempdir()) / "hpc-planted-run"  # the path an older hpc used
    planted.unlink(missing_ok=True)
    planted.symlink_to(target)
    try:
        cmd, _, scratch = nats_command(manifest, "127.0.0.1")
        _, _, again = nats_command(manifest, "127.0.0.1")
    finally:
        planted.unlink()
    assert list(target.iterdir()) == []  # nothing written through the link
    assert scratch != again and scratch.stat().st_mode & 0o777 == 0o700
    config = Path(cmd[cmd.index("-c") + 1])
    assert config.parent == scratch and config.stat().st_mode & 0o777 == 0o600
    token = (run_dir / "secrets" / "nats.token").read_text().strip()
    assert token and token not in " ".join(cmd)  # the token is in the 0600 file, not on the command line


@pytest.mark.integration
def test_etcd_needs_the_jobs_password(tmp_path):
    """The etcd step enables auth before it publishes its endpoint: without the 0600 password, no access."""
    import asyncio
    import signal
    import subprocess
    import sys

    import aetcd

    from hpc.manifest import Manifest
    from hpc.runtime.services.discovery import open_discovery

    run_dir = tmp_path / "run"
    (run_dir / "state").mkdir(parents=True)
    manifest = resolve("local", "tiny-agg").manifest(run_dir, "auth-run", dt.datetime(2026, 1, 1))
    (run_dir / "manifest.json").write_text(manifest.model_dump_json())
    proc = subprocess.Popen([sys.executable, "-m", "hpc.runtime.services.infra", str(run_dir / "manifest.json"),
                             "--service", "etcd"])
    try:
        discovery = open_discovery(Manifest.load(run_dir / "manifest.json"), timeout=60)
        endpoint = (run_dir / "endpoints" / "etcd.json").read_text()
        password = run_dir / "secrets" / "etcd.password"
        assert password.stat().st_mode & 0o777 == 0o600 and discovery.password == password.read_text().strip()

        async def probe() -> tuple[str, bool]:
            anonymous = aetcd.Client(host=discovery.host, port=discovery.port, timeout=5)
            try:
                await anonymous.put(b"/x", b"1")
                refused = "accepted"
            except Exception as exc:  # aetcd raises its own error type for an auth failure
                refused = type(exc).__name__
            finally:
                await anonymous.close()
            client = await discovery._connect()
            await client.put(b"/hpc/ok", b"1")
            got = await client.get(b"/hpc/ok")
            await client.close()
            return refused, got.value == b"1"

        refused, authorised = asyncio.run(probe())
        assert refused not in ("accepted", "ConnectionTimeoutError") and authorised, (refused, endpoint)

        # etcd dies under the job: the step starts it again on the same data, users and keys included.
        import os
        import time

        from hpc.rundir import read_json

        # A worker registered under a lease, refreshing it from its own event loop, as a worker does.
        import threading

        from hpc.runtime.services.discovery import Instance

        worker = open_discovery(Manifest.load(run_dir / "manifest.json"), timeout=60)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever)
        thread.start()
        instance = Instance(role="prefill", index=0, instance_id="p0", host="127.0.0.1", rpc_port=1, http_port=2,
                            node="n0")
        asyncio.run_coroutine_threadsafe(worker.register(instance), loop).result(30)

        state = run_dir / "state" / "etcd.json"
        os.kill(read_json(state)["server_pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (read_json(state) or {}).get("restarts") != 1:
            time.sleep(0.1)
        assert read_json(state)["restarts"] == 1 and read_json(state)["phase"] == "ready"

        async def kept() -> bytes:
            client = await discovery._connect()
            got = await client.get(b"/hpc/ok")
            await client.close()
            return got.value

        discovery._client = None
        assert asyncio.run(kept()) == b"1"

        # The restarted etcd forgot every auth token. Refreshing a lease does not need one, granting a new lease
        # does: pause etcd past the lease's TTL, and the worker must register again through a fresh, authenticated
        # connection (with the stale token every grant failed and the worker left routing for good).
        server = read_json(state)["server_pid"]
        os.kill(server, signal.SIGSTOP)
        time.sleep(3.0)
        os.kill(server, signal.SIGCONT)
        time.sleep(4.0)

        async def registered() -> list[str]:
            discovery._client = None
            found = sorted(await discovery.snapshot())
            await discovery.close()
            return found
        try:
            assert asyncio.run(registered()) == ["prefill/0"]
        finally:
            asyncio.run_coroutine_threadsafe(worker.close(), loop).result(30)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            loop.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
