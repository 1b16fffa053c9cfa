"""Preflight, the job's first step: inside each node's container (a job without one: on its batch node), check
that everything the job's components import, and the model's directories, are there before any server starts.
One line on success, one line naming the problem and the fix on failure (exit 3), written to the step's log,
which `hpc launch` and `hpc status` show. Its first task then records the job in the run directory
(hpc.checks.jobstart), before any server starts.

    python3 -m hpc.checks.preflight RUN_DIR/manifest.json
"""

from __future__ import annotations

import importlib.metadata
import json
import importlib.util
import shutil
import socket
import sys
import time
from pathlib import Path

EXIT_FAILED = 3


def required_modules(manifest: dict) -> list[tuple[str, str]]:
    """(module, why) for this job, in the order a missing one is reported."""
    need = [("hpc", "every component"), ("pydantic", "the manifest"), ("yaml", "engine configs"),
            ("aetcd", "etcd discovery"), ("nats", "the event plane"), ("httptools", "the HTTP servers"),
            ("msgspec", "the worker wire protocol")]
    backend = manifest["recipe"]["backend"]
    if backend == "torch":
        need += [("torch", "the torch engine"), ("transformers", "the tokenizer"), ("safetensors", "the weights")]
    elif backend == "trtllm":
        need += [("tensorrt_llm", "a TensorRT-LLM worker"), ("transformers", "the tokenizer")]
    return need


DISTRIBUTIONS = {"yaml": "PyYAML", "nats": "nats-py", "tensorrt_llm": "tensorrt-llm"}


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return "?"


def _binaries(manifest) -> str | None:
    """The servers' executables (etcd, nats-server): the first one missing, as an error line part."""
    from hpc.runtime.services import binaries

    services = manifest["recipe"].get("infra") or {}
    wanted = [(services.get("etcd", True), binaries.etcd_binary), (services.get("nats", True), binaries.nats_binary)]
    for enabled, find in wanted:
        if enabled:
            try:
                find()
            except SystemExit as exc:
                return str(exc)
    return None


def _launcher(manifest: dict) -> str | None:
    """TensorRT-LLM workers of several ranks start under its launcher (hpc.render.sbatch.mpi_launcher's rule, read
    from the manifest's JSON: preflight runs before pydantic, which Manifest needs, is known to be there): is it
    here?"""
    several = [w for w in manifest["plan"]["workers"] if w["tasks"] > 1]
    if manifest["recipe"]["backend"] != "trtllm" or not several or manifest["cluster"].get("scheduler") == "local":
        return None
    if shutil.which("trtllm-llmapi-launch"):
        return None
    return (f"trtllm-llmapi-launch is not on PATH ({several[0]['role']}-{several[0]['index']} has "
            f"{several[0]['tasks']} ranks, which start under it); use an image with TensorRT-LLM's launcher")


def installed_trtllm_version() -> str | None:
    """The image's TensorRT-LLM version, without importing the package (its __init__ loads torch and the
    bindings: seconds per node): the distribution's metadata, else its tensorrt_llm/version.py run on its own."""
    found = _version("tensorrt_llm")
    if found != "?":
        return found
    spec = importlib.util.find_spec("tensorrt_llm")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "version.py"
        if path.is_file():
            module_spec = importlib.util.spec_from_file_location("_hpc_trtllm_version", path)
            if module_spec is None or module_spec.loader is None:
                return None
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
            return str(getattr(module, "__version__", "")) or None
    return None


def trtllm_version_problem(manifest: dict) -> str | None:
    """The image holds another TensorRT-LLM than the one `hpc validate` checked the engine configs against: the
    job ends here, before any server starts, instead of failing on a key or a field after loading weights."""
    expected = manifest.get("trtllm_versions") or []
    if manifest["recipe"]["backend"] != "trtllm" or not expected:
        return None
    found = installed_trtllm_version()
    if found is not None and found.split("+", 1)[0] in expected:
        return None
    container = manifest["cluster"].get("container") or {}
    where = f"the image {container['image']}" if container.get("image") else "the nodes' Python environment"
    how = ("the profile's trtllm_version" if manifest["cluster"].get("trtllm_version")
           else "what hpc knows of the image's tag (hpc/data/trtllm-versions.json)")
    return (f"{where} holds TensorRT-LLM {found or '(no version found)'}, but the job was validated "
            f"against {' or '.join(expected)} ({how}); set trtllm_version: "
            f"\"{(found or '?').split('+', 1)[0]}\" in the cluster "
            f"profile and validate again, or use an image with {expected[-1]}")


def model_problem(manifest: dict) -> str | None:
    """The model's directories as this node sees them (inside its container: after the mounts). A path that is
    not there fails here, in one line, instead of in a worker's traceback after etcd, NATS and the frontend
    started. A hub id (no leading /, ~ or .) is the engine's to fetch, and a model the job builds is not there yet."""
    model = manifest["recipe"]["model"]
    wanted = [] if model.get("generate") else [(model.get(f), f"recipe model.{f}") for f in ("path", "tokenizer")]
    for role, args in sorted((manifest.get("engine_args") or {}).items()):  # an Eagle/MTP draft model's weights
        draft = (args or {}).get("speculative_config") or {}
        wanted += [(draft.get(key), f"the {role} engine config's speculative_config.{key}")
                   for key in ("speculative_model", "speculative_model_dir")]
    fix = ("mount it (the cluster profile's container.mounts)" if manifest["cluster"].get("container")
           else "build or copy it there" if manifest["cluster"].get("scheduler") == "local"
           else "put it on a filesystem every node mounts")
    from hpc.model.fit import is_local_path

    for value, named in wanted:
        if not is_local_path(value):
            continue
        path = Path(value).expanduser()
        if not path.is_dir():
            return f"the model directory {value} ({named}) is not there; {fix}, or fix the path"
        video = manifest["recipe"].get("modality") == "video_diffusion"
        marker = "model_index.json" if video else "config.json"
        if named == "recipe model.path" and not (path / marker).is_file():  # a diffusers pipeline has no config
            return f"{value} (recipe model.path) has no {marker}: give the model's Hugging Face directory"
        tokenizer_named = "recipe model.tokenizer" if model.get("tokenizer") else "recipe model.path"
        if named == tokenizer_named and not video and not (path / "tokenizer.json").is_file():
            return (f"{value} ({named}) has no tokenizer.json, the fast tokenizer's file that hpc's frontend reads; "
                    f"write it with transformers (AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)) or set "
                    f"recipe model.tokenizer to a directory that has it")
    return _layout_problem(manifest)


def _layout_problem(manifest: dict) -> str | None:
    """A role's TP, PP or EP that the model's shape cannot take (hpc.model.fit), as its engine would fail
    on it only after loading weights. `hpc validate` checks the same where the login node sees the model."""
    from hpc.model.fit import encode_problem, fit_problems, read_model_config

    model = manifest["recipe"]["model"]
    config = None if model.get("generate") else read_model_config(model.get("path"))
    if config is None:
        return None
    encode = manifest["recipe"]["roles"].get("encode") or {}
    split = encode_problem(config, manifest["recipe"]["backend"]) if encode else None
    if split:
        return f"roles.encode: {split[0]} ({model['path']}/config.json); {split[1]}"
    vision = {"encode"} | {pool["name"] for pool in encode.get("pools") or []}  # not the language model's heads
    for role, args in sorted((manifest.get("engine_args") or {}).items()):
        if role in vision:
            continue
        for key, problem, fix in fit_problems(config, args or {}, manifest["recipe"]["backend"]):
            return f"{role}: {key}: {problem} ({model['path']}/config.json); {fix}"
    return None


def check(manifest: dict) -> tuple[bool, str]:
    """`manifest` as plain JSON: the check must not need the packages it checks for."""
    container = manifest["cluster"].get("container") or {}
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    node = socket.gethostname()
    wanted = container.get("python_version")
    if wanted and here != wanted:
        return False, (f"hpc preflight on {node}: the image runs Python {here} but hpc's runtime was built for "
                       f"{wanted}; set container.python_version: \"{here}\" in the cluster profile")
    versions = {}
    for module, why in required_modules(manifest):
        # Found, not imported: importing torch or tensorrt_llm here would cost the job seconds per node; the
        # components import them moments later and report a broken install themselves.
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            return False, (f"hpc preflight on {node}: {module} is not installed in the image ({why} needs it); "
                           "use an image that has it")
        versions[module] = _version(module)
    missing = trtllm_version_problem(manifest) or _binaries(manifest) or _launcher(manifest) or \
        model_problem(manifest)
    if missing:
        return False, f"hpc preflight on {node}: {missing}"
    shown = " ".join(f"{k}={v}" for k, v in versions.items() if k in ("torch", "tensorrt_llm", "pydantic"))
    return True, f"hpc preflight on {node}: ok (Python {here} {shown})".rstrip()


def _with_hardware(manifest: dict, ok: bool, line: str, t0: float) -> tuple[bool, str]:
    """The hardware and fabric checks (hpc.checks.node_health) after the software ones: each failure one line
    (the last is what the script and hpc launch show); their figures join the node's ok line."""
    from hpc.checks.node_health import run_checks

    found, _ = run_checks(manifest, ok, line, t0)
    failed = [f for f in found if not f.ok]
    if not ok:
        return ok, line
    node = socket.gethostname()
    for finding in failed[:-1]:
        print(f"hpc preflight on {node}: {finding.line()}", flush=True)
    if failed:
        return False, f"hpc preflight on {node}: {failed[-1].line()}"
    figures = "; ".join(f"{f.check} {f.figure}" for f in found)
    return True, line[:-1] + (f"; {figures})" if figures else ")")


def main(argv: list[str] | None = None) -> int:
    t0 = time.monotonic()
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hpc.checks.preflight MANIFEST", file=sys.stderr)
        return 2
    try:
        with open(args[0], encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"hpc preflight on {socket.gethostname()}: cannot read the manifest ({exc}); is the run directory "
              "mounted in the container?", flush=True)
        return EXIT_FAILED
    ok, line = check(manifest)
    if manifest["cluster"]["preflight"]["hardware"]:
        ok, line = _with_hardware(manifest, ok, line, t0)
    print(line, flush=True)
    from hpc.checks.node_health import job_node

    if ok and job_node().first:
        # the job's first step as well (hpc.checks.jobstart), here where a container is up already
        from hpc.checks.jobstart import start_job

        print(start_job(args[0]), flush=True)
    return 0 if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
