"""Draws docs/architecture.png: the launcher and the runtime, the manifest between them, a job's processes and a
request's path. `python docs/architecture.py` (matplotlib)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BOXES = {  # name: (x, y, w, h, label, colour)
    "inputs": (0.3, 7.6, 3.0, 1.0, "clusters/*.yaml\nrecipes/*.yaml\nengine_configs/*.yaml", "#eef"),
    "launcher": (0.3, 5.2, 3.0, 1.8, "launcher (login node)\nspec → engine_args → resolve\n→ plan → render → launch", "#dde"),
    "rundir": (0.3, 2.9, 3.0, 1.6, "run directory\nmanifest.json  job.sbatch\nstate/  endpoints/  logs/", "#ffd"),
    "slurm": (4.2, 2.9, 2.4, 1.6, "Slurm\nsbatch, srun --mpi=pmix\n(pyxis containers)", "#eee"),
    "preflight": (4.2, 5.6, 2.4, 1.0, "preflight (each node)\nsoftware, model, TRT-LLM version", "#efe"),
    "infra": (4.2, 7.4, 2.4, 1.2, "etcd (discovery)\nNATS (KV events, stats)", "#efe"),
    "frontend": (7.4, 7.4, 2.8, 1.2, "frontend\nOpenAI HTTP, tokenizer, router", "#fee"),
    "prefill": (7.4, 5.2, 2.8, 1.2, "prefill worker\nRPC, engine (own process on GPU)", "#fee"),
    "decode": (7.4, 2.9, 2.8, 1.2, "decode worker\nRPC, engine (own process on GPU)", "#fee"),
    "client": (10.9, 7.4, 1.8, 1.2, "client\n(openai, curl,\nhpc bench)", "#eef"),
}
ARROWS = [  # (from, to, label, curvature, label offset)
    ("inputs", "launcher", "read, check", 0.08, (0.0, 0.0)), ("launcher", "rundir", "write", 0.08, (-0.4, 0.0)),
    ("launcher", "slurm", "submit", 0.08, (0.45, 0.25)), ("slurm", "preflight", "first step", 0.08, (-0.45, 0.0)),
    ("slurm", "infra", "", 0.08, (0, 0)), ("rundir", "preflight", "manifest", 0.08, (-0.6, -0.35)),
    ("client", "frontend", "request", 0.08, (0, 0)), ("frontend", "prefill", "1: prefill", 0.08, (-0.45, 0)),
    ("prefill", "frontend", "", 0.08, (0, 0)),
    ("frontend", "decode", "2: decode from its KV", -0.55, (2.05, 0.0)),
    ("decode", "prefill", "KV: CUDA IPC / NIXL / bytes", 0.08, (0.0, 0.0)),
    ("prefill", "infra", "register, KV events", 0.08, (-0.35, -0.3)), ("infra", "frontend", "watch, index", 0.08, (0, 0.1)),
]


def centre(name):
    x, y, w, h, _, _ = BOXES[name]
    return x + w / 2, y + h / 2


def main() -> None:
    fig, ax = plt.subplots(figsize=(13, 9))
    for x, y, w, h, label, colour in BOXES.values():
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.08", fc=colour, ec="#333"))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=9)
    for a, b, label, rad, (dx, dy) in ARROWS:
        (x1, y1), (x2, y2) = centre(a), centre(b)
        ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), arrowstyle="-|>", mutation_scale=12, color="#555",
                                     shrinkA=38, shrinkB=38, connectionstyle=f"arc3,rad={rad}"))
        if label:
            ax.text((x1 + x2) / 2 + dx, (y1 + y2) / 2 + 0.12 + dy, label, fontsize=7.5, color="#224", ha="center")
    ax.text(0.3, 9.2, "the launcher half", fontsize=11, weight="bold")
    ax.text(4.2, 9.2, "the job: services and workers, every step reading only manifest.json", fontsize=11,
            weight="bold")
    ax.set_xlim(0, 13)
    ax.set_ylim(2.4, 9.6)
    ax.axis("off")
    out = Path(__file__).with_name("architecture.png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
