"""`hpc profile`: SLA-driven sizing (seed 000's profiler): sweep warm engines of several TP sizes in one
allocation, pick the smallest deployment that meets the TTFT and ITL targets, emit it as a recipe."""
