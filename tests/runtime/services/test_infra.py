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
