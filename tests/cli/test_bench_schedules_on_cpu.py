"""`openrlhf-oppo bench schedules` reads real runs: the session's sync and OPPO runs
(shared with the other *_on_cpu tests, so no extra training run here; the OPPO run is in
OpenRLHF's hybrid engine)."""

from __future__ import annotations

import pytest

from openrlhf_oppo.bench import cpu_use
from openrlhf_oppo.bench import schedules as bench_schedules


@pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes
def test_run_summaries_and_ratios_from_real_runs_on_cpu(oppo_run, sync_run):
    sync = bench_schedules.summarize_run(sync_run.root, warmup_steps=1)
    oppo = bench_schedules.summarize_run(oppo_run.root, warmup_steps=1)
    assert sync["steps"] == 4 and len(sync["step_s"]) == 3 and all(s > 0 for s in sync["step_s"])
    assert sync["reward"] is not None and "oppo/overlap_fraction" not in sync  # OpenRLHF's own mode
    assert sync["trained_tokens_per_s"] > 0 and "oracle_s" not in sync and "tokens_per_s" not in sync
    assert oppo["steps"] >= 3 and all(s > 0 for s in oppo["step_s"]) and oppo["trained_tokens_per_s"] > 0
    assert 0.0 <= oppo["oppo/overlap_fraction"] <= 1.0 and 0.0 <= oppo["oppo/scorer_idle_fraction"] <= 1.0
    assert "oracle_s" not in oppo
    for root, run in ((sync_run.root, sync), (oppo_run.root, oppo)):  # as `bench schedules` samples its runs
        host, samples = cpu_use.read(root / cpu_use.FILE)
        first, last = samples[0], samples[-1]  # whole-run totals, sampled: no interpolation
        assert 0.0 < sum(last["cpu"].values()) - sum(first["cpu"].values()) <= host["cores"] * (last["t"] - first["t"])
        assert run["cores_busy"] > 0.0 and run["host"] == host
        assert run["cpu_s_per_step"] == pytest.approx(sum(run["cpu_by_process"].values()))
        assert run["cpu_s_per_ktok"] > 0.0
        assert {"VLLM::EngineCore", "ray::PolicyModelActor", "ray::CriticModelActor"} <= set(run["cpu_by_process"])
    assert "ray::OppoRolloutActor" in oppo["cpu_by_process"] and "ray::OppoRolloutActor" not in sync["cpu_by_process"]

    failed = {"returncode": 1, "wall_s": 5.0, "steps": 0, "step_s": []}
    rows = bench_schedules.report({
        "sync": [{"returncode": 0, "wall_s": 60.0, **sync}, {"returncode": 0, "wall_s": 62.0, **sync}],
        "oppo": [{"returncode": 0, "wall_s": 70.0, **oppo}, failed],
    })
    assert [r["schedule"] for r in rows] == ["sync", "oppo"] and rows[1]["runs_ok"] == "1/2"  # no oracle row
    assert rows[0]["x"] == {"sync": (1.0, 1.0, 1.0)} and rows[0]["best"] == "sync"
    assert rows[0]["x_best"] == (1.0, 1.0, 1.0) and rows[0]["spread"] == 0.0  # the same run twice
    assert rows[1]["x"]["sync"][0] == pytest.approx(sync["mean_step_s"] / oppo["mean_step_s"])
    assert rows[1]["x_best"] == rows[1]["x"]["sync"] and rows[1]["spread"] is None  # one good repeat
    assert rows[0]["wall_s"] == (61.0, 60.0, 62.0)  # median [min, max] over repeats
    assert rows[1]["wall_s"] == (70.0, 70.0, 70.0)  # a failed run's figures are left out
    assert rows[1]["trained_tokens_per_s"][0] == pytest.approx(oppo["trained_tokens_per_s"])
    v = bench_schedules.verdict(rows)
    assert v.best_oppo == "oppo" and v.best_openrlhf == "sync" and v.spread is None  # oppo's spread is unknown
    bench_schedules.print_report(rows)


@pytest.mark.parametrize("argv, message", [
    (["--schedules", "sync", "fast"], "--schedules: unknown fast; allowed: sync"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--warmup-steps", "0"], "--warmup-steps must be >= 1, got 0"),
])
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_schedules.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
