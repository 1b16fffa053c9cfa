"""Launch a rendered run: on this machine (local profile) or through Slurm."""
