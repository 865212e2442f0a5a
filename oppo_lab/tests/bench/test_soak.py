"""`python -m oppo_lab soak`: process names, growth per 100 steps, KV summary, run sizing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from oppo_lab import soak


def _rows():
    """Sweeps every 2 steps to step 100: a flat process (start-up ramp to 500 MB by step 5),
    a leaking one (+3 MB a step), a pooled worker that becomes an actor, one that dies at step 10."""
    rows = []
    for i, step in enumerate(range(0, 101, 2)):
        t = 1000.0 + i
        rows.append({"t": t, "pid": 1, "name": "raylet", "rss_mb": 100.0 + 400.0 * min(step, 5) / 5, "step": step})
        rows.append({"t": t, "pid": 2, "name": "openrlhf_oppo.cli.train_ppo_ray", "rss_mb": 300.0 + 3.0 * step,
                     "step": step})
        rows.append({"t": t, "pid": 3, "name": "ray::IDLE" if step < 4 else "ray::StreamingRewardActor",
                     "rss_mb": 200.0, "step": step})
        if step <= 10:
            rows.append({"t": t, "pid": 4, "name": "ray::IDLE", "rss_mb": 80.0, "step": step})
    return rows


def test_growth_per_100_steps_from_10_percent_of_the_run_to_the_end():
    summary = soak.summarize(_rows())
    by_pid = {p["pid"]: p for p in summary["processes"]}
    assert (summary["steps"], summary["measured_to_step"]) == (100, 98)  # the last step's sweeps: teardown
    flat = by_pid[1]
    assert (flat["rss_early_mb"], flat["rss_end_mb"], flat["growth_mb_per_100_steps"]) == (500.0, 500.0, 0.0)
    leak = by_pid[2]
    assert leak["rss_early_mb"] == 300.0 + 3 * 10 and leak["rss_end_mb"] == 300.0 + 3 * 98
    assert leak["growth_mb_per_100_steps"] == pytest.approx(300.0)
    assert leak["late_growth_mb_per_100_steps"] == pytest.approx(300.0)  # linear: as fast late as early
    assert flat["late_growth_mb_per_100_steps"] == 0.0
    assert by_pid[3]["name"] == "ray::StreamingRewardActor [3]"  # the idle worker became the actor
    assert by_pid[4]["growth_mb_per_100_steps"] is None  # alive for 10 of 100 steps: no rate
    assert [p["pid"] for p in summary["processes"]] == [2, 1, 3, 4]  # largest at the end first
    assert summary["total"]["growth_mb_per_100_steps"] == pytest.approx(300.0 - 80.0 * 100 / 88, rel=1e-6)


def test_sweeps_after_the_last_step_are_left_out():
    rows = _rows() + [{"t": 2000.0, "pid": 1, "name": "raylet", "rss_mb": 10.0, "step": 100}]  # torn down
    summary = soak.summarize(rows)
    assert summary["total"]["rss_end_mb"] == 500.0 + 594.0 + 200.0
    assert {p["pid"]: p["rss_end_mb"] for p in summary["processes"]}[1] == 500.0


def test_kv_summary_max_vs_budget():
    kv_rows = [{"global_step": s, soak.KV_KEY: float(100 + (s % 7) * 10), soak.KV_BUDGET_KEY: 5000.0}
               for s in range(1, 101)]
    kv = soak.summarize(_rows(), kv_rows)["kv"]
    assert kv["max_tokens"] == 160.0 and kv["budget_tokens"] == 5000.0
    assert kv["max_at_step"] == 6 and kv["early_max_tokens"] == 160.0 and kv["late_max_tokens"] == 160.0


def test_print_summary_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    kv_rows = [{"global_step": s, soak.KV_KEY: 100.0, soak.KV_BUDGET_KEY: 1e6} for s in range(1, 101)]
    soak.print_summary(soak.summarize(_rows(), kv_rows), min_rss_mb=100)
    out = capsys.readouterr().out
    assert "openrlhf_oppo.cli.train_ppo_ray [2]" in out and "+300.0" in out
    assert "(1 processes under 100 MB not shown)" in out and "budget 1,000,000 (0.01% of it)" in out
    png = soak.plot(_rows(), kv_rows, tmp_path / "soak.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("steps, batch, prompts, want", [
    (200, 4, 256, (202, 4)),  # 4 passes of 202 prompts: 808 = (200 + 2) x 4
    (4, 4, 256, (24, 1)),
    (10, 8, 16, (16, 6)),
])
def test_data_flags_hold_enough_prompts(steps, batch, prompts, want):
    max_samples, episodes = soak.data_flags(steps, batch, prompts)
    assert (max_samples, episodes) == want
    assert max_samples <= prompts and max_samples * episodes >= (steps + 2) * batch


def test_sampler_records_the_session_the_launcher_starts(tmp_path):
    pytest.importorskip("psutil")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        (tmp_path / "oppo_metrics.jsonl").write_text("{}\n{}\n")
        sampler = soak.Sampler(__import__("os").getpid(), tmp_path / "rss.jsonl", tmp_path / "oppo_metrics.jsonl", 1.0)
        assert sampler.sample() >= 2
        rows = [json.loads(line) for line in (tmp_path / "rss.jsonl").read_text().splitlines()]
        mine = {r["pid"]: r for r in rows}
        assert mine[child.pid]["name"] == "python -c …" and mine[child.pid]["rss_mb"] > 0
        assert all(r["step"] == 2 for r in rows)
    finally:
        child.kill()
        child.wait()
