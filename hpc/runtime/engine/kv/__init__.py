"""A KV cache leaving its engine: packed bytes, CUDA IPC, NIXL."""
