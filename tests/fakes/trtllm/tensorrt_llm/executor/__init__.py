from .result import CompletionOutput, GenerationResult, IterationResult  # noqa: F401
