"""Upstream: tensorrt_llm/executor/utils.py — `RequestError(RuntimeError)`, "the error raised when the request is
failed": a per-request error (a response's error_msg), which leaves the executor serving."""


class RequestError(RuntimeError):
    pass
