"""The OpenAI-compatible frontend: tokenize, route, orchestrate prefill -> decode, stream back."""
