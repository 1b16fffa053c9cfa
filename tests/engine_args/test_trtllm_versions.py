"""The TensorRT-LLM versions hpc knows, and `hpc validate` against the version a job will meet."""

from __future__ import annotations


import pytest

from hpc.cli.main import main
from hpc.engine_args import trtllm_versions as tv

pytestmark = pytest.mark.unit
DOC = "docs/guide/trtllm-versions.md"


def test_versions_sort_as_pep_440_and_bad_ones_are_refused():
    order = ["1.1.0rc5", "1.2.0rc6", "1.2.0rc6.post3", "1.2.0", "1.3.0rc1", "1.3.0rc11", "1.4.0rc4"]
    assert sorted(reversed(order), key=tv.version_key) == order
    assert tv.version_key("1.3.0rc11+cu130") == tv.version_key("1.3.0rc11")
    for bad in ("1.3", "v1.3.0", "1.3.0-rc1", "latest", ""):
        with pytest.raises(ValueError, match="not a TensorRT-LLM version"):
            tv.version_key(bad)


@pytest.mark.parametrize("image, versions", [
    ("nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:0.6.1", ("1.1.0rc5",)),
    ("nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:1.1.1", ("1.3.0rc11",)),
    ("nvcr.io#nvidia/ai-dynamo/tensorrtllm-runtime:1.0.0", ("1.3.0rc5.post1",)),  # enroot's form
    ("nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:0.8.1", ("1.2.0rc6.post1", "1.2.0rc6.post2", "1.2.0rc6.post3")),
    ("nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc11", ("1.3.0rc11",)),
    ("nvcr.io/nvidia/tensorrt-llm/release:latest", ()),
    ("nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:9.9.9", ()),
    ("/images/trtllm.sqsh", ()), ("registry:5000/trtllm", ())])
def test_an_images_version_is_known_from_its_tag(image, versions):
    assert tv.versions_of_image(image) == versions


def test_the_target_is_the_asked_then_the_declared_then_the_tags_version():
    image = "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:0.6.1"
    assert tv.target(None, image).versions == ("1.1.0rc5",) and tv.target(None, image).how == "image tag"
    assert tv.target("1.3.0rc11", image).version == "1.3.0rc11"
    assert tv.target("1.3.0rc11", image, asked="1.4.0rc4").how == "asked"
    assert tv.target(None, "/x.sqsh").version is None
    assert tv.target(None, "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:0.8.0").accepts("1.2.0rc6.post2+x")


def test_every_known_version_has_a_field_table_to_check_against():
    for f in tv.known_versions():
        name, version = tv.table_for(f.version)
        assert name == "trtllm-llm-args.json" and version == "1.3.0rc27"


def test_epd_on_a_version_without_embedding_handles_is_one_line_naming_version_and_fix(capsys):
    code = main(["validate", "-c", "eos", "-r", "qwen3-vl-epd", "--trtllm-version", "1.1.0rc5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len([line for line in err if line.startswith("error")]) == 1
    (line,) = [line for line in err if line.startswith("error")]
    assert line.startswith("error: --trtllm-version: --trtllm-version: an encode worker (EPD)")
    assert "DisaggregatedParams.multimodal_embedding_handles" in line and "1.1.0rc5" in line
    assert "use an image with TensorRT-LLM 1.3.0rc13" in line and "Traceback" not in "".join(err)


def test_the_eos_profile_validates_every_trtllm_recipe_on_its_image(capsys):
    assert main(["validate", "-c", "eos", "-r", "qwen3-vl-epd"]) == 0
    assert main(["validate", "-c", "eos", "-r", "gpt-oss-120b-disagg"]) == 0
    err = capsys.readouterr().err
    assert "no field table of TensorRT-LLM 1.3.0rc11" in err  # said, with the table used


@pytest.mark.parametrize("value, says", [("9.9", "not a TensorRT-LLM version"), ("1.9.0", "not a version hpc knows"),
                                         ("1.3.0rc11; id", "not a TensorRT-LLM version")])
def test_a_bad_version_flag_is_one_line_and_exit_2(capsys, value, says):
    assert main(["validate", "-c", "eos", "-r", "deepseek-r1-disagg", "--trtllm-version", value]) == 2
    err = capsys.readouterr().err
    assert says in err and "known: 1.1.0rc5" in err and "Traceback" not in err


def test_a_profile_declaring_a_version_hpc_does_not_know_is_refused(tmp_path, capsys, project_root):
    profile = (project_root / "clusters/eos.yaml").read_text().replace("trtllm_version: 1.3.0rc11",
                                                                      "trtllm_version: 1.9.0")
    path = tmp_path / "mine.yaml"
    path.write_text(profile)
    assert main(["validate", "-c", str(path), "-r", "deepseek-r1-disagg"]) == 2
    err = capsys.readouterr().err
    assert "eos.yaml" not in err and "mine.yaml: trtllm_version: TensorRT-LLM 1.9.0 is not a version hpc knows" in err
    path.write_text(profile.replace("trtllm_version: 1.9.0", "trtllm_version: latest"))
    assert main(["validate", "-c", str(path), "-r", "deepseek-r1-disagg"]) == 2
    assert "trtllm_version" in capsys.readouterr().err


def _cell(verdict: str) -> str:
    """'ok', or what fails in a few words: the DisaggregatedParams field the version lacks, else the key."""
    if verdict == "ok":
        return "ok"
    if "DisaggregatedParams." in verdict:
        return "no: " + verdict.split("DisaggregatedParams.", 1)[1].split(",", 1)[0]
    return "no: " + verdict.split(":", 1)[0]


def _matrix_markdown() -> str:
    from hpc.cli.commands import version_matrix
    from hpc.spec.catalog import available

    versions, rows, _ = version_matrix("eos", available("recipes"))
    lines = ["| recipe | " + " | ".join(versions) + " |", "|" + "---|" * (len(versions) + 1)]
    lines += [f"| {row[0]} | " + " | ".join(_cell(c) for c in row[1:]) + " |" for row in rows]
    return "\n".join(lines)


def test_the_docs_table_of_recipes_and_versions_is_current(project_root, update_golden):
    """docs/guide/trtllm-versions.md's table is what `hpc validate -c eos --all --trtllm-version all` finds
    (rewrite it with pytest --update-golden)."""
    doc = project_root / DOC
    start, end = "<!-- matrix: begin -->\n", "<!-- matrix: end -->"
    text = doc.read_text()
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    table = _matrix_markdown()
    if update_golden:
        doc.write_text(before + start + table + "\n" + end + after)
    assert table in doc.read_text(), f"{DOC} is out of date: run pytest --update-golden"
    assert "| qwen3-vl-epd | no: multimodal_embedding_handles |" in table  # 1.1.0rc5 has no EPD
    assert "| llava-epd | no: multimodal_embedding_handles |" in table
