"""The serving runtime: engines, workers, frontend, infrastructure (installed with the `serve` extra)."""
