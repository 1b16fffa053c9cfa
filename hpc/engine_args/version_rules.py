"""What a recipe needs of the TensorRT-LLM its job will meet, checked before anything is submitted.

The version comes from the cluster profile (hpc.engine_args.trtllm_versions.target); a feature the recipe uses
that the version is known to lack is one error naming the version and the first known version that has it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpc.engine_args import trtllm_versions as tv
from hpc.errors import UserError

# Qwen-VL's rotary positions depend on the image grid: EPD carries them from the encoder to prefill and decode
# (upstream DisaggregatedParams.mrope_position_ids_handle / mrope_position_deltas_handle)
MROPE_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")


@dataclass
class VersionCheck:
    target: tv.Target
    table_name: str
    table_version: str
    errors: list[UserError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _where(t: tv.Target) -> str:
    return {"asked": "--trtllm-version", "declared": "trtllm_version",
            "image tag": "container.image"}.get(t.how, "trtllm_version")


def check_version(declared: str | None, image: str | None, asked: str | None, *, cluster_file: str,
                  encode_role: bool, model_config: dict[str, Any] | None) -> VersionCheck:
    """The target version, the field table its engine configs are checked against, and what it cannot run."""
    t = tv.target(declared, image, asked)
    source = "--trtllm-version" if t.how == "asked" else cluster_file
    known = ", ".join(f.version for f in tv.known_versions())
    if t.version is not None and tv.facts(t.version) is None:
        error = UserError(f"TensorRT-LLM {t.version} is not a version hpc knows", file=source, field=_where(t),
                          hint=f"known: {known}; or leave trtllm_version out, and the job's environment is "
                               f"taken as it is")
        return VersionCheck(t, *tv.table_for(None), errors=[error])
    table_name, table_version = tv.table_for(t.version)
    check = VersionCheck(t, table_name, table_version)
    if t.version is None:
        check.warnings.append(
            f"the TensorRT-LLM version of {image or 'the nodes'} is not known: engine configs are checked against "
            f"the field table of {table_version}; set trtllm_version in {cluster_file} to have it "
            f"checked, and held to, in the job")
        return check
    if table_version != t.version:
        check.warnings.append(f"hpc has no field table of TensorRT-LLM {t.version}: engine configs are checked "
                              f"against {table_version}'s ({tv.base_table()['note']})")
    facts = tv.facts(t.version)
    assert facts is not None
    needs = []
    if encode_role:
        needs.append(("multimodal_embedding_handles", "an encode worker (EPD) hands its embeddings to prefill"))
    model_type = (model_config or {}).get("model_type")
    if encode_role and model_type in MROPE_MODEL_TYPES:
        needs.append(("mrope_position_ids_handle", f"{model_type} under EPD carries its M-RoPE positions"))
    for name, why in needs:
        if facts.lacks(name) and facts.disaggregated_params is not None:  # lacks() says so only of a known table
            newer = tv.first_with(lambda f, n=name: f.disaggregated_params is not None
                                  and n in f.disaggregated_params.fields, after=t.version)
            check.errors.append(UserError(
                f"{why} in DisaggregatedParams.{name}, which TensorRT-LLM {t.version} does not have "
                f"({facts.disaggregated_params.source})", file=source, field=_where(t),
                hint=f"use an image with TensorRT-LLM {newer} or later" if newer else "use a newer image"))
    return check
