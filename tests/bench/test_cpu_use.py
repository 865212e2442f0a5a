"""Where a run's CPU goes (`bench.cpu_use`): the sampler on real processes, the window's figures
and the ceiling, hand-computed, and `bench schedules`' verdict with them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from openrlhf_oppo.bench import cpu_use, schedules


def test_the_sampler_counts_a_child_process_cpu_and_keeps_it_after_the_child_exits(tmp_path):
    burn = tmp_path / "burn.py"
    burn.write_text(textwrap.dedent("""\
        import time
        while time.process_time() < 1.0:  # one CPU second, however loaded the machine
            pass
        time.sleep(0.6)
    """))
    out = tmp_path / cpu_use.FILE
    with cpu_use.Sampler(out, interval_s=0.1):
        subprocess.run([sys.executable, str(burn)], check=True)
        after = cpu_use.Sampler(tmp_path / "other.jsonl").sample()  # the child is gone: not under us any more
    head, samples = cpu_use.read(out)
    assert head == cpu_use.host() and head["cores"] >= 1
    assert "burn.py" not in after["cpu"]
    burned = [s["cpu"].get("burn.py") for s in samples]
    assert 0.97 <= burned[-1] < 1.5  # its CPU second in clock ticks (and the start), held after it exited
    assert burned[-1] == max(b for b in burned if b is not None)  # a name's total never falls
    assert samples[-1]["cpu"]["launcher"] > 0.0  # this process, the sampler's own cost included


def test_a_ray_worker_is_named_by_the_actor_it_became(tmp_path, monkeypatch):
    titles = iter([{1: "default_worker.py", 2: "raylet"}, {1: "ray::PolicyModelActor", 2: "raylet"},
                   {1: "ray::IDLE", 2: "raylet"}])
    monkeypatch.setattr(cpu_use, "run_processes", lambda root: next(titles))

    class Proc:
        def __init__(self, pid):
            self.pid = pid

        def cpu_times(self):
            return type("T", (), {"user": 1.0 * self.pid, "system": 0.5})()

    monkeypatch.setattr("psutil.Process", Proc)
    sampler = cpu_use.Sampler(tmp_path / "cpu.jsonl")
    assert sampler.sample()["cpu"] == {"default_worker.py": 1.5, "raylet": 2.5}
    assert sampler.sample()["cpu"] == {"ray::PolicyModelActor": 1.5, "raylet": 2.5}  # its title once it is an actor
    assert sampler.sample()["cpu"] == {"ray::PolicyModelActor": 1.5, "raylet": 2.5}  # ray::IDLE does not undo it


def write(path, samples, host=None):
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"host": host or {"cores": 2, "gpu": False}}, *samples]))


def test_the_window_interpolates_between_samples(tmp_path):
    path = tmp_path / cpu_use.FILE
    write(path, [{"t": 10.0, "cpu": {"engine": 1.0, "actor": 0.0}},
                 {"t": 12.0, "cpu": {"engine": 4.0, "actor": 2.0}},
                 {"t": 14.0, "cpu": {"engine": 5.0, "actor": 4.0, "late": 0.5}}])
    # t0 = 11: engine 2.5, actor 1.0; t1 = 14: engine 5.0, actor 4.0, late 0.5 (born after t0)
    w = cpu_use.window(path, 11.0, 14.0, steps=2, tokens=4000.0)
    assert w["cpu_by_process"] == {"actor": pytest.approx(1.5), "engine": pytest.approx(1.25),
                                   "late": pytest.approx(0.25)}
    assert list(w["cpu_by_process"]) == ["actor", "engine", "late"]  # most first
    assert w["cpu_s_per_step"] == pytest.approx(3.0)  # (2.5 + 3.0 + 0.5) / 2
    assert w["cores_busy"] == pytest.approx(2.0)  # 6 CPU seconds in 3 wall seconds
    assert w["cpu_s_per_ktok"] == pytest.approx(1.5)  # 6 / 4000 x 1000
    assert w["host"] == {"cores": 2, "gpu": False}
    assert cpu_use.window(path, 9.0, 14.0, 2, 4000.0) == {}  # the samples do not span the window
    assert cpu_use.window(tmp_path / "none.jsonl", 11.0, 14.0, 2, 4000.0) == {}
    assert cpu_use.window(path, 11.0, 14.0, 2, None)["cpu_s_per_ktok"] is None


def test_the_ceiling_is_every_core_at_the_measured_cost_over_the_other_rate():
    # 2 cores at 1.93 CPU-s per 1k tokens: 1,036 tok/s at most, over 830 tok/s
    assert cpu_use.ceiling(2, 1.93, 830.0) == pytest.approx(2000 / 1.93 / 830)
    assert cpu_use.ceiling(2, None, 830.0) is None and cpu_use.ceiling(2, 1.93, None) is None


def run(mean_step_s: float, cores_busy: float, cpu_s_per_ktok: float, gpu: bool = False) -> dict:
    return {"returncode": 0, "wall_s": 100.0, "steps": 10, "step_s": [mean_step_s] * 8,
            "median_step_s": mean_step_s, "mean_step_s": mean_step_s, "trained_tokens_per_s": 1000 / mean_step_s,
            "reward": None, "cores_busy": cores_busy, "cpu_s_per_ktok": cpu_s_per_ktok,
            "host": {"cores": 2, "gpu": gpu}}


def test_the_verdict_bounds_the_best_oppo_schedule_by_the_host_cores(capsys):
    rows = schedules.report({"oversample": [run(2.0, 1.5, 2.0), run(2.0, 1.75, 2.0)],
                             "oppo": [run(1.6, 1.5, 1.6), run(1.6, 2.0, 1.6)]})
    oppo = {r["schedule"]: r for r in rows}["oppo"]
    assert oppo["cores"] == 2 and oppo["cores_busy"] == (1.75, 1.5, 2.0)  # median [min-max] over repeats
    v = schedules.verdict(rows)
    assert v.cores_busy == (1.75, 1.625)
    # every core at 1.6 CPU-s per 1k tokens: 1,250 tok/s, over oversample's 500
    assert v.cpu_ceiling_vs_best == pytest.approx(2.5)
    schedules.print_verdict(v)
    assert "oppo could reach at most 2.50x oversample's trained tok/s" in capsys.readouterr().out


def test_no_ceiling_on_a_gpu_host_or_without_samples():
    gpu = schedules.report({"oversample": [run(2.0, 1.5, 2.0, gpu=True)], "oppo": [run(1.6, 1.6, 1.6, gpu=True)]})
    assert schedules.verdict(gpu).cpu_ceiling_vs_best is None
    bare = {k: v for k, v in run(2.0, 1.5, 2.0).items() if k not in ("cores_busy", "cpu_s_per_ktok", "host")}
    rows = schedules.report({"oversample": [bare], "oppo": [dict(bare, mean_step_s=1.0)]})
    assert schedules.verdict(rows).cpu_ceiling_vs_best is None and rows[1]["cores_busy"] == (None, None, None)
