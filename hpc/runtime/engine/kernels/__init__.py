"""Kernels of the torch engine and its models: Triton decode attention, the fused decode step, the peer all-reduce."""
