"""benchmarks/decode_graph_kernels.py: kernel names shortened, times per replay, the table, bad arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import decode_graph_kernels as dgk  # noqa: E402

pytestmark = pytest.mark.unit

ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
               "std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)")


def test_kernel_names_lose_namespaces_templates_and_parameters():
    assert dgk.short_name(ELEMENTWISE) == "vectorized_elementwise_kernel"
    assert dgk.short_name("_gemv_kernel") == "_gemv_kernel"
    assert dgk.short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"
    # hostile: newlines, quotes, a shell substitution, unbalanced brackets; one line, never longer than the column
    for name in ("a\nb'c\"$(reboot)`id`", "x<<<" * 40, "f(((", ">>)) g"):
        short = dgk.short_name(name)
        assert "\n" not in short and len(short) <= dgk.NAME_WIDTH, short


def test_times_are_per_replay_and_names_that_shorten_alike_add_up():
    kernels = {ELEMENTWISE: (500.0, 100), ELEMENTWISE.replace("add", "mul"): (300.0, 50), "_gemv_kernel": (1000.0, 250)}
    assert dgk.per_replay(kernels, 50) == {"vectorized_elementwise_kernel": (16.0, 3.0), "_gemv_kernel": (20.0, 5.0)}


def test_the_table_orders_kernels_by_the_largest_size_and_sums_them():
    kernels = {1: {"gemv": (20.0, 5.0), "pick": (3.0, 1.0)},
               64: {"gemv": (60.0, 5.0), "attention": (80.0, 2.0), "pick": (10.0, 1.0)}}
    lines = dgk.table([1, 64], kernels, {1: 30.0, 64: 190.0})
    assert [line.split()[0] for line in lines[1:4]] == ["attention", "gemv", "pick"]
    assert lines[1].split()[1] == "-"  # no attention kernel at one row
    assert lines[2].split()[1:] == ["20.0", "(5)", "60.0", "(5)"]
    assert lines[-2].split()[-2:] == ["23.0", "150.0"] and lines[-1].split()[-2:] == ["30.0", "190.0"]


@pytest.mark.parametrize("argv", [["--sizes", "1,'$(x)'"], ["--replays", "0"]])
def test_bad_arguments_are_one_line_and_exit_2(argv):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "decode_graph_kernels.py"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and argv[0] in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
