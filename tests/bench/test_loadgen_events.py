"""The load generator's SSE parsing: events split anywhere, the first token's time and the gaps, the usage count,
an error event; bad JSON is a ValueError whichever decoder parses it (the caller records it as the request's
error)."""

from __future__ import annotations

import io
import json

import pytest

from hpc.bench.loadgen import Sample, _event_decoder, _Events, bar

pytestmark = pytest.mark.unit

STREAM = (b'data: {"choices":[{"text":"a"}]}\n\n' b'data: {"choices":[{"text":""}]}\n\n'
          b'data: {"choices":[{"text":"$(b) `c`"}]}\n\n' b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n'
          b"data: [DONE]\n\n")


@pytest.mark.parametrize("decode", [json.loads, _event_decoder()], ids=["json", "default"])
@pytest.mark.parametrize("cut", [1, 5, 33, len(STREAM)])
def test_events_split_anywhere_give_the_same_sample(decode, cut):
    sample = Sample(ok=False)
    events = _Events(sample, 0.0, decode)
    for start in range(0, len(STREAM), cut):
        events.feed(STREAM[start:start + cut])
    assert sample.tokens == 2 and sample.ttft is not None and events.buffer == b""
    assert len(sample.itls) == 1  # two events with text: one gap; the empty one is not a token
    sample = Sample(ok=False)
    _Events(sample, 0.0, decode).feed(b'data: {"error": {"message": "overloaded"}}\n\n')
    assert sample.error == "overloaded"
    with pytest.raises(ValueError):
        _Events(Sample(ok=False), 0.0, decode).feed(b"data: {not json\n\n")


def test_the_default_decoder_is_msgspecs_where_installed():
    msgspec = pytest.importorskip("msgspec")
    assert _event_decoder() is not json.loads and isinstance(_event_decoder().__self__, msgspec.json.Decoder)


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_a_levels_progress_is_redrawn_on_a_terminal_and_one_line_elsewhere(tty):
    stream = _Stream(tty)
    show = bar("c=4 in=32 out=16", stream)
    for done in range(1, 17):
        show(done, 16)
    text = stream.getvalue()
    if tty:
        assert text.count("\r") == 16 and text.endswith("] 16/16\n")
    else:  # a log or a pipe: no carriage returns, one line for the level
        assert text == "c=4 in=32 out=16: 16/16 requests\n"
