"""OpenAI request models and response/error shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, NamedTuple, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hpc.runtime.frontend.router import NoInstance
from hpc.runtime.serve.http import Response, json_response
from hpc.runtime.serve.rpc import RemoteError


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.request_id: str | None = None  # the failed request's id, once it had one
        self.retry_after_s: int | None = None  # when trying again soon may well succeed (clients honour it)

    def response(self) -> Response:
        response = json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code or self.status}}, self.status)
        if self.request_id:
            response.headers[REQUEST_ID_HEADER] = self.request_id
        if self.retry_after_s is not None:
            response.headers["retry-after"] = str(self.retry_after_s)
        return response


# Each answer's id (the response's "id"), also on failures: what a user quotes to find the request in the
# frontend's log.
REQUEST_ID_HEADER = "x-request-id"


# OpenAI parameters this server does not implement yet. Asking for their effect is a 400 naming the parameter
# (a client that silently got one answer instead of n, or no logprobs, would be misled); sending the default
# value is accepted, since many clients send every field.
UNSUPPORTED: dict[str, Any] = {
    "best_of": lambda v: v not in (None, 1),
    "suffix": lambda v: v not in (None, ""),
    "modalities": lambda v: v not in (None, ["text"]), "audio": lambda v: v is not None,
    "prediction": lambda v: v is not None, "web_search_options": lambda v: v is not None,
    "parallel_tool_calls": lambda v: v is False,  # one call at most cannot be enforced without constrained decoding
    "store": lambda v: bool(v),  # nothing is stored here
    "functions": lambda v: bool(v), "function_call": lambda v: v not in (None, "none", "auto"),
    "logit_bias": lambda v: bool(v),
    # json_object is constrained decoding (the engine's guide); a JSON schema is not enforced here
    "response_format": lambda v: not (v is None or isinstance(v, dict) and v.get("type") in (None, "text",
                                                                                           "json_object")),
}


def _forced_tool(v: Any) -> bool:
    """tool_choice "required" or {"type": "function", "function": {"name": ...}}: a call the engine must make."""
    return v == "required" or (isinstance(v, dict) and v.get("type") == "function"
                               and isinstance(v.get("function"), dict) and isinstance(v["function"].get("name"), str))


# Tools need the recipe's tool-call parser; with one, a call can be forced (constrained decoding in its format).
TOOLS_WITHOUT_PARSER = {"tools": lambda v: bool(v), "tool_choice": lambda v: v not in (None, "none", "auto")}
TOOLS_WITH_PARSER = {"tool_choice": lambda v: v not in (None, "none", "auto") and not _forced_tool(v)}
# for a chat template to read (ChatRequest); a completion has none
TEMPLATE_ONLY = {"reasoning_effort": lambda v: v is not None, "chat_template_kwargs": lambda v: bool(v)}


# OpenAI fields that describe the caller, not the answer: accepted, and they change nothing here
DESCRIBES_THE_CALLER = frozenset({"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})


def unknown_param(data: dict[str, Any], model: type[BaseModel]) -> tuple[str, str | None] | None:
    """(the first field of `data` that is neither OpenAI's nor one of hpc's extensions, the closest known one), as
    OpenAI answers an unrecognized argument: a typo'd max_tokenz must not silently get the default length."""
    import difflib

    known = set(model.model_fields) | set(UNSUPPORTED) | set(TOOLS_WITHOUT_PARSER) | set(TEMPLATE_ONLY) | \
        DESCRIBES_THE_CALLER
    for name in data:
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.75)
            return str(name), close[0] if close else None
    return None


# The step of a validation error's location that names a union's member (pydantic's tags), not a field
_MEMBER_TAGS = ("str", "int", "float", "bool", "dict", "list", "none")


def _member_tag(part: Any) -> bool:
    return isinstance(part, str) and (part in _MEMBER_TAGS or "[" in part or part[:1].isupper()
                                      or part.startswith(("function-", "is-instance", "json-or-python")))


def field_error(errors: list[Any]) -> tuple[str, str]:
    """(param, message) for pydantic's errors: the field as the client wrote it. Where a field may take several
    forms (prompt: a string, strings, token ids or arrays of them), pydantic reports each form's failure under a
    tag of its own ("prompt.str"): the param is the field, and the message says why each form did not fit."""
    loc = list(errors[0]["loc"])
    tag = next((i for i, part in enumerate(loc) if _member_tag(part)), None)
    if tag is None:
        param = ".".join(str(p) for p in loc)
        return param, f"{param}: {errors[0]['msg']}"
    prefix = loc[:tag]
    param = ".".join(str(p) for p in prefix)
    forms: dict[str, str] = {}
    for err in errors:
        where = list(err["loc"])
        if where[:tag] == prefix and len(where) > tag and _member_tag(where[tag]):
            rest = ".".join(str(p) for p in where[tag + 1:] if not _member_tag(p))
            forms.setdefault(str(where[tag]), f"{rest + ': ' if rest else ''}{err['msg']}")
    listed = "; ".join(f"as {form}, {why}" for form, why in list(forms.items())[:4])
    return param, f"{param}: fits none of its forms ({listed})"


def check_fields(data: dict[str, Any], model: type[BaseModel], tool_parser: bool) -> None:
    """A 400 for a field nobody knows, or one asking for what this server does not do (before validation)."""
    unknown = unknown_param(data, model)
    if unknown is not None:
        name, close = unknown
        raise ApiError(400, f"Unrecognized request argument supplied: {name[:64]!r}"
                            + (f" (did you mean '{close}'?)" if close else ""), param=name[:64],
                       code="unknown_parameter")
    unsupported = unsupported_param(data, tool_parser=tool_parser, chat=model is ChatRequest)
    if unsupported is not None:
        raise ApiError(400, f"'{unsupported}' = {str(data[unsupported])[:80]} is not supported by this server",
                       param=unsupported, code="unsupported_parameter")


def unsupported_param(data: dict[str, Any], tool_parser: bool = False, chat: bool = True) -> str | None:
    """The first parameter of `data` that asks for something this server does not do."""
    refused = {**UNSUPPORTED, **(TOOLS_WITH_PARSER if tool_parser else TOOLS_WITHOUT_PARSER),
               **({} if chat else TEMPLATE_ONLY)}
    for name, asks_for_it in refused.items():
        if name in data and asks_for_it(data[name]):
            return name
    return None


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class SlaTargets(_Loose):
    """What a request asks of its latency, for the global router's grids (absent: the middle of the range)."""

    ttft_target: float | None = Field(default=None, ge=0, le=1e9)  # ms to the first token
    itl_target: float | None = Field(default=None, ge=0, le=1e9)  # ms between tokens


class AgentHints(_Loose):
    priority: int | None = Field(default=None, ge=-2**31, lt=2**31)


class NvExt(_Loose):
    """Dynamo's request extension: the router's SLA targets and the agent's hints."""

    router: SlaTargets | None = None
    agent_hints: AgentHints | None = None


class RouteHints(NamedTuple):
    ttft_ms: float | None = None
    itl_ms: float | None = None
    priority: int | None = None


class _StrictPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_StrictPart):
    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's: padding against length side channels; nothing to pad here
    continuous_usage_stats: bool = False  # vLLM's (GuideLLM asks for it): the usage so far in every chunk


class FunctionDefinition(_StrictPart):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = Field(default=None, max_length=65_536)
    parameters: dict[str, Any] | None = None  # a JSON Schema of an object (OpenAI's function parameters)
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return value
        if value.get("type", "object") != "object":
            raise ValueError(f"a function's parameters are a JSON Schema of an object (type 'object'), not "
                             f"{str(value.get('type'))[:40]!r}")
        properties, required = value.get("properties", {}), value.get("required", [])
        if not isinstance(properties, dict) or not all(isinstance(p, dict) for p in properties.values()):
            raise ValueError("parameters.properties must map each argument's name to its schema (an object)")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("parameters.required must be a list of argument names")
        return value


class Tool(_StrictPart):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_StrictPart):
    name: str = Field(max_length=64)


class NamedToolChoice(_StrictPart):
    type: Literal["function"]
    function: NamedFunction


MAX_STOPS = 32  # OpenAI takes 4; evaluation harnesses send more (lm-eval's "until" lists)
MAX_TOOLS = 128  # OpenAI's


class _Request(BaseModel):
    # Clients send many optional OpenAI fields; those without an effect here (user, metadata, ...) are ignored,
    # and those whose effect is not implemented are refused before validation (see UNSUPPORTED).
    # strict: "16" is not a max_tokens, true not a token id, "yes" not a stream (OpenAI refuses them too)
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    # Bounded here so that nothing out of an engine's range (a seed of 2**70 used to kill the scheduler thread)
    # gets past the frontend; NaN/inf are refused by the bounds.
    max_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)  # OpenAI's default: sampling, not greedy
    n: int = Field(default=1, ge=1, le=128)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # extension (vLLM, TensorRT-LLM): over the prompt's and the answer's tokens, > 1 discourages repeats
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=1_000_000)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stop: str | list[str] | None = None
    ignore_eos: bool = False  # extension (vLLM, TensorRT-LLM): EOS does not end the answer
    # extension (vLLM, TensorRT-LLM; AIPerf and MLPerf harnesses send it to pin output lengths): EOS and stop tokens
    # do not end the answer before this many tokens
    min_tokens: int = Field(default=0, ge=0, le=10_000_000)
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    extra_args: SlaTargets | None = None  # seed 003: {"ttft_target": ms, "itl_target": ms}
    nvext: NvExt | None = None  # Dynamo's spelling: nvext.router.{ttft,itl}_target, nvext.agent_hints.priority

    @property
    def route_hints(self) -> RouteHints:
        targets = [t for t in (self.extra_args, self.nvext and self.nvext.router) if t is not None]
        ttft = next((t.ttft_target for t in targets if t.ttft_target is not None), None)
        itl = next((t.itl_target for t in targets if t.itl_target is not None), None)
        hints = self.nvext.agent_hints if self.nvext else None
        return RouteHints(ttft, itl, hints.priority if hints else None)

    @property
    def json_object(self) -> bool:
        return bool(self.response_format and self.response_format.get("type") == "json_object")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"{len(stops)} stop sequences; at most {MAX_STOPS}")
        if any(not 1 <= len(stop) <= 4096 for stop in stops):
            raise ValueError("each stop sequence is 1 to 4096 characters")
        return value

    def problem(self) -> tuple[str, str] | None:
        """(field, why) for fields valid alone that do not go together, as OpenAI refuses them."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


MAX_CHOICES = 256  # prompts x n in one request: each is an engine request of its own


class CompletionRequest(_Request):
    # every form OpenAI documents: a string, an array of strings, an array of tokens, an array of token arrays
    prompt: str | list[str] | list[int] | list[list[int]]
    # 0 with echo: the prompt scored, nothing generated (the classic loglikelihood request, lm-eval's)
    max_tokens: int | None = Field(default=None, ge=0, le=10_000_000)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    def problem(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:  # 0 with echo: the prompt scored, nothing generated
            return "max_tokens", "max_tokens 0 generates nothing: it scores the prompt, with echo (and logprobs)"
        return super().problem()

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one each: its choices are indexed prompt by prompt, n to a prompt."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [cast("str | list[int]", p)]
        return list(cast("list[str] | list[list[int]]", p))

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: Any) -> Any:
        if isinstance(value, list) and (not value or any(isinstance(v, list) and not v for v in value)):
            raise ValueError("a prompt must not be empty")
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_CHOICES:
            raise ValueError(f"{len(value)} prompts in one request; at most {MAX_CHOICES}")
        return value


class ChatMessage(BaseModel):
    # OpenAI refuses a message field it does not know ("Additional properties are not allowed")
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool's answer
    name: str | None = None
    # an earlier answer's reasoning, sent back (vLLM's and DeepSeek's field; Qwen3's and DeepSeek-R1's templates
    # read it)
    reasoning_content: str | None = None
    # what OpenAI's own client sends back of an assistant turn; nothing here reads them
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=10_000_000)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # for the model's chat template: vLLM's, SGLang's and trtllm-serve's extension ({"enable_thinking": false}
    # for Qwen3), and OpenAI's reasoning_effort, which gpt-oss's template reads
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None

    def forced_tool_names(self) -> list[str] | None:
        """The functions the answer must call one of (tool_choice required / named), None when not forced."""
        if self.tool_choice in (None, "none", "auto"):
            return None
        offered = [t.function.name for t in self.tools or []]
        if self.tool_choice == "required":
            return sorted(set(offered))
        name = self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else ""
        if name not in offered:
            raise ValueError(f"tool_choice names function {name!r}, which is not among the tools offered")
        return [name]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template reads them (OpenAI's JSON), unless tool_choice is none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def problem(self) -> tuple[str, str] | None:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice", "tool_choice forces a call, which is only allowed when tools are given"
        return super().problem()

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# One position: the token's raw bytes, its logprob, and the (bytes, logprob) of the best tokens (None, None for
# a prompt's first token, which nothing precedes).
LogprobRow = tuple[bytes, float | None, list[tuple[bytes, float]] | None]


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


def chat_logprobs(rows: list[LogprobRow]) -> dict[str, Any]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]};
    `bytes` are the token's raw bytes (a token may hold half of a UTF-8 character)."""
    def one(raw: bytes, logprob: float | None) -> dict[str, Any]:
        return {"token": _text(raw), "logprob": logprob, "bytes": list(raw)}
    return {"content": [{**one(t, lp), "top_logprobs": [one(tt, tlp) for tt, tlp in top or ()]}
                        for t, lp, top in rows]}


def completion_logprobs(rows: list[LogprobRow], offset: int) -> dict[str, Any]:
    """The legacy completions shape: parallel lists, top_logprobs as {token: logprob} per position."""
    offsets, at = [], offset
    for raw, _, _ in rows:
        offsets.append(at)
        at += len(_text(raw))
    return {"tokens": [_text(t) for t, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [None if top is None else {_text(tt): tlp for tt, tlp in top} for _, _, top in rows],
            "text_offset": offsets}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def upstream_error(exc: Exception) -> ApiError:
    """The client's error for what the workers could not do: no live worker (503), a worker's refusal or
    failure."""
    if isinstance(exc, NoInstance):
        err = ApiError(503, str(exc), "service_unavailable")
        if not exc.draining:  # a worker starting again, or discovery catching up; not a job that is ending
            err.retry_after_s = 1
        return err
    if isinstance(exc, RemoteError):
        if exc.code == 400:
            return ApiError(400, str(exc))
        return ApiError(502 if exc.code >= 500 else exc.code, str(exc), "upstream_error")
    return ApiError(502, str(exc), "upstream_error")


def merged_completions(answers: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One text_completion for several prompts, as OpenAI answers an array of prompts: the choices of prompt i at
    indexes i*n .. i*n + n-1, the usage summed (the first answer's id names the request)."""
    merged = dict(answers[0])
    merged["choices"] = [{**choice, "index": i * n + choice["index"]}
                         for i, answer in enumerate(answers) for choice in answer["choices"]]
    usage: dict[str, Any] = {}
    for answer in answers:
        for key, value in answer["usage"].items():
            if isinstance(value, dict):
                inner = usage.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + v
            else:
                usage[key] = usage.get(key, 0) + value
    merged["usage"] = usage
    return merged

