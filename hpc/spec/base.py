"""Strict pydantic base, YAML loading and readable validation errors."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
import re
from typing import Annotated, Any, Mapping, TypeVar, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError, model_validator

from hpc.errors import UserError, UserErrors

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Frozen, and an unknown key is an error; a boolean is never taken for a number (YAML's `yes` is True)."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name) if isinstance(name, str) else None
                if isinstance(value, bool) and field is not None and _wants_number(field.annotation):
                    raise ValueError(f"{name}: expected a number, got the boolean {str(value).lower()} "
                                     "(YAML reads yes/no/on/off as booleans)")
        return data


def _wants_number(annotation: Any) -> bool:
    """int or float (possibly Optional, constrained or beside a literal such as "auto"), and not also bool."""
    args = {get_args(a)[0] if get_origin(a) is Annotated else a
            for a in (getattr(annotation, "__args__", ()) or ())} or {annotation}
    return bool(args & {int, float}) and bool not in args


def check_env_names(value: dict) -> dict:
    for key in value:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"environment variable name {key!r} is not a valid shell name")
    return value


def _single_line(value: str) -> str:
    if any(ord(ch) < 32 for ch in value):
        raise ValueError("must be a single line without control characters")
    return value


# Values that land in #SBATCH lines, which sbatch (not bash) parses line by line.
SingleLine = Annotated[str, AfterValidator(_single_line)]

EnvMap = Annotated[dict[str, str], AfterValidator(check_env_names)]


def closest(word: str, choices: list[str]) -> str | None:
    """The choice `word` was most likely meant to be: a close spelling, or the one choice it abbreviates the way
    engines' flags do (tp, tp_size, moe_ep -> tensor_parallel_size, moe_expert_parallel_size)."""
    match = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if match:
        return match[0]
    stem = word.lower().removesuffix("_size")
    meant = [choice for choice in choices if stem in _abbreviations(choice)]
    if len(meant) > 1 and stem != word.lower():  # pp_size: pipeline_parallel_size, not pp_partition
        meant = [choice for choice in meant if choice.endswith("_size")]
    return meant[0] if len(meant) == 1 else None


def _abbreviations(name: str) -> set[str]:
    """moe_expert_parallel_size -> {"meps", "mep", "moe_ep"}: initials, without the closing "size", and with
    a leading word kept whole."""
    words = [w for w in name.lower().split("_") if w]
    if words and words[-1] == "size":
        words = words[:-1]
    forms = {"".join(w[0] for w in words), "".join(w[0] for w in words) + "s"}
    if len(words) > 2:
        forms.add(words[0] + "_" + "".join(w[0] for w in words[1:]))
    return {form for form in forms if len(form) >= 2}


def load_yaml(path: Path) -> dict[str, Any]:
    """A user's YAML file as a mapping (strict: see hpc/spec/yamlsafe.py)."""
    from hpc.spec.yamlsafe import load_yaml_text, read_text

    data = load_yaml_text(read_text(path), str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError("the file must hold a mapping of keys to values", file=str(path))
    return data


def _model_at(model: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the last key of `loc` (for listing valid keys)."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int) or not (isinstance(current, type) and issubclass(current, BaseModel)):
            continue
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _unwrap(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any) -> Any:
    """The BaseModel inside Optional[X], dict[str, X] or list[X], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _unwrap(arg)
        if found is not None:
            return found
    return None


def parse_model(model: type[M], data: dict[str, Any], *, file: str) -> M:
    """Validate `data` into `model`; every problem becomes one `file: field: message` line."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors: list[UserError] = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = ".".join(str(p) for p in loc) or None
            if err["type"] == "extra_forbidden":
                owner = _model_at(model, loc)
                valid = sorted(owner.model_fields) if owner else []
                guess = closest(str(loc[-1]), valid)
                hint = (f"did you mean '{guess}'? " if guess else "") + f"valid keys: {', '.join(valid)}"
                errors.append(UserError("unknown key", file=file, field=field, hint=hint))
            elif err["type"] == "model_type" and (owner := _model_at(model, (*loc, "_"))) is not None:
                got = err.get("input")
                errors.append(UserError(f"expected a mapping, got {got!r}" if not isinstance(got, list) else
                                        "expected a mapping, got a list", file=file, field=field,
                                        hint=f"its keys: {', '.join(sorted(owner.model_fields))}"))
            elif err["type"] == "missing":
                errors.append(UserError("required key is missing", file=file, field=field,
                                        hint="add it"))
            else:
                msg = err["msg"].removeprefix("Value error, ")
                got = err.get("input")
                if not isinstance(got, (dict, list)):
                    msg += f", got {got!r}"
                errors.append(UserError(msg, file=file, field=field))
        raise (errors[0] if len(errors) == 1 else UserErrors(errors)) from None


def deep_update(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """A new dict: `update` merged over `base`, recursing into mappings present in both."""
    merged = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_update(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged
