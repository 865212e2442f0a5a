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
        subprocess.run([sys.executable, str(burn)], check=True, timeout=120)
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


def run(mean_step_s: float, tokens_a_step: float, cpu_s_per_ktok: float, gpu: bool = False) -> dict:
    """A run summary whose figures hold together as `summarize_run` makes them: cores busy is CPU
    seconds a step / seconds a step."""
    return {"returncode": 0, "wall_s": 100.0, "steps": 10, "step_s": [mean_step_s] * 8,
            "median_step_s": mean_step_s, "mean_step_s": mean_step_s,
            "trained_tokens_per_s": tokens_a_step / mean_step_s, "reward": None,
            "cpu_s_per_ktok": cpu_s_per_ktok, "cores_busy": tokens_a_step * cpu_s_per_ktok / 1000 / mean_step_s,
            "host": {"cores": 2, "gpu": gpu}}


def test_the_step_ratio_is_work_times_cpu_per_token_times_cores_busy():
    base = run(2.0, 1500.0, 2.2)  # 3.3 CPU-s a step: 1.65 cores busy
    oppo = run(2.0, 1800.0, 2.0)  # 3.6 CPU-s a step: 1.8 cores busy
    f = cpu_use.factors(base, oppo, cores=2)
    assert f["work"] == pytest.approx(1500 / 1800)
    assert f["cpu_per_token"] == pytest.approx(1.1)
    assert f["cores_busy"] == pytest.approx(1.8 / 1.65)
    assert f["work"] * f["cpu_per_token"] * f["cores_busy"] == pytest.approx(2.0 / 2.0)  # the step ratio, exactly
    assert f["ceiling"] == pytest.approx(1.1 * 2 / 1.65)  # equal work, both cores busy
    assert "ceiling" not in cpu_use.factors(base, oppo)  # no host cores: no ceiling
    assert cpu_use.factors(base, {**oppo, "cores_busy": None}, 2) is None


def test_the_verdict_explains_the_ratio_and_bounds_it_by_the_host_cores(capsys):
    rows = schedules.report({"oversample": [run(2.0, 1500.0, 2.2), run(2.0, 1500.0, 2.2)],
                             "oppo": [run(1.6, 1500.0, 2.0), run(2.0, 1800.0, 2.0)]})
    oppo = {r["schedule"]: r for r in rows}["oppo"]
    assert oppo["cores"] == 2 and oppo["x_best"] == (1.125, 1.0, 1.25)
    f = oppo["x_best_cpu"]
    assert f["work"] == pytest.approx(((1.0 + 1500 / 1800) / 2, 1500 / 1800, 1.0))  # median [min-max] of the pairs
    assert f["cpu_per_token"] == pytest.approx((1.1, 1.1, 1.1))
    assert f["ceiling"] == pytest.approx((1.1 * 2 / 1.65,) * 3)
    v = schedules.verdict(rows)
    assert v.cpu_vs_best == f and v.cores == 2
    assert v.cores_busy == pytest.approx((1500 * 2.0 / 1000 / 1.6 + 1.8) / 2)
    schedules.print_verdict(v)
    out = capsys.readouterr().out
    assert "x oversample = work a step 0.92 [0.83-1.00] x CPU per trained token 1.10 x cores busy" in out
    assert "equal work and every core busy it would be 1.33x oversample" in out


def test_no_ceiling_on_a_gpu_host_and_no_factors_without_samples():
    gpu = schedules.report({"oversample": [run(2.0, 1500.0, 2.2, gpu=True)], "oppo": [run(1.6, 1500.0, 2.0, gpu=True)]})
    f = schedules.verdict(gpu).cpu_vs_best
    assert "ceiling" not in f and f["cpu_per_token"] == pytest.approx((1.1, 1.1, 1.1))
    bare = {k: v for k, v in run(2.0, 1500.0, 2.2).items() if k not in ("cores_busy", "cpu_s_per_ktok", "host")}
    rows = schedules.report({"oversample": [bare], "oppo": [dict(bare, mean_step_s=1.0)]})
    assert schedules.verdict(rows).cpu_vs_best is None and rows[1]["cores_busy"] == (None, None, None)
