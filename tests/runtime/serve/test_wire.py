"""The frontend <-> worker wire: typed messages, one decode per hop, bad bodies answered on their own stream."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from hpc.runtime.serve.rpc import RemoteError, RpcClient, RpcServer
from hpc.runtime.serve.wire import (
    HEADER, REPLIES_FRAME, Call, Cancel, CudaIpc, DisaggregatedParams, EncodedMedia, EncodeImage, FetchKv,
    GenerateOutput, GenerateRequest, Hello, KvMeta, NixlKv, ReleaseKv, Reply, SamplingParams, StatsQuery,
    TrtllmContextParams, WorkerStats, decode_call, decode_replies, decode_reply, encode_frame,
)

pytestmark = pytest.mark.unit

PARAMS = DisaggregatedParams(request_handle="h 'quoted' $(x)", prefill_address="10.0.0.1:9000", first_token_id=7,
                             prompt_length=3, trtllm=TrtllmContextParams(first_gen_tokens=[7], ctx_request_id=2**62,
                                                                         opaque_state=b"\x00\xff`\n",
                                                                         prompt_token_ids=[1, 2, 3]))
CALLS = [
    GenerateRequest(request_id="r-1", token_ids=[1, 2, 3],
                    sampling=SamplingParams(max_tokens=5, temperature=0.7, seed=2**63 - 1, stop=["\n\n", "`"]),
                    disaggregated_params=PARAMS, media=EncodedMedia(shape=[2, 4], data=bytes(range(32)))),
    FetchKv(handle="abc"), FetchKv(handle="abc", via="cuda_ipc"), FetchKv(handle="h", via="nixl", nixl_agent="p-1"),
    ReleaseKv(handle="abc"),
    EncodeImage(image="file:///tmp/a b.png"), EncodeImage(image="x.png", prompt_token_ids=[1, 2, 3]), StatsQuery(),
    Hello(token="t"), Cancel(),
    # what TensorRT-LLM may hand over: a list of context endpoints, Qwen-VL's M-RoPE handles, an attention-DP rank
    GenerateRequest(request_id="r-2", token_ids=[5], dp_rank=3, disaggregated_params=DisaggregatedParams(
        request_handle="trtllm", prefill_address="p:1", first_token_id=5, prompt_length=1,
        trtllm=TrtllmContextParams(first_gen_tokens=[5], prompt_token_ids=[5], disagg_request_id=(1 << 40) + 7,
                                   ctx_info_endpoint=["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"],
                                   mrope_position_ids_handle={"tensor_size": [3, 1, 9]},
                                   mrope_position_deltas_handle={"tensor_size": [1, 1]}))),
]
REPLIES = [GenerateOutput(token_ids=[4], finished=True, finish_reason="stop", disaggregated_params=PARAMS),
           KvMeta(shape=[2, 2, 1, 3, 4], dtype="torch.float16"), EncodedMedia(handles=[{"tensor_size": [1, 2]}]),
           KvMeta(shape=[2, 2, 1, 3, 4], dtype="torch.bfloat16",
                  ipc=CudaIpc(device=1, handle=b"\x00" * 64, allocation_bytes=2 << 20, offset_bytes=512,
                              size_bytes=96)),
           KvMeta(shape=[2, 2, 1, 3, 4], dtype="torch.bfloat16",
                  nixl=NixlKv(agent="prefill-0-ab12", metadata=b"nixlSerDes\x00", descs=b"\x01\x02")),
           WorkerStats(values={"kv_usage": 0.25})]


def _split(frame: bytes) -> tuple[bytes, bytes]:
    n_body, n_payload = HEADER.unpack(frame[:HEADER.size])
    return frame[HEADER.size:HEADER.size + n_body], frame[HEADER.size + n_body:]


@pytest.mark.parametrize("body", CALLS, ids=lambda b: type(b).__name__)
def test_every_call_round_trips_typed(body):
    raw, payload = _split(encode_frame(Call(9, body), b"KV"))
    decoded = decode_call(raw)
    assert decoded == Call(9, body) and type(decoded.body) is type(body) and payload == b"KV"


@pytest.mark.parametrize("body", REPLIES, ids=lambda b: type(b).__name__)
def test_every_reply_round_trips_typed(body):
    decoded = decode_reply(_split(encode_frame(Reply(3, body)))[0])
    assert decoded == Reply(3, body) and type(decoded.body) is type(body)


@pytest.mark.parametrize("bad, field", [({"seed": 2**63}, "seed"), ({"max_tokens": 0}, "max_tokens"),
                                        ({"top_p": 0.0}, "top_p"), ({"temperature": -1.0}, "temperature"),
                                        ({"best_of": 2}, "best_of")])
def test_out_of_range_or_unknown_fields_are_refused_on_decode(bad, field):
    raw = msgspec.msgpack.encode([1, {"type": "generate", "request_id": "r", "token_ids": [1], "sampling": bad}])
    with pytest.raises(msgspec.ValidationError, match=field):
        decode_call(raw)


def test_server_hands_typed_calls_and_answers_a_bad_one_on_its_own_stream():
    seen = []

    async def generate(request, payload):
        seen.append(request)
        for i in range(request.sampling.max_tokens):
            yield GenerateOutput(token_ids=[i], finished=i == request.sampling.max_tokens - 1), b""

    async def fetch_kv(call, payload):
        yield KvMeta(shape=[4], dtype="torch.uint8"), b"\x01\x02\x03\x04"

    async def main():
        server = RpcServer({GenerateRequest: generate, FetchKv: fetch_kv})
        await server.start("127.0.0.1", 0)
        try:
            # a hand-made frame with an out-of-range seed: 400 on stream 41, the connection stays up
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            raw = msgspec.msgpack.encode([41, {"type": "generate", "request_id": "r", "token_ids": [1],
                                               "sampling": {"seed": 2**63}}])
            writer.write(HEADER.pack(len(raw), 0) + raw)
            n_body, _ = HEADER.unpack(await reader.readexactly(HEADER.size))
            reply = decode_reply(await reader.readexactly(n_body))
            assert reply.id == 41 and reply.end and reply.code == 400 and "seed" in reply.error
            ok = encode_frame(Call(42, GenerateRequest(request_id="r2", token_ids=[1],
                                                       sampling=SamplingParams(max_tokens=1))))
            writer.write(ok)
            # the answer and the stream's end, written in one pass of the server's loop: one frame of replies
            n_body, n_payload = HEADER.unpack(await reader.readexactly(HEADER.size))
            assert n_payload == REPLIES_FRAME
            answer, end = decode_replies(await reader.readexactly(n_body))
            assert (answer.id, answer.body, end.id, end.end) == (42, GenerateOutput(token_ids=[0], finished=True),
                                                                 42, True)
            writer.close()

            client = RpcClient("127.0.0.1", server.port)
            outs = [o async for o, _ in client.stream(GenerateRequest(request_id="r3", token_ids=[5],
                                                                      sampling=SamplingParams(max_tokens=3)))]
            meta, data = await client.call(FetchKv(handle="h"))
            with pytest.raises(RemoteError, match="does not serve EncodeImage") as refused:
                await client.call(EncodeImage(image="x"))
            await client.close()
            return outs, meta, data, refused.value.code
        finally:
            await server.close()

    outs, meta, data, code = asyncio.run(main())
    assert [o.token_ids for o in outs] == [[0], [1], [2]] and outs[-1].finished
    assert meta == KvMeta(shape=[4], dtype="torch.uint8") and data == b"\x01\x02\x03\x04" and code == 400
    assert all(isinstance(r, GenerateRequest) for r in seen) and [r.request_id for r in seen] == ["r2", "r3"]


def test_a_finish_reason_crosses_the_wire_as_its_name_and_comes_back_as_the_enum():
    from hpc.runtime.serve.wire import FinishReason

    for reason in FinishReason:
        out = GenerateOutput(token_ids=[1], finished=True, finish_reason=reason)
        encoded = msgspec.msgpack.encode(out)
        assert reason.value.encode() in encoded
        assert msgspec.msgpack.decode(encoded, type=GenerateOutput).finish_reason is reason
    with pytest.raises(msgspec.ValidationError, match="finish_reason"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"type": "output", "token_ids": [], "finish_reason": "done"}),
                               type=GenerateOutput)


def test_every_finish_reason_has_openais_name_and_tensorrt_llms_map_onto_them():
    from hpc.runtime.engine.trtllm import finish_reason
    from hpc.runtime.frontend.app import OPENAI_FINISH
    from hpc.runtime.serve.wire import FinishReason

    assert set(OPENAI_FINISH) == set(FinishReason)
    assert set(OPENAI_FINISH.values()) <= {"stop", "length", "error"}
    assert [finish_reason(r) for r in ("stop", "length", "timeout", "cancelled")] == [
        FinishReason.STOP, FinishReason.LENGTH, FinishReason.TIMEOUT, FinishReason.CANCELLED]
    assert finish_reason(None) is FinishReason.STOP and finish_reason("not_finished") is FinishReason.STOP
