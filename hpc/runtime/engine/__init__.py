"""Engines behind one interface shaped like TensorRT-LLM's LLM API."""
