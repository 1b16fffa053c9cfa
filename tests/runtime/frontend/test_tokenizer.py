"""The frontend's incremental detokenizer: the text it streams, token by token, is the text of the whole answer
decoded at once, and never a half UTF-8 character on the way."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hpc.runtime.frontend.tokenizer import Detokenizer, TextCodec

pytestmark = pytest.mark.unit

HOSTILE = "naïve café — 日本語 😀👩‍👩‍👧 $(rm -rf /) `id` 'quoted' \"double\"\nnew line\t tab ﬁ \u200b"


@pytest.fixture(scope="module")
def codec(tiny) -> TextCodec:
    return TextCodec(Path(tiny))


def _streamed(detok: Detokenizer, ids: list[int], per_add: int = 1) -> list[str]:
    return [detok.add(ids[i:i + per_add]) for i in range(0, len(ids), per_add)]


@pytest.mark.parametrize("per_add", [1, 3])
def test_streamed_text_is_the_whole_decode_without_half_characters(codec, per_add):
    ids = codec.encode(HOSTILE)
    assert len(ids) > len(HOSTILE) // 4  # byte-level pieces: characters split over tokens are exercised
    deltas = _streamed(Detokenizer(codec), ids, per_add)
    assert "".join(deltas) == codec.decode(ids) == HOSTILE
    assert not any("\ufffd" in d for d in deltas)
    # a character of several bytes split over tokens comes out whole, once its last byte has arrived
    assert "😀" in deltas or any("😀" in d for d in deltas)


def test_random_tokens_stream_what_decoding_them_at_once_gives(codec):
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(codec.tok.get_vocab_size()) for _ in range(rng.randrange(1, 80))]
        detok = Detokenizer(codec)
        streamed = "".join(_streamed(detok, ids, rng.choice([1, 2, 5])))
        assert streamed == detok.text
        # what is held back at the end is at most a character left incomplete
        assert codec.decode(ids).startswith(streamed)
        assert len(codec.decode(ids)) - len(streamed) <= 1


def test_special_tokens_skipped_or_kept_without_the_end_of_text(tiny):
    skip, keep = TextCodec(Path(tiny)), TextCodec(Path(tiny), keep_special_tokens=True)
    eos, pad = skip.eos_token_id, skip.tok.token_to_id("<|pad|>")
    ids = [*skip.encode("hello"), pad, *skip.encode(" world"), eos]
    assert "".join(_streamed(Detokenizer(skip), ids)) == "hello world"
    kept = "".join(_streamed(Detokenizer(keep), ids))
    assert kept == keep.decode(ids) == "hello<|pad|> world"
