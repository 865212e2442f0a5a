"""A run's processes by name (openrlhf_oppo.bench.processes): Ray actors by their title, a
Python module by `-m`, a script by its file, a daemon by its executable."""

from __future__ import annotations

import pytest

from openrlhf_oppo.bench import processes


@pytest.mark.parametrize("cmdline, name", [
    (["ray::OppoRolloutActor.next_outputs"], "ray::OppoRolloutActor"),
    (["ray::StreamingRewardActor", "", ""], "ray::StreamingRewardActor"),
    (["ray::IDLE"], "ray::IDLE"),
    (["VLLM::EngineCore"], "VLLM::EngineCore"),
    (["/usr/lib/ray/core/src/ray/raylet/raylet", "--node_ip_address=1.2.3.4"], "raylet"),
    (["/usr/bin/python3.11", "-m", "openrlhf_oppo.cli.train_ppo_ray", "--x"], "openrlhf_oppo.cli.train_ppo_ray"),
    (["/usr/bin/python", "-u", "/site/ray/_private/log_monitor.py", "--a"], "log_monitor.py"),
    (["ray-dashboard-ReportHead-0 (/usr/bin/python -B -c from multiprocessing.spawn import spawn_main)"],
     "ray-dashboard-ReportHead-0"),
    (["python", "-c", "from multiprocessing.spawn import spawn_main"], "python -c (multiprocessing)"),
    ([], "fallback"),
])
def test_process_name(cmdline, name):
    assert processes.process_name(cmdline, "fallback") == name
