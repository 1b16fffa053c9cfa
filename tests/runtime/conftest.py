"""A real local stack per recipe: etcd, NATS, frontend and torch workers as processes."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Callable

import pytest

from hpc.cli.main import main
from hpc.launch.local import stop_local
from hpc.rundir import RunDir, list_runs
from hpc.waiting import wait_until


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(check: Callable[[], object], seconds: float, what: str | Callable[[], str]):
    """check()'s first answer that is neither None nor False within `seconds` (hpc.waiting.wait_until; an OSError
    counts as none: a server starting again); AssertionError naming `what` after."""
    def quiet() -> object:
        try:
            return check()
        except OSError:
            return None
    try:
        return wait_until(quiet, seconds, "")
    except TimeoutError:
        raise AssertionError(f"not within {seconds} s: {what() if callable(what) else what}") from None


class Stack:
    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.manifest = run.manifest()
        self.url = run.frontend_url()
        self.model = self.manifest.recipe.model.served_name


def launch_stack(tmp_path_factory, model_cache: Path, recipe: str, *extra: str) -> Stack:
    runs = tmp_path_factory.mktemp(f"runs-{Path(recipe).stem}")
    os.environ["HPC_RUNS_DIR"] = str(runs)
    model = {"tiny-epd": "tiny-mm", "tiny-video": "tiny-video"}.get(recipe, "tiny")
    code = main(["launch", "-r", recipe, "--no-smoke", "--set", f"frontend.port={free_port()}",
                 "--set", f"model.path={model_cache / model}", *extra])
    (run,) = list_runs()
    if code != 0:
        stop_local(run, 2)
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in run.logs.glob("*.log"))
        pytest.fail(f"launch of {recipe} failed:\n{logs}")
    return Stack(run)


def stack_fixture(recipe: str, *extra: str, env: dict[str, str] | None = None):
    """A module's stack of `recipe`; `env`: variables its processes start with (the test process's own come back
    after the launch)."""
    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory, model_cache):
        with pytest.MonkeyPatch.context() as patch:
            for name, value in (env or {}).items():
                patch.setenv(name, value)
            stack = launch_stack(tmp_path_factory, model_cache, recipe, *extra)
        yield stack
        from hpc.launch.local import alive, local_pids

        pids = [p for group in local_pids(stack.run).values() for p in group]
        assert pids, "the stack's processes were recorded"
        assert main(["cancel", str(stack.run.path), "--grace", "5"]) == 0  # hpc cancel on the local profile
        left = [p for p in pids if alive(p)]
        assert left == [], f"processes left behind: {left}"
        # the run directory stays (its logs, any bench results) unless asked: then it goes once the job stopped
        assert (stack.run.path / "logs").is_dir() and any(stack.run.logs.glob("*.log"))
        assert main(["cancel", str(stack.run.path), "--grace", "5", "--remove"]) == 0
        assert not stack.run.path.exists(), "hpc cancel --remove removes the stopped run's directory"
    return fixture


@pytest.fixture(scope="session")
def tiny(model_cache) -> str:
    """The tiny random-weight model's directory, built once."""
    from hpc.runtime.engine.builds import ensure_model

    return str(ensure_model(str(model_cache / "tiny"), "tiny"))


@pytest.fixture(scope="session")
def tiny_mm(model_cache) -> str:
    """The tiny model with its vision encoder and <|image|> marker, built once."""
    from hpc.runtime.engine.builds import ensure_model

    return str(ensure_model(str(model_cache / "tiny-mm"), "tiny-multimodal"))
