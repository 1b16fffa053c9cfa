"""Constrained decoding for the torch engine: the output must follow a Guide (hpc.runtime.serve.wire), a sequence
of pieces — literal text, one of several literal texts, free text up to a closing tag, a JSON object.

Every piece is a character-level automaton with immutable states, so a candidate token is tried by feeding its
text from the current state without disturbing it. Each step the engine takes the best-ranked token (greedy:
by logit; sampled: by logit / temperature plus Gumbel noise, which draws from the masked distribution) whose
text keeps the output a valid prefix and can still be completed within the tokens left (`min_close`, in
characters; every single character is a token of a byte-level vocabulary). When the guide is complete the
engine ends the answer. What TensorRT-LLM does with xgrammar, at the scale a test model needs.
"""

from __future__ import annotations

from typing import Any

_WS = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_MAX_DEPTH = 8
# JSON modes
_START, _VALUE, _KEY_OR_END, _KEY, _KEY_STR, _COLON, _STR, _NUM, _LIT, _AFTER, _ARR_OR_END, _DONE = range(12)
_NUM_END = {"zero", "int", "frac", "exp"}  # number states that may end here


class JsonObject:
    """A JSON object (nesting up to _MAX_DEPTH); state: (mode, stack, aux)."""

    initial = (_START, "", None)

    def step(self, state: tuple, ch: str) -> tuple | None:
        mode, stack, aux = state
        if mode == _NUM:
            nxt = _number(aux, ch)
            if nxt is not None:
                return (_NUM, stack, nxt)
            if aux not in _NUM_END:
                return None
            return self.step((_AFTER, stack, None), ch)  # the character that ended the number
        if mode in (_STR, _KEY_STR):
            if aux:  # after a backslash
                return (mode, stack, False) if ch in _ESCAPES else None
            if ch == "\\":
                return (mode, stack, True)
            if ch == '"':
                return (_AFTER, stack, None) if mode == _STR else (_COLON, stack, None)
            return state if ch >= " " else None
        if mode == _LIT:
            return None if ch != aux[0] else ((_LIT, stack, aux[1:]) if len(aux) > 1 else _after(stack))
        if ch in _WS:
            return state if mode not in (_START, _DONE) else None
        if mode == _START:
            return (_KEY_OR_END, "o", None) if ch == "{" else None
        if mode in (_VALUE, _ARR_OR_END):
            if mode == _ARR_OR_END and ch == "]":
                return _after(stack[:-1])
            return _value(stack, ch)
        if mode in (_KEY_OR_END, _KEY):
            if ch == '"':
                return (_KEY_STR, stack, False)
            return _after(stack[:-1]) if (mode == _KEY_OR_END and ch == "}") else None
        if mode == _COLON:
            return (_VALUE, stack, None) if ch == ":" else None
        if mode == _AFTER:
            top = stack[-1]
            if ch == ",":
                return (_KEY, stack, None) if top == "o" else (_VALUE, stack, None)
            if ch == ("}" if top == "o" else "]"):
                return _after(stack[:-1])
        return None

    def complete(self, state: tuple) -> bool:
        return state[0] == _DONE

    def min_close(self, state: tuple) -> int:
        """Characters still needed, at least, to close the object from here."""
        mode, stack, aux = state
        depth = len(stack)
        if mode in (_STR, _KEY_STR):  # the closing quote (after a pending escape), then for a key ': 0'
            return depth + 1 + bool(aux) + (2 if mode == _KEY_STR else 0)
        if mode == _NUM:
            return depth + (aux not in _NUM_END)
        if mode == _LIT:
            return depth + len(aux)
        return {_START: 2, _DONE: 0, _VALUE: 1 + depth, _KEY_OR_END: depth, _ARR_OR_END: depth, _AFTER: depth,
                _KEY: 4 + depth, _COLON: 2 + depth}[mode]


def _after(stack: str) -> tuple:
    return (_AFTER, stack, None) if stack else (_DONE, "", None)


def _value(stack: str, ch: str) -> tuple | None:
    if ch in "{[":
        if len(stack) >= _MAX_DEPTH:
            return None
        return (_KEY_OR_END, stack + "o", None) if ch == "{" else (_ARR_OR_END, stack + "a", None)
    if ch == '"':
        return (_STR, stack, False)
    for word in ("true", "false", "null"):
        if ch == word[0]:
            return (_LIT, stack, word[1:])
    number = _number(None, ch)
    return (_NUM, stack, number) if number else None


def _number(state: str | None, ch: str) -> str | None:
    """-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)? one character at a time; None: not part of the number."""
    digit = ch.isdigit() and ch.isascii()
    if state is None:
        return "sign" if ch == "-" else "zero" if ch == "0" else "int" if digit else None
    if state == "sign":
        return "zero" if ch == "0" else "int" if digit else None
    if state in ("zero", "int"):
        if digit and state == "int":
            return "int"
        return "frac0" if ch == "." else "exp0" if ch in "eE" else None
    if state in ("frac0", "frac"):
        if digit:
            return "frac"
        return "exp0" if (state == "frac" and ch in "eE") else None
    if state == "exp0":
        return "expsign" if ch in "+-" else "exp" if digit else None
    return "exp" if digit else None  # expsign, exp


class Literal:
    def __init__(self, text: str) -> None:
        self.text = text
        self.initial = 0

    def step(self, at: int, ch: str) -> int | None:
        return at + 1 if at < len(self.text) and self.text[at] == ch else None

    def complete(self, at: int) -> bool:
        return at == len(self.text)

    def min_close(self, at: int) -> int:
        return len(self.text) - at


class Choice:
    """One of several texts, none a prefix of another (so the end is never ambiguous)."""

    def __init__(self, texts: list[str]) -> None:
        if any(a != b and b.startswith(a) for a in texts for b in texts):
            raise ValueError(f"choices must not be prefixes of each other: {texts}")
        self.texts = list(texts)
        self.initial = ""

    def step(self, typed: str, ch: str) -> str | None:
        longer = typed + ch
        return longer if any(t.startswith(longer) for t in self.texts) else None

    def complete(self, typed: str) -> bool:
        return typed in self.texts

    def min_close(self, typed: str) -> int:
        return min(len(t) - len(typed) for t in self.texts if t.startswith(typed))


class Until:
    """Free text that ends with `tag` (reasoning before an answer); state: the characters typed since the
    last point where the tag could not have started, enough to find it."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.initial = ""

    def step(self, tail: str, ch: str) -> str | None:
        return None if self.complete(tail) else (tail + ch)[-len(self.tag):]

    def complete(self, tail: str) -> bool:
        return tail.endswith(self.tag)

    def min_close(self, tail: str) -> int:
        if self.complete(tail):
            return 0
        typed = next((n for n in range(min(len(tail), len(self.tag) - 1), 0, -1)
                      if self.tag.startswith(tail[-n:])), 0)  # the longest start of the tag already typed
        return len(self.tag) - typed


class Automaton:
    """A Guide's pieces in sequence; state: (piece index, that piece's state)."""

    def __init__(self, pieces: list[Any]) -> None:
        self.pieces = pieces
        self.rest = [sum(p.min_close(p.initial) for p in pieces[i + 1:]) for i in range(len(pieces))]
        self.initial = (0, pieces[0].initial)

    @classmethod
    def from_guide(cls, guide) -> "Automaton":
        """hpc.runtime.serve.wire.Guide -> its automaton."""
        build = {"text": lambda p: Literal(p.values[0]), "choice": lambda p: Choice(p.values),
                 "until": lambda p: Until(p.values[0]), "json_object": lambda p: JsonObject()}
        return cls([build[p.kind](p) for p in guide.pieces])

    def step(self, state: tuple, ch: str) -> tuple | None:
        index, sub = state
        piece = self.pieces[index]
        while piece.complete(sub):  # a finished piece takes nothing more: on to the next
            if index + 1 == len(self.pieces):
                return None
            index += 1
            piece, sub = self.pieces[index], self.pieces[index].initial
        nxt = piece.step(sub, ch)
        return None if nxt is None else (index, nxt)

    def feed(self, state: tuple, text: str) -> tuple | None:
        now: tuple | None = state
        for ch in text:
            now = self.step(now, ch)
            if now is None:
                return None
        return now

    def complete(self, state: tuple) -> bool:
        index, sub = state
        return self.pieces[index].complete(sub) and self.rest[index] == 0

    def min_close(self, state: tuple) -> int:
        index, sub = state
        return self.pieces[index].min_close(sub) + self.rest[index]

    def first_fit(self, state: tuple, order: list[int], texts: list[str | None], banned: set[int],
                  left: int) -> tuple[int, tuple] | None:
        """The first token of `order` whose text keeps the output a valid prefix that can still close within
        `left` characters, with the state after it; None when no token fits."""
        for token in order:
            text = texts[token]
            if not text or token in banned:
                continue
            nxt = self.feed(state, text)
            if nxt is not None and self.min_close(nxt) <= left:
                return token, nxt
        return None


def vocabulary_texts(tokenizer: Any) -> list[str | None]:
    """Each token id's text (special tokens as written; None where a token is part of a UTF-8 character)."""
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.get_vocab_size())]
    return [None if "\ufffd" in t else t for t in texts]


# ---- the same guide as an EBNF grammar, for TensorRT-LLM's guided decoding (xgrammar / llguidance) ----------
_JSON_RULES = r'''
obj ::= "{" ws ( member ( ws "," ws member )* )? ws "}"
member ::= str ws ":" ws value
value ::= obj | arr | str | num | "true" | "false" | "null"
arr ::= "[" ws ( value ( ws "," ws value )* )? ws "]"
str ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\/bfnrt] )* "\""
num ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [+-]? [0-9]+ )?
ws ::= [ \t\n\r]*
'''


def _literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") \
        .replace("\t", "\\t")
    return f'"{escaped}"'


def _char_class(chars: set[str]) -> str:
    escaped = "".join("\\" + c if c in "]\\^-" else {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c, c)
                      for c in sorted(chars))
    return f"[^{escaped}]"


def _until_rules(name: str, tag: str) -> list[str]:
    """Any text that ends at the first occurrence of `tag`: one rule per KMP state (characters of the tag
    matched so far); a character outside the tag goes back to state 0."""
    def advance(matched: int, ch: str) -> int:
        text = tag[:matched] + ch
        return next(n for n in range(len(text), -1, -1) if tag.startswith(text[len(text) - n:]))
    alphabet = set(tag)
    rules = []
    for state in range(len(tag)):
        options = []
        for ch in sorted(alphabet):
            nxt = advance(state, ch)
            options.append(_literal(ch) if nxt == len(tag) else f"{_literal(ch)} {name}_{nxt}")
        options.append(f"{_char_class(alphabet)} {name}_0")
        rules.append(f"{name}_{state} ::= " + " | ".join(options))
    return rules


def to_ebnf(guide) -> str:
    """hpc.runtime.serve.wire.Guide -> an EBNF grammar (xgrammar's dialect) accepting the same texts."""
    parts, rules = [], []
    for i, piece in enumerate(guide.pieces):
        if piece.kind == "text":
            parts.append(_literal(piece.values[0]))
        elif piece.kind == "choice":
            rules.append(f"p{i} ::= " + " | ".join(_literal(v) for v in piece.values))
            parts.append(f"p{i}")
        elif piece.kind == "until":
            rules += _until_rules(f"u{i}", piece.values[0])
            parts.append(f"u{i}_0")
        else:
            parts.append("obj")
    return "\n".join([f"root ::= {' '.join(parts)}", *rules]) + _JSON_RULES
