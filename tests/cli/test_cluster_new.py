"""`hpc cluster new` as a careless or hostile user drives it: names that are paths or shell, an --out that is a
link, a missing directory or too long, an image or mount that pyxis would misread. Each is one line, exit 2,
nothing written (and nothing written anywhere a link points)."""

from __future__ import annotations

import os

import pytest

from hpc.cli.main import main
from hpc.slurm.probe import ClusterFacts, PartitionFacts

pytestmark = pytest.mark.unit

FACTS = ClusterFacts(partition=PartitionFacts("batch", 4, 64, 8, "04:00:00", None, 1), mpi_plugins=["pmix"],
                     pyxis=True, select_type="select/cons_tres")


@pytest.fixture
def probed(monkeypatch):
    """The cluster's answers, without a cluster: what sinfo and srun said on a login node."""
    import hpc.slurm.probe

    monkeypatch.setattr(hpc.slurm.probe, "probe", lambda runner, partition: FACTS)


def _refused(capsys, argv: list[str], says: str) -> None:
    assert main(["cluster", "new", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name", ["../../etc/evil", "$(id)", "a b", "-x", ".hidden", "x" * 65, "name\nnext", ""])
def test_a_name_that_is_not_a_profile_name_is_refused(probed, tmp_path, capsys, name):
    _refused(capsys, ["-p", "batch", "--out", str(tmp_path / "p.yaml"), "--", name], "is not a profile name")
    assert not (tmp_path / "p.yaml").exists()


def test_out_through_a_dangling_link_writes_nothing_where_it_points(probed, tmp_path, capsys):
    target = tmp_path / "elsewhere" / "owned"
    (tmp_path / "elsewhere").mkdir()
    link = tmp_path / "p.yaml"
    link.symlink_to(target)
    _refused(capsys, ["mine", "-p", "batch", "--out", str(link)], "does not overwrite (nor write through a link)")
    assert not target.exists()


@pytest.mark.parametrize("out, says", [("missing/dir/p.yaml", "is not a directory"),
                                       ("x" * 300 + ".yaml", "too long for a path")])
def test_an_out_that_cannot_be_a_new_file_is_one_line(probed, tmp_path, capsys, out, says):
    _refused(capsys, ["mine", "-p", "batch", "--out", str(tmp_path / out)], says)


@pytest.mark.parametrize("flags, says", [
    (["--image", "/images/a.sqsh\n--container-remap-root"], "container.image"),
    (["--image", "/images/a.sqsh", "--mount", "/models"], "is not SRC:DST[:FLAGS]"),
    (["--image", "/images/a.sqsh", "--mount", "/a:/b,/etc:/etc"], "is not SRC:DST[:FLAGS]"),
    (["--image", "/images/a.sqsh", "--mount", "models:/models"], "both paths absolute"),
    (["--image", "/images/a.sqsh", "--mount", "/a:/b:ro;id"], "is not SRC:DST[:FLAGS]"),
])
def test_an_image_or_mount_pyxis_would_misread_is_one_line_and_nothing_written(probed, tmp_path, capsys, flags, says):
    out = tmp_path / "p.yaml"
    _refused(capsys, ["mine", "-p", "batch", *flags, "--out", str(out)], says)
    assert not out.exists()


def test_a_good_profile_is_written_once_and_never_over_itself(probed, tmp_path, capsys):
    out = tmp_path / "mine.yaml"
    argv = ["cluster", "new", "mine", "-p", "batch", "--image", "/images/trtllm.sqsh",
            "--mount", "/lustre/models:/models:ro", "--out", str(out)]
    assert main(argv) == 0 and "name: \"mine\"" in out.read_text()
    assert oct(os.stat(out).st_mode & 0o777) == "0o644"
    _refused(capsys, argv[2:], "exists; hpc cluster new does not overwrite")
    assert main(["validate", "-c", str(out), "-r", "tiny-agg"]) == 0
