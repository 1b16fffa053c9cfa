"""Dynamo's engine-argument flags on hpc's command line: `--extra-engine-args [ROLE=]PATH` and
`--override-engine-args [ROLE=]JSON`, repeatable; no ROLE means every role of the recipe.

They feed the same two layers of the precedence chain as the recipe fields `engine_config` and
`override_engine_args`: a PATH replaces the role's engine config file, a JSON object is merged over the role's
override (later flags win). The checks and messages downstream are the recipe fields' own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc.engine_args.precedence import deep_update
from hpc.errors import UserError
from hpc.spec.recipe import Recipe

# the errors name the flag as their `field`, which UserError puts first: their messages leave it out
EXTRA_FLAG, OVERRIDE_FLAG = "--extra-engine-args", "--override-engine-args"


@dataclass(frozen=True)
class EngineArgFlags:
    extra: list[str] = field(default_factory=list)
    override: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.extra or self.override)


def _split(flag: str, value: str, roles: list[str]) -> tuple[list[str], str]:
    """'decode=x' -> (['decode'], 'x'); 'x' -> (every role, 'x'). JSON and paths may hold '=' themselves."""
    head, sep, rest = value.partition("=")
    if sep and head and not head.lstrip().startswith("{") and "/" not in head and "." not in head:
        name = "agg" if head == "aggregated" else head
        if name not in roles:
            known = ", ".join(roles)
            raise UserError(f"{value!r}: the recipe has no role {head!r} (its roles: {known})",
                            field=flag, hint=f"write {flag} ROLE=... with ROLE one of {known}, or leave ROLE out "
                                             "to apply it to every role")
        return [name], rest
    return roles, value


def apply_engine_flags(recipe: Recipe, flags: EngineArgFlags) -> tuple[Recipe, dict[str, str]]:
    """The recipe with the flags applied, and for each role whose override came from a flag, that flag's text
    (so an error in it names the flag, not the recipe)."""
    roles = [name.value for name, _ in recipe.roles.items()]
    updates: dict[str, dict[str, Any]] = {r: {} for r in roles}
    sources: dict[str, str] = {}
    for value in flags.extra:
        targets, path_text = _split(EXTRA_FLAG, value, roles)
        if not path_text:
            raise UserError(f"{value!r} names no file", field=EXTRA_FLAG,
                            hint=f"{EXTRA_FLAG} [ROLE=]PATH, e.g. {EXTRA_FLAG} decode=decode.yaml")
        path = Path(path_text).expanduser().resolve()
        if not path.is_file():
            raise UserError(f"engine config not found: {path}", field=EXTRA_FLAG,
                            hint="fix the path (relative to the current directory)")
        for role in targets:
            updates[role]["engine_config"] = str(path)
    for value in flags.override:
        targets, text = _split(OVERRIDE_FLAG, value, roles)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"{value!r}: malformed JSON ({exc.msg} at column {exc.colno})",
                            field=OVERRIDE_FLAG, hint="pass a JSON object such as '{\"max_batch_size\": 64}'") from None
        if not isinstance(data, dict):
            raise UserError(f"{value!r}: must be a JSON object", field=OVERRIDE_FLAG,
                            hint="pass a JSON object such as '{\"max_batch_size\": 64}'")
        for role in targets:
            spec = getattr(recipe.roles, role)
            base = updates[role].get("override_engine_args", spec.override_engine_args or {})
            updates[role]["override_engine_args"] = deep_update(base, data)
            sources[role] = f"{OVERRIDE_FLAG} {value}"
    new_roles = {r: getattr(recipe.roles, r).model_copy(update=u) for r, u in updates.items() if u}
    if not new_roles:
        return recipe, sources
    return recipe.model_copy(update={"roles": recipe.roles.model_copy(update=new_roles)}), sources
