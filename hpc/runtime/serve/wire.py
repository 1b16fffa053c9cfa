"""Every message between the frontend and the workers, as msgspec Structs: one encode and one typed decode per hop.

A frame on the socket is an 8-byte header (body length, payload length; u32 big-endian), a msgpack body — a `Call`
(client -> server) or a `Reply` (server -> client) — and a raw binary payload (KV-cache bytes), kept out of the
msgpack body so the bytes are not copied through the codec. Decoding a `Call` validates its whole body (ranges
included) in the same pass, so a worker never sees an untyped dict.
"""

from __future__ import annotations

import struct
from enum import Enum
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct, field


class Message(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Base of every wire message: immutable (copy with `msgspec.structs.replace`), unknown fields refused."""


# ---- what a generation carries -------------------------------------------------------------------------------
class GuidePiece(Message, frozen=True):
    """One piece of a Guide: `text` (values[0] literally), `choice` (one of values, none a prefix of another),
    `until` (free text ending with values[0]), `json_object` (any JSON object)."""

    kind: Literal["text", "choice", "until", "json_object"]
    values: list[str] = field(default_factory=list)


class Guide(Message, frozen=True):
    """Constrained decoding: the answer is these pieces in order, then it ends (response_format json_object,
    a forced tool call in the recipe's tool-call format)."""

    pieces: Annotated[list[GuidePiece], Meta(min_length=1, max_length=16)]


class SamplingParams(Message, frozen=True):
    max_tokens: Annotated[int, Meta(ge=1, le=10_000_000)] = 16
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=1_000_000)] = 0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None  # engines seed 64-bit generators
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, for engines that stop on them themselves
    ignore_eos: bool = False
    min_tokens: Annotated[int, Meta(ge=0, le=10_000_000)] = 0  # EOS and stop tokens end nothing before this many
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # None: none; k: the chosen token's + k best
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # OpenAI's: once a token appeared
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0  # OpenAI's: per time it appeared
    # vLLM's and TensorRT-LLM's (HF's definition): a token of the prompt or the answer has its logit divided by
    # this when positive, multiplied when negative; 1 is none
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] = 1.0
    guide: Guide | None = None
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # also the prompt's (echo with logprobs)


class TokenLogprob(Message, frozen=True):
    """The model's log-probability of a generated token, and of the `logprobs` most likely tokens at that step."""

    token_id: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


class TrtllmContextParams(Message, frozen=True):
    """TensorRT-LLM's context-phase parameters (tensorrt_llm/disaggregated_params.py), carried prefill -> decode.

    The generation-only request needs all of them: the C++ executor finds the context's KV cache through the
    cache transceiver by request id, and the prompt must be the one the context phase ran.
    """

    first_gen_tokens: list[int]
    prompt_token_ids: list[int]
    ctx_request_id: int | None = None
    disagg_request_id: int | None = None
    opaque_state: bytes | None = None
    draft_tokens: list[int] | None = None
    ctx_dp_rank: int | None = None
    ctx_info_endpoint: str | list[str] | None = None  # a list where the context side has several (upstream)
    # Qwen-VL under EPD: the M-RoPE positions the encoder computed, for prefill and then decode
    mrope_position_ids_handle: dict[str, Any] | None = None
    mrope_position_deltas_handle: dict[str, Any] | None = None


class DisaggregatedParams(Message, frozen=True):
    """What a prefill worker hands to a decode worker: where the KV cache waits, and the first token."""

    request_handle: str
    prefill_address: str  # host:port of the prefill worker's RPC server
    first_token_id: int
    prompt_length: int
    trtllm: TrtllmContextParams | None = None
    # the KV shared over CUDA IPC with the answer (torch engine on a GPU): a decode worker on the same node copies
    # from it without a FetchKv round trip, and releases it as it would a fetched one
    kv: KvMeta | None = None


class EncodedMedia(Message, frozen=True, tag="media"):
    """Image embeddings from an encode worker, sent on to prefill: the tensor itself (torch engine, float32
    bytes), or TensorRT-LLM's multimodal embedding handles (CUDA IPC, so encode and prefill share a node)."""

    shape: list[int] = field(default_factory=list)
    data: bytes = b""
    handles: list[dict[str, Any]] | None = None
    hashes: list[list[int]] | None = None
    mrope_position_ids_handle: dict[str, Any] | None = None  # Qwen-VL: upstream's DisaggregatedParams fields
    mrope_position_deltas_handle: dict[str, Any] | None = None


class GenerateRequest(Message, frozen=True, tag="generate"):
    request_id: str
    token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    streaming: bool = True
    disaggregated_params: DisaggregatedParams | None = None
    image: str | None = None  # URL or local path (prefill/encode in multimodal mode)
    media: EncodedMedia | None = None
    dp_rank: int | None = None  # the attention-DP rank whose KV cache holds the prompt's prefix (the router's pick)


class FinishReason(str, Enum):
    """Why a request's output ended: TensorRT-LLM's (CompletionOutput.finish_reason in executor/result.py: stop,
    length, timeout, cancelled), and error, an engine's failure (GenerateOutput.error says what)."""

    STOP = "stop"  # EOS, a stop token or string, a complete guide
    LENGTH = "length"  # max_tokens, or the end of the KV cache's sequence
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    ERROR = "error"


class GenerateOutput(Message, frozen=True, tag="output"):
    token_ids: list[int]  # new tokens since the last output
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    disaggregated_params: DisaggregatedParams | None = None
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids, when the request asked
    cached_tokens: int = 0  # prompt tokens whose KV the engine reused instead of computing
    prompt_logprobs: list[TokenLogprob] | None = None  # first output only: prompt tokens 1..n-1 (0 has none)


# ---- the other calls and their answers ---------------------------------------------------------------------------
KvVia = Literal["bytes", "cuda_ipc", "nixl"]


class FetchKv(Message, frozen=True, tag="fetch_kv"):
    """Decode -> prefill: hand over the KV cache waiting under `handle`, preferably `via`: its bytes in the answer
    (any two machines), a CUDA IPC handle (the caller shares this node and a GPU) or a NIXL location to READ from.
    The answer says what was used (a prefill worker without a GPU or NIXL sends bytes). `nixl_agent`: the prefill's
    NIXL agent the caller already knows, so its metadata need not come again."""

    handle: str
    via: KvVia = "bytes"
    nixl_agent: str = ""


class CudaIpc(Message, frozen=True):
    """A GPU allocation shared with another process on the node: its CUDA IPC handle (the driver's 64 bytes) and
    where in it the KV lies (hpc.runtime.engine.kv.cuda_ipc)."""

    device: int
    handle: bytes
    allocation_bytes: int
    offset_bytes: int
    size_bytes: int


class NixlKv(Message, frozen=True):
    """Where a lent KV lies for a NIXL READ: the lender's agent, the lent region's partial metadata (with the
    connection info when the reader did not know the agent yet) and the serialized transfer descriptors."""

    agent: str
    metadata: bytes
    descs: bytes


class KvMeta(Message, frozen=True, tag="kv"):
    """Describes the KV in the frame's payload, or where it lies (ipc: on a GPU of this node; nixl: anywhere NIXL
    reaches): [layers, 2, kv_heads, length, head_dim]. Shared or lent KV is released with ReleaseKv once the decode
    side has its copy."""

    shape: list[int]
    dtype: str
    ipc: CudaIpc | None = None
    nixl: NixlKv | None = None


class ReleaseKv(Message, frozen=True, tag="release_kv"):
    """Decode -> prefill: the KV shared under `handle` was copied; free it."""

    handle: str


class EncodeImage(Message, frozen=True, tag="encode"):
    image: str  # URL or local path
    # the request's prompt: an encoder whose input processor reads the text (TensorRT-LLM's, for Qwen-VL's M-RoPE
    # positions) runs on the request's own, as Dynamo's EncodeHelper does
    prompt_token_ids: list[int] = field(default_factory=list)


class StatsQuery(Message, frozen=True, tag="stats"):
    pass


class WorkerStats(Message, frozen=True, tag="stats"):
    values: dict[str, float]


class Hello(Message, frozen=True, tag="hello"):
    """The first frame on a connection to a worker that holds the job's RPC token."""

    token: str


class Cancel(Message, frozen=True, tag="cancel"):
    """The caller stopped reading the stream with this call's id."""


# ---- video diffusion (seed 004) -------------------------------------------------------------------------------
class VideoRequest(Message, frozen=True, tag="video"):
    """One video: the prompt's tokens (the frontend tokenizes), the size, the loop, and where the MP4 goes."""

    video_id: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]
    prompt_ids: Annotated[list[int], Meta(max_length=4096)]
    height: Annotated[int, Meta(ge=8, le=8192)]
    width: Annotated[int, Meta(ge=8, le=8192)]
    frames: Annotated[int, Meta(ge=1, le=4096)]
    steps: Annotated[int, Meta(ge=1, le=1000)]
    guidance: Annotated[float, Meta(ge=0.0, le=100.0)]
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)]
    fps: Annotated[int, Meta(ge=1, le=240)]
    output_path: Annotated[str, Meta(min_length=1, max_length=4096)]
    negative_ids: Annotated[list[int], Meta(max_length=4096)] = field(default_factory=list)
    prompt: Annotated[str, Meta(max_length=20_000)] = ""  # the text too: TensorRT-LLM's pipeline tokenizes itself
    negative_prompt: Annotated[str, Meta(max_length=20_000)] = ""


class VideoProgress(Message, frozen=True, tag="video_progress"):
    step: int
    steps: int


class VideoResult(Message, frozen=True, tag="video_result"):
    path: str
    frames: int
    width: int
    height: int
    fps: int
    size_bytes: int
    inference_time_s: float
    transformer_calls: int
    skipped_calls: int  # TeaCache


CallBody = Union[GenerateRequest, FetchKv, ReleaseKv, EncodeImage, StatsQuery, Hello, Cancel, VideoRequest]
ReplyBody = Union[GenerateOutput, KvMeta, EncodedMedia, WorkerStats, VideoProgress, VideoResult]


class Call(Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    id: int
    body: CallBody


class Reply(Struct, frozen=True, array_like=True, omit_defaults=True):
    id: int
    body: ReplyBody | None = None
    end: bool = False
    error: str | None = None
    code: int = 0


class _CallId(Struct, array_like=True):
    """Just the id of a call whose body failed validation, so the error can be answered on its stream."""

    id: int


# ---- framing ---------------------------------------------------------------------------------------------------
HEADER = struct.Struct(">II")
MAX_FRAME = 1 << 30
_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(Call)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_id_decoder = msgspec.msgpack.Decoder(_CallId)
_replies_decoder = msgspec.msgpack.Decoder(list[Reply])

# In a frame's header, the payload length with this bit set: the body is a list of replies (of any streams on the
# connection, in order) and there is no payload. A decode step's tokens for 64 streams leave as one such frame:
# one encode, one header, one read, instead of 64 of each.
REPLIES_FRAME = 1 << 31

DecodeError = msgspec.DecodeError  # ValidationError is a DecodeError


BIG_PAYLOAD = 1 << 20  # from here on a payload is written as its own piece and read into one buffer


def encode_frame(message: Call | Reply, payload: bytes = b"") -> bytes:
    body = _encoder.encode(message)
    return HEADER.pack(len(body), len(payload)) + body + payload


def frame_parts(message: Call | Reply, payload: bytes | memoryview = b"") -> tuple[bytes | memoryview, ...]:
    """A frame as the pieces to write: a large payload (a KV cache: hundreds of MB) stays its own piece rather
    than being copied into the frame — each copy of fresh memory costs ~40 ms per 66 MB here."""
    if len(payload) < BIG_PAYLOAD:
        return (encode_frame(message, bytes(payload)),)
    body = _encoder.encode(message)
    return HEADER.pack(len(body), len(payload)) + body, payload


def encode_replies(replies: list[Reply]) -> bytes:
    body = _encoder.encode(replies)
    return HEADER.pack(len(body), REPLIES_FRAME) + body


def decode_replies(body: bytes) -> list[Reply]:
    return _replies_decoder.decode(body)


def decode_call(body: bytes) -> Call:
    return _call_decoder.decode(body)


def decode_reply(body: bytes) -> Reply:
    return _reply_decoder.decode(body)


def call_id(body: bytes) -> int | None:
    """The id of an undecodable call, when at least that much is readable."""
    try:
        return _id_decoder.decode(body).id
    except DecodeError:
        return None


def to_dict(message: Message) -> dict[str, Any]:
    """A message as plain data (logs, tests, JSON files)."""
    return msgspec.to_builtins(message)


replace = msgspec.structs.replace
