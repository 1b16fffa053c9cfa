"""What a checkpoint directory says (config.json), read by both halves: the launcher's checks and the runtime."""
