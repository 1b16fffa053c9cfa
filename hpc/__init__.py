"""hpc: launch disaggregated LLM inference on Slurm clusters, and prove it works."""

__version__ = "0.1.0"
