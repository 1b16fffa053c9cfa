"""OpenAI request models and response/error shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpc.runtime.serve.http import Response, json_response


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> Response:
        return json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                        "code": self.code or self.status}}, self.status)


# OpenAI parameters this server does not implement yet. Asking for their effect is a 400 naming the parameter
# (a client that silently got one answer instead of n, or no logprobs, would be misled); sending the default
# value is accepted, since many clients send every field.
UNSUPPORTED: dict[str, Any] = {
    "n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1),
    "logprobs": lambda v: v not in (None, False, 0), "top_logprobs": lambda v: v not in (None, 0),
    "echo": lambda v: v not in (None, False), "suffix": lambda v: v not in (None, ""),
    "tools": lambda v: bool(v), "tool_choice": lambda v: v not in (None, "none", "auto"),
    "functions": lambda v: bool(v), "function_call": lambda v: v not in (None, "none", "auto"),
    "logit_bias": lambda v: bool(v),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") not in (None, "text"),
}


def unsupported_param(data: dict[str, Any]) -> str | None:
    """The first parameter of `data` that asks for something this server does not do."""
    for name, asks_for_it in UNSUPPORTED.items():
        if name in data and asks_for_it(data[name]):
            return name
    return None


class _Request(BaseModel):
    # Clients send many optional OpenAI fields; those without an effect here (user, metadata, ...) are ignored,
    # and those whose effect is not implemented are refused before validation (see UNSUPPORTED).
    model_config = ConfigDict(extra="ignore")

    model: str
    # Bounded here so that nothing out of an engine's range (a seed of 2**70 used to kill the scheduler thread)
    # gets past the frontend; NaN/inf are refused by the bounds.
    max_tokens: int | None = Field(None, ge=1, le=10_000_000)
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    stream_options: dict[str, Any] | None = None

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int]

    @field_validator("prompt")
    @classmethod
    def _single(cls, value: Any) -> Any:
        if isinstance(value, list) and value and isinstance(value[0], str):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        return value


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=10_000_000)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
