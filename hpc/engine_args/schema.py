"""Check an engine config against TensorRT-LLM's LLM-API field table, offline.

The table (hpc/data/trtllm-llm-args.json) was extracted from tensorrt_llm/llmapi/llm_args.py; every
model there forbids unknown keys, so we do too, and suggest the closest valid key.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

from hpc.engine_args.cuda_graphs import cross_field_problem
from hpc.errors import UserError
from hpc.spec.base import closest

# TorchLlmArgs declares backend as Literal['pytorch']; '_autodeploy' selects AutoDeploy's own args class.
BACKENDS = ("pytorch", "_autodeploy")
_INTS = {"int", "PositiveInt", "NonNegativeInt", "_StrictPositiveInt", "_StrictNonNegativeInt", "StrictInt"}
_FLOATS = {"float", "NonNegativeFloat", "PositiveFloat"}
_BOUNDS = {"PositiveInt": {"gt": 0}, "_StrictPositiveInt": {"gt": 0}, "NonNegativeInt": {"ge": 0},
           "_StrictNonNegativeInt": {"ge": 0}, "NonNegativeFloat": {"ge": 0}, "PositiveFloat": {"gt": 0}}


BASE_TABLE = "trtllm-llm-args.json"


@lru_cache(maxsize=None)
def field_table(name: str = BASE_TABLE) -> dict[str, Any]:
    """A field table in hpc/data (hpc.engine_args.trtllm_versions says which version each was read from)."""
    text = resources.files("hpc.data").joinpath(name).read_text()
    return json.loads(text)


@lru_cache(maxsize=None)
def _legacy_keys(model: str, table_name: str = BASE_TABLE) -> frozenset[str]:
    table = field_table(table_name)
    speculative = table["unions"]["SpeculativeConfig"]["members"]
    keys = set()
    for owner, entries in table["accepted_legacy_keys"].items():
        applies = owner == model or (owner.startswith("DecodingBaseConfig") and model in speculative)
        if applies:
            keys |= {k for k, text in entries.items() if not str(text).startswith("NOT accepted")}
    for spec in table["models"][model]["fields"].values():
        if spec.get("alias"):
            keys.add(spec["alias"])
    return frozenset(keys)


def _split_args(inner: str) -> list[str]:
    """Split 'A, B[C, D], E' on top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return [p for p in parts if p]


def _generic(type_str: str) -> tuple[str, list[str]]:
    type_str = type_str.strip()
    if "[" in type_str and type_str.endswith("]"):
        head, _, rest = type_str.partition("[")
        return head.strip(), _split_args(rest[:-1])
    return type_str, []


# an enum TensorRT-LLM also takes by member name, any case (its `match` note in the table)
_BY_NAME = "case-insensitive member NAME"


class _Checker:
    def __init__(self, file: str, table_name: str = BASE_TABLE) -> None:
        self.file = file
        self.errors: list[UserError] = []
        self.table_name = table_name
        self.table = field_table(table_name)

    def error(self, path: str, message: str, hint: str | None = None) -> None:
        self.errors.append(UserError(message, file=self.file, field=path, hint=hint))

    def model(self, name: str, data: Any, path: str) -> None:
        if not isinstance(data, dict):
            self.error(path or "(top level)", f"expected a mapping ({name}), got {type(data).__name__}")
            return
        fields = self.table["models"][name]["fields"]
        legacy = _legacy_keys(name, self.table_name)
        for key, value in data.items():
            where = f"{path}.{key}" if path else str(key)
            spec = fields.get(key)
            if spec is None and key in legacy:
                continue  # still accepted by TensorRT-LLM's own validators (aliases, deprecated keys)
            if spec is None:
                guess = closest(str(key), list(fields))
                hint = f"did you mean '{guess}'?" if guess else f"valid keys of {name}: {', '.join(sorted(fields))}"
                self.error(where, f"unknown TensorRT-LLM engine key for {name}", hint)
                continue
            if key == "backend" and name == self.table["top_level_model"]:
                if value not in BACKENDS:
                    self.error(where, f"must be one of {', '.join(BACKENDS)}, got {value!r}")
                continue
            self.value(spec["type"], value, where, spec.get("constraints") or {})

    def value(self, type_str: str, value: Any, path: str, constraints: dict[str, Any]) -> None:
        if not self.matches(type_str, value, path, constraints, report=True):
            self.error(path, f"expected {type_str}, got {value!r}")

    def matches(self, type_str: str, value: Any, path: str, constraints: dict[str, Any],
                report: bool) -> bool:
        """True when `value` fits; nested models report their own errors and count as a fit."""
        table = self.table
        type_str = type_str.strip()
        if " | " in type_str and not type_str.startswith(("Optional[", "Union[", "Literal[")):
            options = [t.strip() for t in type_str.split(" | ")]
            return any(self.matches(t, value, path, constraints, report=False) for t in options) or (
                report and self._first_model(options, value, path))
        head, args = _generic(type_str)
        if type_str in table["type_aliases"] and not type_str.startswith("_DEFAULT"):
            alias = table["type_aliases"][type_str]
            if type_str in _BOUNDS:
                return self._number(value, int, _BOUNDS[type_str] | constraints)
            return self.matches(alias, value, path, constraints, report)
        if head == "Optional":
            return value is None or self.matches(args[0], value, path, constraints, report)
        if head == "Union":
            named = [a for a in args if _BY_NAME in self.table["models"].get(a, {}).get("match", "")]
            if named and "str" in args:  # the str is one of the enum's names (load_format's own validator)
                return self._enum(named[0], value, path, report)
            if any(self.matches(a, value, path, constraints, report=False) for a in args):
                return True
            return report and self._first_model(args, value, path)
        if head == "Literal":
            allowed = [a.strip("'\"") for a in args]
            if isinstance(value, str) and value in allowed:
                return True
            if report:
                self.error(path, f"must be one of {', '.join(allowed)}, got {value!r}")
                return True
            return False
        if head == "Annotated":
            return self.matches(args[0], value, path, constraints, report)
        if head in ("List", "list", "Set", "set", "tuple", "Tuple"):
            if not isinstance(value, list):
                return False
            inner = args[0] if args and head not in ("tuple", "Tuple") else "Any"
            return all(self.matches(inner, v, f"{path}[{i}]", {}, report) for i, v in enumerate(value))
        if head in ("Dict", "dict"):
            return isinstance(value, dict)
        if type_str in _INTS:
            return self._number(value, int, _BOUNDS.get(type_str, {}) | constraints)
        if type_str in _FLOATS:
            return self._number(value, (int, float), _BOUNDS.get(type_str, {}) | constraints)
        if type_str == "bool":
            return isinstance(value, bool)
        if type_str in ("str", "Path"):
            return isinstance(value, str)
        if table["models"].get(type_str, {}).get("kind") == "enum":
            return self._enum(type_str, value, path, report)
        if type_str in table["models"]:
            if not isinstance(value, dict):
                return False
            if report:
                self.model(type_str, value, path)
            return True
        if type_str in table["unions"]:
            return self.union(type_str, value, path, report)
        return True  # enums from elsewhere, object, Any: TensorRT-LLM itself checks them

    def _enum(self, name: str, value: Any, path: str, report: bool) -> bool:
        """By value, as pydantic validates an enum field (a YAML `true` is not the value 1); by member name too,
        any case, where TensorRT-LLM's own validator takes names (load_format)."""
        spec = self.table["models"][name]
        by_name = _BY_NAME in spec.get("match", "")
        fits = not isinstance(value, bool) and value in spec["enum"]
        if not fits and by_name and isinstance(value, str):
            fits = value.upper() in spec["members"]
        if fits or not report:
            return fits
        choices = [name.lower() for name in spec["members"]] if by_name else spec["enum"]
        self.error(path, f"must be one of {', '.join(map(str, choices))}, got {value!r}")
        return True

    def _first_model(self, options: list[str], value: Any, path: str) -> bool:
        """For Optional[Model] style unions, descend into the first model to report precise errors."""
        for option in options:
            if option in self.table["models"] or option in self.table["unions"]:
                return self.matches(option, value, path, {}, report=True)
        return False

    def union(self, name: str, value: Any, path: str, report: bool) -> bool:
        if not isinstance(value, dict):
            return False
        union = self.table["unions"][name]
        key = union["discriminator"]
        choices = union["values"]
        tag = value.get(key)
        if tag is None and name == "CudaGraphConfigType":
            tag = "decode"  # a plain cuda_graph_config is the decode variant
        if tag not in choices:
            if report:
                self.error(f"{path}.{key}", f"must be one of {', '.join(choices)}, got {tag!r}")
            return True
        if report:
            self.model(choices[tag], {k: v for k, v in value.items() if k != key or key in
                                      self.table["models"][choices[tag]]["fields"]}, path)
        return True

    @staticmethod
    def _number(value: Any, kind: Any, bounds: dict[str, Any]) -> bool:
        if isinstance(value, bool) or not isinstance(value, kind):
            return False
        checks = {"gt": value > bounds.get("gt", float("-inf")), "ge": value >= bounds.get("ge", float("-inf")),
                  "lt": value < bounds.get("lt", float("inf")), "le": value <= bounds.get("le", float("inf"))}
        return all(checks.values())


def check_engine_config(config: dict[str, Any], *, file: str, table_name: str = BASE_TABLE) -> list[UserError]:
    """Every problem in `config` (unknown keys, wrong types, bad enum values), as user errors, against the field
    table of the TensorRT-LLM version the job will run (trtllm_versions.table_for)."""
    checker = _Checker(file, table_name)
    checker.model(checker.table["top_level_model"], config, "")
    problem = cross_field_problem(config.get("cuda_graph_config")) if isinstance(config, dict) else None
    if problem:  # TensorRT-LLM's model validator would refuse it at engine start
        checker.error("cuda_graph_config", problem,
                      hint="drop max_batch_size, which follows batch_sizes, or make the two agree")
    return checker.errors
