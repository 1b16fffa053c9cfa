"""Shared fixtures: hostile inputs, project paths, the golden-update flag."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Triton kernels run on CPU through its interpreter; it must be chosen before Triton is first imported.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Launches remember their runs directories in the user's XDG state (hpc.rundir.known_roots): never the real one's.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="hpc-tests-state-")

# Values that would run commands if anything reached the shell unquoted.
HOSTILE = [
    "with space",
    "single'quote",
    'double"quote',
    "$(touch PWNED_subst)",
    "`touch PWNED_tick`",
    "x; touch PWNED_semi",
    "line\ntouch PWNED_newline",
    "$HOME ${PATH} \\ * ? [a]",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/*.sbatch from the current templates")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


@pytest.fixture
def weird_tmp_path(tmp_path: Path) -> Path:
    """A directory whose name has spaces, quotes, `$(...)` and a newline."""
    path = tmp_path / "we ird 'q' \"dq\" $(touch PWNED) `x`\nnl"
    path.mkdir()
    return path


@pytest.fixture
def one_step_a_replay(monkeypatch) -> None:
    """Decode graphs that run one step a replay (torch_engine.decode_steps_per_graph 1): for tests that count an
    engine's steps or replays as tokens; tests/runtime/test_decode_multi_step.py covers several steps a replay."""
    from hpc.runtime.engine.torch import engine
    from hpc.spec.recipe import TorchEngineSpec

    monkeypatch.setattr(engine, "DEFAULT_SWITCHES", TorchEngineSpec(decode_steps_per_graph=1))


@pytest.fixture(autouse=True)
def own_state_dir(tmp_path_factory, monkeypatch) -> None:
    """Each test its own XDG state: runs directories one test's launches remember are not another's to find."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))


@pytest.fixture
def project_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Models are built once per session (a few seconds each) under a shared directory."""
    path = Path(os.environ.get("HPC_TEST_MODELS", tmp_path_factory.mktemp("models")))
    return path
