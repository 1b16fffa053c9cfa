"""`hpc cluster new`: a cluster profile from what the cluster says about itself (hpc.slurm.probe), with a comment
on each value saying where it came from and what to check.

    hpc cluster new mycluster -p batch -A my-account --image /lustre/images/trtllm.sqsh \\
        --mount /lustre/models:/models:ro --runs-dir /lustre/fsw/me/runs --out clusters/mycluster.yaml

The profile is validated as `hpc validate` loads it before anything is printed or written; --out never
overwrites a file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import yaml

from hpc.errors import UserError
from hpc.slurm.probe import ClusterFacts

SERVING_HOURS = "04:00:00"  # a job's time limit when the partition has none


def add_parsers(sub) -> None:
    p = sub.add_parser("cluster", help="make a cluster profile (see: hpc cluster new -h)")
    verbs = p.add_subparsers(dest="verb", required=True)
    n = verbs.add_parser("new", help="a cluster profile from sinfo, srun and scontrol, run here (a login node)")
    n.add_argument("name", type=_profile_name, help="the profile's name (hpc launch -c NAME once it is in clusters/)")
    n.add_argument("--partition", "-p", required=True)
    n.add_argument("--account", "-A")
    n.add_argument("--qos")
    n.add_argument("--image", help="a pyxis container image (a squashfs path or a registry reference)")
    n.add_argument("--mount", action="append", default=[], metavar="SRC:DST[:FLAGS]",
                   help="a container mount (repeatable): models, the shared filesystem")
    n.add_argument("--runs-dir", help="where run directories go: a path every node mounts")
    n.add_argument("--out", help="write the profile here (never over an existing file); default: print it")
    n.set_defaults(func=new)


def _profile_name(text: str) -> str:
    """As recipes' names: it becomes a file name in clusters/ and a field of every run."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", text):
        raise argparse.ArgumentTypeError(
            f"{text[:64]!r} is not a profile name: letters, digits and . _ - (at most 64), starting with a letter "
            "or digit")
    return text


def new(args: argparse.Namespace) -> int:
    from hpc.slurm.probe import probe
    from hpc.slurm.runner import LocalRunner
    from hpc.spec.base import parse_model
    from hpc.spec.cluster import ClusterProfile

    out = Path(args.out) if args.out else None
    if out is not None:
        _check_out(out)
    if args.image or args.mount:  # the user's own strings, before asking Slurm anything
        from hpc.spec.cluster import ContainerOnly

        parse_model(ContainerOnly, {"container": {"image": args.image or "-", "mounts": args.mount}},
                    file="--image/--mount")
    facts = probe(LocalRunner(), args.partition)
    if args.image and not facts.pyxis:
        raise UserError("this cluster's srun has no --container-image (pyxis is not installed)", field="--image",
                        hint="leave --image out: the job then runs on the nodes' own Python")
    text = profile_text(args, facts)
    parse_model(ClusterProfile, yaml.safe_load(text), file=str(out or "the new profile"))
    if out is None:
        print(text, end="")
    else:
        _write_new(out, text)
        print(f"wrote {out}; check it with: hpc validate -c {out} -r tiny-agg")
    return 0


def _check_out(out: Path) -> None:
    """Before probing: a path that can be a new file in a directory that exists."""
    from hpc.rundir import shown

    if len(str(out)) > 4096 or len(out.name) > 255:
        raise UserError(f"--out {shown(str(out))} is too long for a path", field="--out", hint="a shorter path")
    if out.is_symlink() or out.exists():
        raise UserError(f"{shown(str(out))} exists; hpc cluster new does not overwrite (nor write through a link)",
                        field="--out", hint="pick another path, or remove it first")
    if not out.parent.is_dir():
        raise UserError(f"{shown(str(out.parent))} is not a directory", field="--out",
                        hint="make the directory first, or write the profile elsewhere")


def _write_new(out: Path, text: str) -> None:
    """A new file or nothing: O_EXCL refuses anything already there, O_NOFOLLOW a link put there meanwhile."""
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise UserError(f"cannot create {out}: {exc.strerror or exc}", field="--out",
                        hint="pick another path") from None
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def _q(value: object) -> str:
    return json.dumps(value)  # a YAML scalar that keeps spaces, colons and quotes as they are


def _trtllm_line(image: str | None) -> str:
    """The image's TensorRT-LLM version where hpc knows its tag (validate checks engine configs against it, the
    preflight holds the job to it); otherwise a commented line to fill in."""
    from hpc.engine_args.trtllm_versions import versions_of_image

    known = versions_of_image(image) if image else ()
    if len(known) == 1:
        return f"trtllm_version: {known[0]}  # the TensorRT-LLM the image's tag ships (hpc/data/trtllm-versions.json)"
    spans = f" (its tag ships one of {', '.join(known)})" if known else ""
    return (f"# trtllm_version: X.Y.Z  # the nodes' TensorRT-LLM{spans}: validate checks against it, the job holds "
            "to it")


def profile_text(args: argparse.Namespace, facts: ClusterFacts) -> str:
    """The profile as YAML, a comment on each probed value."""
    part = facts.partition
    lines = ["# Made by `hpc cluster new` from sinfo, srun and scontrol on the login node; check every line.",
             f"name: {_q(args.name)}",
             f"description: {_q(f'partition {part.partition}: {part.nodes} nodes, {part.gpus_per_node} GPUs each')}",
             f"partition: {_q(part.partition)}"]
    if args.account:
        lines.append(f"account: {_q(args.account)}")
    if args.qos:
        lines.append(f"qos: {_q(args.qos)}")
    limit = part.max_time or SERVING_HOURS
    lines.append(f"time_limit: {_q(limit)}  # " + ("the partition's MaxTime: serving jobs run as long as allowed"
                                                   if part.max_time else "the partition has no MaxTime"))
    if part.max_time:
        lines.append(f"max_time_limit: {_q(part.max_time)}")
    shapes = f"; the partition has {part.node_kinds} node shapes, this is the most numerous" \
        if part.node_kinds > 1 else ""
    lines += [f"nodes_available: {part.nodes}  # sinfo{shapes}",
              f"gpus_per_node: {part.gpus_per_node}  # sinfo's generic resources (gpu)",
              f"cpus_per_node: {part.cpus_per_node}",
              f"gpu_request: {'gres' if part.gpus_per_node else 'none'}"
              + ("  # --gres=gpu:N; --gpus-per-node also works here (select/cons_tres): gpu_request: gpus-per-node"
                 if part.gpus_per_node and facts.select_type.endswith("cons_tres") else ""),
              "# exclusive: true  # whole nodes for each job (most GPU partitions want it); then memory: \"0\""]
    mpi = next((m for m in ("pmix", "pmi2") if m in facts.mpi_plugins), None)
    lines.append(f"mpi: {mpi or 'none'}  # srun --mpi=list offers: {', '.join(facts.mpi_plugins) or 'nothing'}"
                 + ("" if mpi == "pmix" else "; TensorRT-LLM and the torch engine's ranks want pmix"))
    if args.image:
        lines += ["container:  # pyxis: srun has --container-image",
                  f"  image: {_q(args.image)}",
                  f"  mounts: {_q(args.mount)}",
                  "  python_version: \"3.12\"  # the image's Python: hpc's runtime is built for it (preflight checks)"]
    elif facts.pyxis:
        lines.append("# container: {image: ..., mounts: [...]}  # pyxis is installed: srun has --container-image")
    lines.append(_trtllm_line(args.image))
    if args.runs_dir:
        lines.append(f"runs_dir: {_q(args.runs_dir)}")
    else:
        lines.append("# runs_dir: /shared/path/runs  # run directories must be where every node sees them")
    lines += ["# network: {interface: ib0}  # the interface servers bind to (default: the node name's address)",
              "discovery: etcd"]
    return "\n".join(lines) + "\n"
