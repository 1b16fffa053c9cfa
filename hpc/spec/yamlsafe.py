"""YAML for user files, read defensively: size, encoding, nesting and alias limits before anything is built,
duplicate keys as errors. Each problem is a UserError naming the file and, where known, the line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from hpc.errors import UserError

MAX_BYTES = 1 << 20  # 1 MiB: the largest real recipe or engine config is a few KiB
MAX_DEPTH = 32
MAX_NODES = 100_000  # after alias expansion: a "billion laughs" file stops here
MAX_ALIASES = 200


class _Loader(yaml.SafeLoader):
    """SafeLoader that counts what aliases expand to and refuses duplicate keys."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._depth = 0

    def compose_node(self, parent, index):  # noqa: ANN001 - PyYAML's signature
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _Limit(f"more than {MAX_ALIASES} YAML aliases", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Limit(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (dict, list)):
                raise _Limit("a mapping key must be a plain value", key_node.start_mark)
            if key in seen:
                raise _Limit(f"duplicate key {key!r} (first at line {seen[key].line + 1})", key_node.start_mark,
                             hint="keep one of them: YAML would silently use the last")
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


class _Limit(Exception):
    def __init__(self, message: str, mark, hint: str = "simplify the YAML") -> None:  # noqa: ANN001
        super().__init__(message)
        self.message, self.mark, self.hint = message, mark, hint


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _Loader.construct_mapping)


def _count_nodes(data: Any, limit: int) -> int:
    """Nodes of the constructed value, aliases expanded (shared objects counted each time), up to `limit`."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > limit:
            return count
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def read_text(path: Path, what: str = "file") -> str:
    """The file as UTF-8 text, refusing huge, binary and non-UTF-8 files with one clear line."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise UserError(f"{what} is {size / 2**20:.1f} MiB; the limit is {MAX_BYTES >> 20} MiB", file=str(path),
                            hint="is this the right file?")
        data = path.read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read: {exc.strerror or exc}", file=str(path)) from None
    if b"\0" in data:
        raise UserError(f"{what} is binary, not YAML text", file=str(path), hint="is this the right file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise UserError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line})", file=str(path),
                        hint="save the file as UTF-8") from None


def load_yaml_text(text: str, file: str) -> Any:
    loader = _Loader(text)
    try:
        data = loader.get_single_data()
    except _Limit as exc:
        raise UserError(exc.message, file=file, field=f"line {exc.mark.line + 1}", hint=exc.hint) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else None
        raise UserError(f"not valid YAML: {getattr(exc, 'problem', None) or exc}", file=file, field=where,
                        hint="fix the YAML syntax") from None
    except RecursionError:
        raise UserError(f"nested deeper than {MAX_DEPTH} levels", file=file, hint="simplify the YAML") from None
    finally:
        loader.dispose()
    if _count_nodes(data, MAX_NODES) > MAX_NODES:
        raise UserError(f"expands to more than {MAX_NODES} values (YAML aliases?)", file=file,
                        hint="write the values out instead of repeating aliases")
    return data
