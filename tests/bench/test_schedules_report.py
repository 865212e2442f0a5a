"""`bench schedules`' table from hand-made runs: it leads with time per step and trained
tokens per second, rates every schedule against every OpenRLHF mode repeat by repeat, and
sets the best OPPO schedule's effect against the spread between identical runs."""

from __future__ import annotations

import json
import re
from dataclasses import asdict

import pytest

from openrlhf_oppo.bench import schedules

FAILED = {"returncode": 1, "wall_s": 5.0, "steps": 0, "step_s": []}


def make_run(mean_step_s: float, wall_s: float = 100.0, **extra) -> dict:
    """One repeat as `main` records it: the launcher's returncode and wall_s, then
    `summarize_run`'s figures (the median step set apart from the mean so that a swap shows)."""
    return {"returncode": 0, "wall_s": wall_s, "steps": 10, "step_s": [mean_step_s] * 8,
            "median_step_s": mean_step_s / 2, "mean_step_s": mean_step_s, "trained_tokens_per_s": 1000 / mean_step_s,
            "reward": None, **extra}


def runs(*means: float | None) -> list[dict]:
    return [FAILED if m is None else make_run(m) for m in means]


def by_name(rows: list[dict]) -> dict[str, dict]:
    return {r["schedule"]: r for r in rows}


def four_schedules() -> dict[str, list[dict]]:
    # mean step s per repeat; ratios are exact in binary floating point
    return {"sync": runs(8.0, 12.0, 10.0), "oversample": runs(6.0, 6.0, 5.0),
            "oppo-async-bg": runs(9.0, 9.0, 9.0), "oppo": runs(4.0, 8.0, 4.0)}


def test_ratios_are_taken_repeat_by_repeat_against_every_openrlhf_mode():
    rows = by_name(schedules.report(four_schedules()))
    assert list(rows) == ["sync", "oversample", "oppo-async-bg", "oppo"]  # no oracle row
    oppo = rows["oppo"]
    assert set(oppo["x"]) == {"sync", "oversample"}  # one ratio per OpenRLHF mode present
    assert oppo["x"]["sync"] == (2.0, 1.5, 2.5)  # 8/4, 12/8, 10/4
    assert oppo["x"]["oversample"] == (1.25, 0.75, 1.5)  # 6/4, 6/8, 5/4
    assert oppo["best"] == "oversample"  # median mean step s 6 < sync's 10
    assert oppo["x_best"] == oppo["x"]["oversample"]
    assert rows["sync"]["x"]["sync"] == (1.0, 1.0, 1.0)
    assert rows["sync"]["x"]["oversample"] == (0.5, 0.5, 0.75)  # 6/8, 6/12, 5/10


def test_figures_lead_with_the_mean_step_and_keep_the_median_apart():
    oppo = by_name(schedules.report(four_schedules()))["oppo"]
    assert oppo["mean_step_s"] == (4.0, 4.0, 8.0)
    assert oppo["median_step_s"] == (2.0, 2.0, 4.0)
    assert oppo["trained_tokens_per_s"] == (250.0, 125.0, 250.0)
    assert oppo["wall_s"] == (100.0, 100.0, 100.0)
    assert "oracle_s" not in oppo and "step_s" not in oppo and "tokens_per_s" not in oppo


def test_spread_is_max_minus_min_over_median_of_the_mean_step():
    rows = by_name(schedules.report(four_schedules()))
    assert rows["sync"]["spread"] == pytest.approx(0.4)  # (12 - 8) / 10
    assert rows["oversample"]["spread"] == pytest.approx(1 / 6)  # (6 - 5) / 6
    assert rows["oppo"]["spread"] == pytest.approx(1.0)  # (8 - 4) / 4
    assert rows["oppo-async-bg"]["spread"] == 0.0


def test_verdict_sets_the_best_oppo_schedule_against_the_largest_spread():
    v = schedules.verdict(schedules.report(four_schedules()))
    assert (v.best_oppo, v.best_openrlhf) == ("oppo", "oversample")  # oppo's median 4 < oppo-async-bg's 9
    assert v.vs_sync == (2.0, 1.5, 2.5) and v.vs_best == (1.25, 0.75, 1.5)
    assert v.spread == pytest.approx(1.0)  # oppo's own, the largest of oppo, sync and oversample
    assert v.vs_sync_beyond_spread is False  # 1.5 - 1 = 0.5 <= 1.0
    assert v.vs_best_beyond_spread is False  # 0.75 - 1 < 0


def test_verdict_says_an_effect_beyond_the_spread():
    rows = schedules.report({"sync": runs(10.0, 11.0, 10.0), "async": runs(12.0, 12.0, 12.0),
                             "oppo": runs(5.0, 5.0, 5.0)})
    v = schedules.verdict(rows)
    assert v.best_openrlhf == "sync" and v.vs_sync == v.vs_best == (2.0, 2.0, 2.2)
    assert by_name(rows)["oppo"]["x"]["async"] == (2.4, 2.4, 2.4)
    assert v.spread == pytest.approx(0.1)  # sync's (11 - 10) / 10; async's is 0 but is not compared
    assert v.vs_sync_beyond_spread is True and v.vs_best_beyond_spread is True  # 2.0 - 1 > 0.1


def test_verdict_judges_against_every_mode_that_could_be_the_fastest(capsys):
    """Two OpenRLHF modes whose mean steps overlap over repeats tie: the one with the lower median
    is named best, and the verdict holds only if the effect beats the spread against both."""
    rows = schedules.report({"sync": runs(12.0, 12.0, 12.0), "oversample": runs(6.0, 6.0, 5.5),
                             "async": runs(5.0, 7.0, 7.0), "oppo": runs(4.0, 4.0, 4.0)})
    v = schedules.verdict(rows)
    assert v.best_openrlhf == "oversample"  # median 6.0 < async's 7.0
    assert list(v.rivals) == ["oversample", "async"]  # async's 5.0 <= oversample's highest 6.0; sync's 12 is not
    assert v.vs_best == v.rivals["oversample"] == (1.5, 1.375, 1.5)
    assert v.rivals["async"] == (1.75, 1.25, 1.75)
    assert v.spread == pytest.approx(2 / 7)  # async's (7 - 5) / 7, now compared
    assert v.vs_best_beyond_spread is False  # 1.375 - 1 > 2/7, but 1.25 - 1 < 2/7
    assert v.vs_sync_beyond_spread is True  # 3.0 - 1 > 2/7
    schedules.print_verdict(v)
    out = capsys.readouterr().out
    assert "x oversample (best OpenRLHF): 1.50 [1.38-1.50]; effect (min - 1) +38%: larger than the spread" in out
    assert "x async (within oversample's range: it could be the fastest): 1.75 [1.25-1.75]; effect (min - 1) +25%: " \
           "NOT larger than the spread" in out
    assert ("against the best OpenRLHF mode: NOT larger than the spread against every mode that could be the "
            "fastest (oversample, async)") in out
    apart = schedules.verdict(schedules.report({"oversample": runs(6.0, 6.0, 5.5), "async": runs(6.5, 7.0, 7.0),
                                                "oppo": runs(4.0, 4.0, 4.0)}))
    assert list(apart.rivals) == ["oversample"] and apart.vs_best_beyond_spread is True  # 6.5 > 6.0: no tie


def test_verdict_says_when_the_steps_held_unequal_work(capsys):
    """A schedule whose steps trained fewer tokens (its policy drifted to shorter answers) is
    faster a step without being faster: the verdict says so."""
    short = [make_run(m, trained_tokens_per_s=800 / m) for m in (5.0, 5.0, 5.0)]  # 800 tokens a step, not 1000
    v = schedules.verdict(schedules.report({"sync": runs(10.0, 11.0, 10.0), "oppo": short}))
    assert v.work_vs_best == pytest.approx(0.8) and v.spread == pytest.approx(0.1)
    schedules.print_verdict(v)
    out = capsys.readouterr().out
    assert "work: oppo's steps held 0.80x the response tokens of sync's; beyond the spread" in out
    same = schedules.verdict(schedules.report({"sync": runs(10.0, 11.0, 10.0), "oppo": runs(5.0, 5.0, 5.0)}))
    assert same.work_vs_best == pytest.approx(1.0)
    schedules.print_verdict(same)
    out = capsys.readouterr().out
    assert "work: oppo's steps held 1.00x the response tokens of sync's\n" in out
    assert same.work_vs_sync is None  # sync is the best mode: said once


def test_verdict_gives_the_work_against_sync_too(capsys):
    """Against sync as well as the best mode: a ratio to sync in mean step s can compare unequal work."""
    short = [make_run(m, trained_tokens_per_s=800 / m) for m in (4.0, 4.0, 4.0)]  # 800 tokens a step
    rows = schedules.report({"sync": runs(10.0, 10.0, 10.0), "oversample": [make_run(5.0)] * 3, "oppo": short})
    v = schedules.verdict(rows)
    assert v.best_openrlhf == "oversample"
    assert v.work_vs_best == pytest.approx(0.8) and v.work_vs_sync == pytest.approx(0.8)
    schedules.print_verdict(v)
    out = capsys.readouterr().out
    assert "work: oppo's steps held 0.80x the response tokens of oversample's; beyond the spread" in out
    assert "work: oppo's steps held 0.80x the response tokens of sync's; beyond the spread" in out


def test_a_failed_run_leaves_a_gap_that_keeps_repeats_paired():
    rows = by_name(schedules.report({"sync": runs(8.0, 12.0, 10.0), "oppo": runs(4.0, None, 5.0)}))
    oppo = rows["oppo"]
    assert oppo["runs_ok"] == "2/3"
    assert oppo["x"]["sync"] == (2.0, 2.0, 2.0)  # 8/4 and 10/5; closing the gap would pair 12 with 5
    assert oppo["mean_step_s"] == (4.5, 4.0, 5.0)
    assert oppo["spread"] == pytest.approx(1 / 4.5)


def test_one_repeat_leaves_the_spread_unknown(capsys):
    rows = schedules.report({"sync": runs(10.0), "oppo": runs(5.0)})
    v = schedules.verdict(rows)
    assert by_name(rows)["oppo"]["spread"] is None and v.spread is None
    assert v.vs_sync == (2.0, 2.0, 2.0) and v.vs_sync_beyond_spread is None and v.vs_best_beyond_spread is None
    schedules.print_report(rows)
    out = capsys.readouterr().out
    assert "spread between identical runs: unknown (one repeat" in out
    assert "effect (min - 1) +100%: unknown (spread unknown)" in out


def test_no_openrlhf_mode_gives_no_ratio_and_no_verdict(capsys):
    rows = schedules.report({"oppo": runs(4.0, 5.0), "oppo-async-bg": runs(6.0, 6.0)})
    assert all(r["x"] == {} and r["x_best"] == (None, None, None) for r in rows)
    assert schedules.verdict(rows) == schedules.Verdict("oppo", None, (None,) * 3, (None,) * 3, None, None, None)
    schedules.print_report(rows)
    assert "verdict: none (needs an OPPO schedule and an OpenRLHF mode)" in capsys.readouterr().out


def test_printed_table_has_one_ratio_column_per_openrlhf_mode(capsys):
    rows = schedules.report(four_schedules())
    schedules.print_report(rows)
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:6] == ["schedule", "runs", "mean", "step", "s", "trained"]
    assert "x best=oversample" in out.splitlines()[0] and "oracle" not in out
    assert re.findall(r"x [\w=]+", out.splitlines()[0]) == ["x sync", "x oversample", "x best=oversample"]
    assert "x sync: 2.00 [1.50-2.50]; effect (min - 1) +50%: NOT larger than the spread" in out
    assert "largest spread between identical runs of these schedules: 100%" in out
    json.dumps({"rows": rows, "verdict": asdict(schedules.verdict(rows))})  # summary.json can hold both


# ----------------------------------------------------------------------------- one run


def write_events(tb_dir, scalars: dict[str, list[tuple[int, float, float]]]) -> None:
    """TensorBoard events as OpenRLHF's TensorboardLogger writes them: tag -> [(step, wall, value)]."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(tb_dir / "run"))
    for tag, points in scalars.items():
        for step, wall, value in points:
            writer.add_scalar(tag, value, step, walltime=wall)
    writer.close()


def test_summarize_run_measures_mean_step_and_trained_tokens_after_warmup(tmp_path):
    walls = {1: 100.0, 2: 103.0, 3: 105.0, 4: 110.0, 5: 112.0}
    # warm-up steps 1-2 carry huge lengths: counted, they would show
    length = {1: 9999.0, 2: 9999.0, 3: 50.0, 4: 125.0, 5: 25.0}
    samples = {1: 8.0, 2: 8.0, 3: 8.0, 4: 8.0, 5: 16.0}
    write_events(tmp_path / "tensorboard", {
        schedules.STEP_TAG: [(s, w, 0.1) for s, w in walls.items()],
        "train/rollout/response_length_mean": [(s, walls[s], v) for s, v in length.items()],
        "train/rollout/num_samples": [(s, walls[s], v) for s, v in samples.items()],
    })
    summary = schedules.summarize_run(tmp_path, warmup_steps=2)
    assert summary["steps"] == 5
    assert summary["step_s"] == [2.0, 5.0, 2.0]  # 103 -> 105 -> 110 -> 112
    assert summary["mean_step_s"] == 3.0 and summary["median_step_s"] == 2.0
    # steps 3-5: 50 x 8 + 125 x 8 + 25 x 16 = 1800 tokens over 112 - 103 = 9 s
    assert summary["trained_tokens_per_s"] == pytest.approx(200.0)
    assert "tokens_per_s" not in summary and "oracle_s" not in summary


def test_trained_tokens_are_unknown_when_a_measured_step_lacks_its_length(tmp_path):
    write_events(tmp_path / "tensorboard", {
        schedules.STEP_TAG: [(1, 100.0, 0.1), (2, 102.0, 0.1), (3, 104.0, 0.1)],
        "train/rollout/response_length_mean": [(2, 102.0, 10.0)],
        "train/rollout/num_samples": [(2, 102.0, 4.0), (3, 104.0, 4.0)],
    })
    summary = schedules.summarize_run(tmp_path, warmup_steps=1)
    assert summary["mean_step_s"] == 2.0 and summary["trained_tokens_per_s"] is None


def test_openrlhf_still_logs_the_trained_token_tags():
    """OpenRLHF 0.11.2 puts rollout/response_length_mean and rollout/num_samples in every
    step's status and TensorboardLogger writes status key k as train/k: a rename upstream
    would silently leave trained tok/s empty."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("openrlhf")
    if spec is None or spec.origin is None:
        pytest.skip("openrlhf is not installed")
    root = Path(spec.origin).parent
    trainer = (root / "trainer" / "ppo_trainer.py").read_text()
    logger = (root / "utils" / "logging_utils.py").read_text()
    prefix = "train/"
    assert schedules.LENGTH_TAG.startswith(prefix) and schedules.SAMPLES_TAG.startswith(prefix)
    for tag in (schedules.LENGTH_TAG, schedules.SAMPLES_TAG):
        assert f'"{tag.removeprefix(prefix)}":' in trainer
    assert 'self.writer.add_scalar(f"train/{k}", v, global_step)' in logger
