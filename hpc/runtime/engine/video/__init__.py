"""Video diffusion on the reference engine (seed 004): a tiny random-weight video DiT, its pipeline and worker."""
