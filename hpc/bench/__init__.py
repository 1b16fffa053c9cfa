"""Load generation against OpenAI-compatible endpoints (hpc bench) and its HTTP client."""
