"""The models the torch engine runs (Llama, Mixtral's MoE) and the tiny random-weight ones hpc builds."""
