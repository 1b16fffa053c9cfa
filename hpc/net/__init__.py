"""The HTTP clients both halves use: the load generator and the frontend group (keep-alive, async)."""
