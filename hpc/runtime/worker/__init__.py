"""A worker: one engine in one disaggregation mode, serving the request plane."""
