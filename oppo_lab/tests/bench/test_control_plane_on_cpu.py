"""`python -m oppo_lab control-plane --smoke` on real Ray: the real samples generator against
synthetic engines and scorers, scaled down to seconds. Asserts behaviour, not speed."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    from oppo_lab.control_plane import main

    out = tmp_path_factory.mktemp("control-plane")
    code = main(["--smoke", "--chunk", "16", "4", "--no-progress", "--output", str(out)])
    return code, json.loads((out / "control_plane.json").read_text())


def test_every_samples_tokens_reach_the_scorer_exactly_once_and_in_order(smoke):
    code, report = smoke
    assert code == 0
    w = report["workload"]
    for run in report["runs"]:
        checks = run["checks"]
        assert checks["samples"] == w["prompts"] * w["samples"] == checks["samples_exact"]
        assert checks["scorer_errors"] == 0 and checks["missing_samples"] == []
        assert run["tokens"] == checks["emitted_tokens"] == checks["scored_tokens"] == checks["expected_tokens"]
        assert run["experiences"] == checks["samples"]
        assert checks["rewards_exact"] == checks["samples"]  # each trained sample's reward: its scorer's count


def test_figures_come_from_the_measurements(smoke):
    _, report = smoke
    w = report["workload"]
    for run in report["runs"]:
        lag, chunk_lag = run["lag_ms"], run["chunk_lag_ms"]
        assert 0 <= lag["min"] <= lag["p50"] <= lag["p95"] <= lag["max"]
        assert 0 <= chunk_lag["min"] and chunk_lag["max"] <= lag["max"]
        calls = run["calls"]
        assert calls["start_samples"] == w["engines"] and calls["open_many"] <= w["scorers"]
        assert calls["next_outputs"] >= 1 and calls["process"] >= 1
        assert run["ray_messages"] == 2 * sum(calls.values())
        assert run["driver_cpu_s"] > 0 and run["driver_cores"] > 0 and run["stream_s"] > 0
        assert 0 < run["driver_main_thread_cpu_s"] <= run["driver_cpu_s"]
        assert run["driver_deltas"] >= run["checks"]["samples"]  # a finished sample's last delta at least
        assert run["target_tokens_per_s"] == w["engines"] * w["sequences"] * w["tokens_per_s"]


def test_ray_is_shut_down_after_the_bench(smoke):
    import ray

    assert not ray.is_initialized()
