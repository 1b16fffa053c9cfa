"""TensorRT-LLM engine arguments: the offline field check and the one precedence function."""
