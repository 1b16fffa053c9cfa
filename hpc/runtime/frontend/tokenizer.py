"""Tokenizer, chat template and incremental detokenization for the frontend (tokenizers + jinja2 only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import meta

from hpc.model.info import ModelInfo
from hpc.model.placeholders import image_placeholder
from hpc.runtime.frontend.chat_content import (ContentFormat, chat_template_environment, message_content,
                                               resolved_format)


class TextCodec:
    def __init__(self, model_dir: Path, chat_template_file: str | None = None,
                 keep_special_tokens: bool = False) -> None:
        from tokenizers import Tokenizer

        self.skip_special_tokens = not keep_special_tokens
        try:
            self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as exc:  # the Rust library raises a bare Exception ("No such file", a parse error)
            raise ValueError(f"{model_dir / 'tokenizer.json'} cannot be read as a fast tokenizer: {exc}") from None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        # a token stands for at most this many characters of text (a byte-level piece's characters are its bytes;
        # added tokens such as <|begin_of_text|> are matched whole)
        self.max_token_chars = max((len(piece) for piece in self.tok.get_vocab(with_added_tokens=True)), default=1)
        template = find_chat_template(model_dir, cfg, chat_template_file)
        env = chat_template_environment()
        self.template = env.from_string(template) if template else None
        # the names the template reads that no one defines inside it: what a request's template kwargs may set
        self.template_variables = frozenset(meta.find_undeclared_variables(env.parse(template))) if template \
            else frozenset()
        model_config = dict(ModelInfo.read(model_dir).config)
        vision = model_config.get("hpc_vision")
        self.image_placeholder = image_placeholder(model_config)  # for templates that print content as text
        self.content_format: ContentFormat = resolved_format(template, self.image_placeholder)
        self.image_token_id = vision["image_token_id"] if vision else None
        self.image_tokens = vision["num_image_tokens"] if vision else 0

    def message_content(self, content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        return message_content(content, self.content_format, self.image_placeholder)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_bounded(self, text: str, limit: int) -> list[int] | int:
        """The ids, or (past `limit`) only their count: a prompt too long to serve never becomes a Python list of
        millions of ints. encode_batch_fast, unlike encode, lets go of the GIL while the Rust tokenizer works, so a
        thread running this leaves the event loop serving everyone else (encode held it: 15 s of a 10 MB prompt
        was 15 s of nothing answered); and it computes no offsets, whose drop, with the GIL held, was the loop's
        last stall beside a 4 MB prompt (269 ms of encode_batch's 1.8 million tokens, 10 ms without; the same
        ids, in 2.1 s instead of 3.4)."""
        encoding = self.tok.encode_batch_fast([text], add_special_tokens=False)[0]
        return len(encoding) if len(encoding) > limit else encoding.ids

    def most_chars(self, tokens: int) -> int:
        """The most characters `tokens` tokens can hold: no longer text can fit them, whatever it says."""
        return tokens * self.max_token_chars

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            variables: dict[str, Any] | None = None) -> str:
        """`variables`: the request's own for the template (template_kwargs checked them), as transformers passes
        apply_chat_template's extra keyword arguments."""
        if self.template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        return self.template.render(**(variables or {}), messages=messages, tools=tools, add_generation_prompt=True,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    def expand_image_tokens(self, ids: list[int]) -> list[int]:
        """One image placeholder becomes as many tokens as the vision encoder yields embeddings."""
        if self.image_token_id is None:
            return ids
        out: list[int] = []
        for i in ids:
            out.extend([i] * self.image_tokens if i == self.image_token_id else [i])
        return out

    def decode(self, ids: list[int]) -> str:
        if not self.skip_special_tokens and self.eos_token_id is not None:  # markers stay, the end does not
            ids = [i for i in ids if i != self.eos_token_id]
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (logprobs report them: a token may be half of a UTF-8 character)."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if type(self.tok.decoder).__name__ == "ByteLevel":  # GPT-2 style: one printable char per byte
            try:
                return bytes(_BYTE_OF[c] for c in piece)
            except KeyError:  # a special token, not in the byte alphabet
                return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json gives it: text, or (older checkpoints) an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def find_chat_template(model_dir: Path, tokenizer_config: dict[str, Any], chat_template_file: str | None = None
                       ) -> str | None:
    """The recipe's file (model.chat_template) if it gives one, else where Hugging Face checkpoints keep it:
    tokenizer_config.json (a string, or named templates of which "default" is the chat one), else the processor's
    chat_template.jinja or chat_template.json (vision models)."""
    if chat_template_file:
        return Path(chat_template_file).expanduser().read_text()
    found = tokenizer_config.get("chat_template")
    if isinstance(found, list):
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(found, str) and found:
        return found
    if (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text()
    if (model_dir / "chat_template.json").is_file():
        found = json.loads((model_dir / "chat_template.json").read_text()).get("chat_template")
        return found if isinstance(found, str) and found else None
    return None


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, printable char -> byte (the inverse of its bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF = _byte_alphabet()


class Detokenizer:
    """Incremental: emits text only once it is complete (no half UTF-8 characters). The tokenizers library's own
    DecodeStream (Rust) keeps the state: 1.6 µs a token where decoding the window twice in Python took 3.7, at
    every token of every stream the frontend relays (vLLM's FastIncrementalDetokenizer does the same)."""

    def __init__(self, codec: TextCodec) -> None:
        from tokenizers.decoders import DecodeStream

        self.codec = codec
        self._stream = DecodeStream(skip_special_tokens=codec.skip_special_tokens)
        # markers kept (keep_special_tokens) still leave out the end of the text, as TextCodec.decode does
        self._dropped = codec.eos_token_id if not codec.skip_special_tokens else None

    def add(self, new_ids: list[int]) -> str:
        """The text these tokens complete (possibly none yet)."""
        tok, step, delta = self.codec.tok, self._stream.step, ""
        for token in new_ids:
            if token != self._dropped:
                piece = step(tok, token)
                if piece:
                    delta += piece
        return delta


class StopStrings:
    """A stream's text as it may be sent: up to the first stop string, and what may be the start of one held back
    until it cannot be. Only the text not sent yet is kept and searched (a stop string that began in text already
    sent would have been whole, and found, before it was sent), so a long answer costs each delta, not the whole
    text again at every token."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = stops
        self.keep = max(map(len, stops)) - 1 if stops else 0  # the longest start of a stop string a tail can be
        self.held = ""

    def feed(self, delta: str, final: bool) -> tuple[str, bool]:
        """(the text to send now, whether a stop string ended the stream there)."""
        if not self.stops:  # nothing to look for: all of it, at once
            return delta, False
        held = self.held + delta
        hits = [i for i in (held.find(stop) for stop in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return held[:min(hits)], True
        cut = len(held) if final else max(0, len(held) - self.keep)
        self.held = held[cut:]
        return held[:cut], False
