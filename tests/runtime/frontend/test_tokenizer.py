"""The frontend's incremental detokenizer: the text it streams, token by token, is the text of the whole answer
decoded at once, and never a half UTF-8 character on the way."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

from hpc.runtime.frontend.tokenizer import Detokenizer, StopStrings, TextCodec

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
        streamed = "".join(_streamed(Detokenizer(codec), ids, rng.choice([1, 2, 5])))
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


def _reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """What the client must get: the text up to the earliest stop string, or all of it."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)


@pytest.mark.parametrize("stops", [[], ["zz"], ["$(", "`id`"], ["ab", "b c"], ["\n\n", "é—"], ["a" * 7]])
def test_stop_strings_cut_the_text_however_it_arrives(stops):
    rng = random.Random(3)
    for text in ["a plain answer b c with `id` and $(x)", HOSTILE, "aaaaaaa" * 3, "zz at the start", "tail zz"]:
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, min(8, len(text) - 1))))
            deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            held, sent, stopped = StopStrings(stops), "", False
            for i, delta in enumerate(deltas):
                out, stopped = held.feed(delta, final=i == len(deltas) - 1)
                sent += out
                if stopped:
                    break
                assert len(held.held) <= max(held.keep, 0)  # never more than a stop string's start held back
            assert (sent, stopped) == _reference(text, stops)


def test_text_that_may_start_a_stop_string_waits_until_it_cannot():
    held = StopStrings(["STOP"])
    assert held.feed("hello ST", final=False) == ("hello", False)  # " ST" may be the start of STOP
    assert held.feed("ILL here", final=False) == (" STILL h", False)  # the last 3 characters wait, as ever
    assert held.feed(" ST", final=True) == ("ere ST", False)  # the end: nothing can follow


def test_a_tokenizer_file_that_does_not_parse_is_named_in_the_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json")
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be read as a fast tokenizer: expected"):
        TextCodec(tmp_path)


def test_a_bounded_encode_gives_the_ids_or_past_the_limit_only_their_count(codec):
    text = "the sea is calm tonight " * 40
    ids = codec.encode(text)
    assert codec.encode_bounded(text, len(ids)) == ids
    assert codec.encode_bounded(text, len(ids) - 1) == len(ids)  # a count, not a list
    for other in ("日本語 テキスト, émoji 🎉 and   spaces\n\ttabs", "<|im_start|>user", "x" * 5000, " "):
        assert codec.encode_bounded(other, 10**6) == codec.encode(other)  # the fast encode's ids are encode's
    # no text longer than this fits the tokens, whatever it says: every piece is at most max_token_chars long
    assert all(len(codec.decode([i])) <= codec.max_token_chars for i in range(codec.tok.get_vocab_size()))
    assert codec.most_chars(512) == 512 * codec.max_token_chars


def test_a_long_encode_in_a_thread_leaves_the_rest_of_the_process_running(codec):
    """encode holds the GIL for the whole prompt (a 10 MB one froze the frontend for 15 s); encode_bounded does
    not. Counted, not timed: how often this thread got to run while the other tokenized."""
    text = "alpha beta gamma delta " * 50_000  # 1.1 MB
    done = threading.Event()
    ran = 0

    def tokenize():
        codec.encode_bounded(text, 10)
        done.set()
    worker = threading.Thread(target=tokenize)
    worker.start()
    while not done.is_set():
        time.sleep(0.001)
        ran += 1
    worker.join()
    assert ran > 50, ran  # encode in its place: a handful (it held the GIL throughout)
