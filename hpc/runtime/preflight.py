"""Preflight, the job's first step: inside each node's container, check that everything the job's components
import is there, before any server starts. One line on success, one line naming the problem and the fix on
failure (exit 3), written to the step's log, which `hpc launch` and `hpc status` show.

    python3 -m hpc.runtime.preflight RUN_DIR/manifest.json
"""

from __future__ import annotations

import importlib
import socket
import sys

EXIT_FAILED = 3


def required_modules(manifest) -> list[tuple[str, str]]:
    """(module, why) for this job, in the order a missing one is reported."""
    need = [("pydantic", "the manifest"), ("yaml", "engine configs"), ("aetcd", "etcd discovery"),
            ("nats", "the event plane")]
    backend = manifest.recipe.backend.value
    if backend == "torch":
        need += [("torch", "the torch engine"), ("transformers", "the tokenizer"), ("safetensors", "the weights")]
    elif backend == "trtllm":
        need += [("tensorrt_llm", "TensorRT-LLM workers"), ("transformers", "the tokenizer")]
    return need


def _binaries(manifest) -> str | None:
    """The servers' executables (etcd, nats-server): the first one missing, as an error line part."""
    from hpc.runtime import infra

    wanted = [(manifest.recipe.infra.etcd, infra.etcd_binary), (manifest.recipe.infra.nats, infra.nats_binary)]
    for enabled, find in wanted:
        if enabled:
            try:
                find()
            except SystemExit as exc:
                return str(exc)
    return None


def check(manifest) -> tuple[bool, str]:
    container = manifest.cluster.container
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    node = socket.gethostname()
    if container is not None and here != container.python_version:
        return False, (f"hpc preflight on {node}: the image runs Python {here} but hpc's runtime was built for "
                       f"{container.python_version}; set container.python_version: \"{here}\" in the cluster profile")
    versions = {}
    for module, why in required_modules(manifest):
        try:
            mod = importlib.import_module(module)
        except Exception as exc:  # ImportError, or a broken install raising anything
            return False, (f"hpc preflight on {node}: {module} cannot be imported in the image ({why} needs it): "
                           f"{type(exc).__name__}: {exc}; use an image that has it")
        versions[module] = getattr(mod, "__version__", "?")
    missing = _binaries(manifest)
    if missing:
        return False, f"hpc preflight on {node}: {missing}"
    shown = " ".join(f"{k}={v}" for k, v in versions.items() if k in ("torch", "tensorrt_llm", "pydantic"))
    return True, f"hpc preflight on {node}: ok (Python {here} {shown})".rstrip()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpc.runtime.preflight MANIFEST", file=sys.stderr)
        return 2
    try:
        from hpc.resolve import Manifest

        manifest = Manifest.load(args[0])
    except Exception as exc:
        print(f"hpc preflight on {socket.gethostname()}: hpc's runtime does not load in this image "
              f"({type(exc).__name__}: {exc}); check the image's Python and the mounted runtime", flush=True)
        return EXIT_FAILED
    ok, line = check(manifest)
    print(line, flush=True)
    return 0 if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
