"""The `hpc` command line."""
