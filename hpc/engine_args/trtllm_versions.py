"""The TensorRT-LLM versions hpc knows: which image ships which, and what each version is known to take.

A job meets the TensorRT-LLM of its image, not the one hpc was written against. The cluster profile declares it
(trtllm_version) or hpc knows it from the image's tag (hpc/data/trtllm-versions.json: Dynamo's runtime
images, NGC's release images); `hpc validate` checks engine configs against that version's field table, and the
job's preflight ends the job before any server starts when the image holds another version.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

# a +local part (1.3.0rc11+cu130) is ignored
_PARTS = re.compile(r"^([0-9]+)\.([0-9]+)\.([0-9]+)(?:(a|b|rc)([0-9]+))?(?:\.post([0-9]+))?(?:\.dev([0-9]+))?$")
_PRE = {"a": 0, "b": 1, "rc": 2, None: 3}


def version_key(version: str) -> tuple[int, ...]:
    """A sort key: 1.2.0rc6 < 1.2.0rc6.post3 < 1.2.0 < 1.3.0rc1. ValueError when it is not such a version."""
    m = _PARTS.match(version.split("+", 1)[0].strip())
    if not m:
        raise ValueError(f"not a TensorRT-LLM version: {version!r} (e.g. 1.3.0rc11 or 1.2.0rc6.post3)")
    major, minor, micro, pre, pre_n, post, dev = m.groups()
    return (int(major), int(minor), int(micro), _PRE[pre], int(pre_n or 0), int(post or 0),
            -1 if dev is None else int(dev))


def release(version: str) -> str:
    """The version without a local part: what a table entry is keyed by (1.3.0rc11+hpcfake -> 1.3.0rc11)."""
    return version.split("+", 1)[0].strip()


@dataclass(frozen=True)
class DisaggFields:
    """DisaggregatedParams' fields in one version; `complete` says the list is the whole class."""

    fields: frozenset[str]
    complete: bool
    source: str


@dataclass(frozen=True)
class VersionFacts:
    version: str
    llm_args_table: str | None  # a field table read from this version's llm_args.py, when there is one
    disaggregated_params: DisaggFields | None
    notes: tuple[str, ...] = ()

    def lacks(self, field: str) -> bool:
        """True only where this version is known not to have the DisaggregatedParams field."""
        d = self.disaggregated_params
        return d is not None and d.complete and field not in d.fields


@lru_cache(maxsize=1)
def _data() -> dict[str, Any]:
    return json.loads(resources.files("hpc.data").joinpath("trtllm-versions.json").read_text())


@lru_cache(maxsize=1)
def known_versions() -> tuple[VersionFacts, ...]:
    """Every version hpc knows, oldest first."""
    out = []
    for entry in _data()["versions"]:
        d = entry.get("disaggregated_params")
        out.append(VersionFacts(
            version=entry["version"], llm_args_table=entry.get("llm_args_table"),
            disaggregated_params=None if d is None else DisaggFields(frozenset(d["fields"]), d["complete"],
                                                                      d["source"]),
            notes=tuple(entry.get("notes", ()))))
    return tuple(sorted(out, key=lambda f: version_key(f.version)))


def base_table() -> dict[str, str]:
    return dict(_data()["base_table"])


def facts(version: str) -> VersionFacts | None:
    wanted = release(version)
    return next((f for f in known_versions() if f.version == wanted), None)


def table_for(version: str | None) -> tuple[str, str]:
    """(field-table file, the version it was read from) to check engine configs for `version`: its own table,
    else the base table (hpc's one table read field by field)."""
    own = facts(version) if version else None
    if own is not None and own.llm_args_table:
        return own.llm_args_table, own.version
    base = base_table()
    return base["file"], base["version"]


def versions_of_image(image: str) -> tuple[str, ...]:
    """The TensorRT-LLM versions an image is known to ship (several where its tag spans patch releases), or ()."""
    images = _data()["images"]
    repository, _, tag = image.rpartition(":")
    if not repository or "/" in tag:  # no tag (a squashfs path, or a registry port without one)
        return ()
    repository = repository.split("#", 1)[-1].replace("nvcr.io#", "nvcr.io/")  # enroot's registry#image form
    if repository.startswith("nvidia/"):
        repository = "nvcr.io/" + repository
    known = images["repositories"].get(repository, {})
    if tag in known:
        return tuple(known[tag])
    if repository in images["tag_is_version"]:
        try:
            version_key(tag)
        except ValueError:
            return ()
        return (release(tag),)
    return ()


@dataclass(frozen=True)
class Target:
    """The TensorRT-LLM a job will meet, and how hpc knows it."""

    versions: tuple[str, ...]  # empty: not known
    how: str  # "declared" (the profile's trtllm_version), "image tag", "asked" (--trtllm-version), "unknown"

    @property
    def version(self) -> str | None:
        """The one version checks read tables for: the newest the image may hold."""
        return max(self.versions, key=version_key) if self.versions else None

    def accepts(self, found: str) -> bool:
        return release(found) in self.versions

    def describe(self) -> str:
        return " or ".join(self.versions) if self.versions else "unknown"


def target(declared: str | None, image: str | None, asked: str | None = None) -> Target:
    if asked:
        return Target((release(asked),), "asked")
    if declared:
        return Target((release(declared),), "declared")
    from_tag = versions_of_image(image) if image else ()
    if from_tag:
        return Target(from_tag, "image tag")
    return Target((), "unknown")


def first_with(check: Any, after: str | None = None) -> str | None:
    """The oldest known version for which `check(facts)` holds (newer than `after`), or None."""
    for f in known_versions():
        if after is not None and version_key(f.version) <= version_key(after):
            continue
        if check(f):
            return f.version
    return None
