"""Find cluster profiles, recipes and engine configs by name; apply `--set` overrides."""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import yaml

from hpc.errors import UserError
from hpc.spec.base import closest, load_yaml, parse_model
from hpc.spec.cluster import ClusterProfile
from hpc.spec.recipe import Recipe


def project_root() -> Path:
    """The folder holding clusters/, recipes/, engine_configs/ and templates/: the checkout hpc runs from, or
    where a wheel installed them (<prefix>/share/hpc: pyproject.toml's data-files; a --user install's prefix
    too)."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "templates").is_dir():
        return checkout
    for scheme in (sysconfig.get_default_scheme(), sysconfig.get_preferred_scheme("user")):
        shipped = Path(sysconfig.get_path("data", scheme)) / "share" / "hpc"  # the default's data is sys.prefix
        if (shipped / "templates").is_dir():
            return shipped
    return checkout


def search_dirs(kind: str) -> list[Path]:
    """A folder of that name in the working directory first, then the project's own."""
    dirs = [Path.cwd() / kind, project_root() / kind]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def available(kind: str) -> list[str]:
    names = {p.stem for d in search_dirs(kind) for p in d.glob("*.yaml")}
    return sorted(names)


def find(kind: str, name: str) -> Path:
    """A name from `kind`/ (e.g. 'eos'), or a path to a YAML file."""
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml") and as_path.is_file():
        return as_path
    for d in search_dirs(kind):
        candidate = d / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    names = available(kind)
    guess = closest(name, names)
    hint = (f"did you mean '{guess}'? " if guess else "") + f"available: {', '.join(names) or 'none'}"
    singular = kind.rstrip("s")
    raise UserError(f"unknown {singular} '{name}'", hint=hint)


def parse_set(assignments: list[str]) -> list[tuple[list[str], Any]]:
    """`a.b.c=value` pairs; the value is read as a YAML scalar (so 2 is an int, true a bool)."""
    parsed = []
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserError(f"--set {item!r}: expected path.to.key=value", hint="e.g. --set roles.decode.count=2")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        parsed.append((key.split("."), value))
    return parsed


def apply_set(data: dict[str, Any], assignments: list[str]) -> dict[str, Any]:
    """A deep copy of `data` with each `--set` applied (intermediate mappings are created)."""
    result = yaml.safe_load(yaml.safe_dump(data))  # deep copy of plain data
    for path, value in parse_set(assignments):
        node = result
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set {'.'.join(path)}: '{'.'.join(path[: i + 1])}' is not a mapping")
            node = child
        node[path[-1]] = value
    return result


def load_cluster(name: str) -> tuple[ClusterProfile, Path]:
    path = find("clusters", name)
    return parse_model(ClusterProfile, load_yaml(path), file=str(path)), path


def load_recipe(name: str, overrides: list[str] | None = None) -> tuple[Recipe, Path]:
    path = find("recipes", name)
    data = apply_set(load_yaml(path), overrides or [])
    label = str(path) + (" (with --set)" if overrides else "")
    return parse_model(Recipe, data, file=label), path


def resolve_config_path(value: str, recipe_path: Path) -> Path:
    """Engine-config paths are relative to the recipe, then to the project's engine_configs/."""
    candidate = Path(value).expanduser()
    if candidate.is_absolute():
        return candidate
    for base in (recipe_path.parent, recipe_path.parent.parent, Path.cwd(), project_root()):
        if (base / candidate).is_file():
            return (base / candidate).resolve()
    return (recipe_path.parent.parent / candidate).resolve()
