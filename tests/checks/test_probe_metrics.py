"""hpc.checks.probe's readers of Prometheus text: a metric's samples summed, or summed per value of one label."""

from __future__ import annotations

import pytest

from hpc.checks.probe import metric_by_label, metric_values

pytestmark = pytest.mark.unit

TEXT = """# TYPE hpc_frontend_process_requests_total counter
hpc_frontend_process_requests_total{run="r",process="0"} 3.0
hpc_frontend_process_requests_total{run="r",process="1"} 5.0
hpc_frontend_process_requests_total{run="s",process="1"} 2.0
hpc_frontend_process_requests_total_created{process="1"} 99.0
hpc_frontend_process_requests_total 7.0
hpc_frontend_processes 2
"""


def test_a_metrics_samples_per_label_value_leave_out_other_names_and_unlabelled_samples():
    assert metric_by_label(TEXT, "hpc_frontend_process_requests_total", "process") == {"0": 3.0, "1": 7.0}
    assert metric_by_label(TEXT, "hpc_frontend_process_requests_total", "run") == {"r": 8.0, "s": 2.0}
    assert metric_by_label(TEXT, "hpc_frontend_processes", "process") == {}
    assert metric_values(TEXT, "hpc_frontend_process_requests_total") == 17.0
