"""The torch reference engine: its scheduler and the parts of a step."""
