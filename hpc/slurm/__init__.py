"""The only place that runs Slurm commands, all through one injected Runner."""
