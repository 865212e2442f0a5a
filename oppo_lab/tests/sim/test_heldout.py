"""The fitted / held-out split of measured runs: every published run placed, a fit refused on a
held-out run, the held-out verdict printed apart from the fitted set, the CPU check labelled
in-sample and its leave-one-out part held out."""

from __future__ import annotations

from pathlib import Path

import pytest

from oppo_lab.sim import heldout, load_preset, published, validate

ONE_STEP_OFF = ("published-verl-dapo-7b-16xh20", "published-verl-dapo-7b-16xh20-onestep")


def fake_row(cfg, step_s: float) -> published.Row:
    return published.Row(cfg.name, heldout.schedule(cfg.name), f"{cfg.split.devices} x h20", "150+1000/20480",
                         step_s, cfg.published.step_s, dict.fromkeys(published.STAGES, 1.0), {})


def test_every_published_run_is_in_exactly_one_set():
    names = published.published_presets()
    assert set(heldout.FITTED).isdisjoint(heldout.HELD_OUT)
    assert {heldout.placement(n) for n in names} <= {"fitted", "held out"}
    for name in [*heldout.FITTED, *heldout.HELD_OUT]:
        assert name == "cpu-longtail" or name in names or name.startswith("paper-")  # no stale name
        assert load_preset(name) is not None


def test_the_one_step_off_pair_is_held_out_and_its_published_ratio_is_520_over_749():
    assert [heldout.placement(n) for n in ONE_STEP_OFF] == ["held out", "held out"]
    pair = next(p for p in heldout.PAIRS if p.async_preset == ONE_STEP_OFF[1])
    assert pair.sync_preset == ONE_STEP_OFF[0]
    assert pair.published_ratio == pytest.approx(0.694, abs=5e-4)  # 520 / 749
    assert load_preset(ONE_STEP_OFF[1]).published.step_s / load_preset(ONE_STEP_OFF[0]).published.step_s \
        == pytest.approx(pair.published_ratio)


def test_the_async_halves_run_the_published_layout_4_generate_and_12_train_devices():
    for name in ("published-verl-dapo-7b-16xh20-onestep", "published-verl-dapo-7b-16xh20-megatron-onestep"):
        cfg = load_preset(name)
        s = cfg.split
        assert heldout.schedule(name) == "async" and not s.colocate
        assert (s.nodes * s.generate_gpus, s.nodes * s.train_gpus) == (4, 12)
    assert heldout.schedule(ONE_STEP_OFF[0]) == "sync"


def test_a_fit_refuses_a_held_out_run_before_simulating_anything():
    calls = []
    for names in (["published-verl-qwen2-7b-gsm8k", ONE_STEP_OFF[1]], [ONE_STEP_OFF[0]], ["paper-7b-h200"]):
        with pytest.raises(ValueError, match="held out"):
            published.fit_constant("efficiency.train_mfu", names, 0.1, 0.6, simulate_fn=calls.append)
    with pytest.raises(ValueError, match="in neither set"):
        published.fit_constant("efficiency.train_mfu", ["paper-7b-h200-copy"], 0.1, 0.6, simulate_fn=calls.append)
    assert calls == []


def test_a_fit_on_the_fitted_set_finds_the_value_that_matches_the_published_step():
    # a fake simulator whose step is published x 0.35 / train_mfu (as an update-bound step): the fit is 0.35
    def sim(cfg):
        return fake_row(cfg, cfg.published.step_s * 0.35 / cfg.efficiency.train_mfu)

    names = ["published-verl-qwen2-7b-gsm8k", "published-verl-deepseek-7b-ppo"]
    value = published.fit_constant("efficiency.train_mfu", names, 0.1, 0.6, iterations=20, simulate_fn=sim)
    assert value == pytest.approx(0.35, rel=1e-4)
    with pytest.raises(ValueError, match="does not cross 1"):
        published.fit_constant("efficiency.train_mfu", names, 0.4, 0.6, simulate_fn=sim)


@pytest.mark.parametrize(("simulated", "published_ratio", "expected"), [
    (1.09, 520 / 749, "MISS: too slow"),  # 1.09 / 0.694 = 1.57
    (0.75, 520 / 749, "within"),  # 1.08
    (0.56, 520 / 749, "within"),  # 0.81: just inside -20 %
    (0.55, 520 / 749, "MISS: too fast"),  # 0.79: just outside
    (0.95, 0.90, "no verdict: the band holds 1.00"),  # 0.72-1.08 holds 1.00
])
def test_a_pair_is_judged_on_its_ratio_within_twenty_percent(simulated, published_ratio, expected):
    assert published.pair_verdict(simulated, published_ratio) == expected


def paper(ablation: str, simulated: float, target: float, ok: bool | None) -> dict:
    return {"ablation": ablation, "schedule": f"oppo-{ablation}", "simulated": simulated, "paper": target,
            "rel": simulated / target, "ok": ok}


PAPER_ROWS = [paper("intra", 1.07, 1.2, None), paper("inter", 1.33, 1.6, True), paper("both", 1.45, 1.9, False)]


def test_heldout_prints_the_held_out_runs_pairs_and_paper_ablations_only(monkeypatch, capsys):
    step = {"published-verl-dapo-7b-16xh20": 1000.0, "published-verl-dapo-7b-16xh20-onestep": 1090.0}
    monkeypatch.setattr(published, "simulate", lambda cfg: fake_row(cfg, step.get(cfg.name, cfg.published.step_s)))
    monkeypatch.setattr(published, "paper_rows", lambda name: PAPER_ROWS)
    assert published.main(["--heldout"]) == 0
    out = capsys.readouterr().out
    assert "HELD-OUT SET" in out and "FITTED SET" not in out
    assert "verl-qwen2-7b-gsm8k" not in out and "verl-deepseek-7b-ppo" not in out  # the fitted runs stay out
    pair = next(line for line in out.splitlines() if line.startswith("verl one-step-off, FSDP2"))
    assert "1.09" in pair and "0.69" in pair and "MISS: too slow" in pair  # 1090 / 1000 against 520 / 749
    assert "found, not modelled: verl fully_async_policy" in out
    both = [line for line in out.splitlines() if line.startswith("paper-") and " both " in line]
    assert len(both) == 2 and all("MISS: too low" in line for line in both)  # 1.45 / 1.9 = 0.76
    assert "2 of 4 decided rows within ±20%" in out  # intra has no verdict in either preset


def test_the_default_table_names_the_fitted_set_apart_with_no_verdict(monkeypatch, capsys):
    monkeypatch.setattr(published, "simulate", lambda cfg: fake_row(cfg, cfg.published.step_s))
    monkeypatch.setattr(published, "paper_rows", lambda name: PAPER_ROWS)
    published.main([])
    out = capsys.readouterr().out
    held, fitted = out.split("FITTED SET")
    assert "HELD-OUT SET" in held and "verl-qwen2-7b-gsm8k" not in held
    assert "verl-qwen2-7b-gsm8k" in fitted and "in-sample for any constant fitted on them: no verdict" in fitted
    assert "verl-dapo-7b-16xh20" not in fitted


def test_the_cpu_check_is_labelled_in_sample_and_leave_one_out_held_out(capsys):
    v = validate.compare({"sync": [9.4], "async": [7.7]}, {"sync": [9.0], "async": [8.0]}, 0.25)
    validate.print_validation(v, "replay: title", "replay")
    out = capsys.readouterr().out
    assert out.startswith("IN-SAMPLE: replay: title") and "in-sample verdict: PASS" in out
    validate.print_validation(v, "leave one schedule out", "held out", "held out")
    out = capsys.readouterr().out
    assert out.startswith("HELD OUT: leave one schedule out") and "held out verdict: PASS" in out


def test_in_sample_is_read_from_the_presets_calibration_header(tmp_path):
    preset = tmp_path / "cal.yaml"
    preset.write_text("# Calibrated by `python -m oppo_lab calibrate runs/b/sync-0 runs/b/oppo-1`\ncosts: {}\n")
    assert validate.calibrated_on(str(preset), [Path("/home/u/runs/b/oppo-1")])
    assert not validate.calibrated_on(str(preset), [Path("runs/other/oppo-1"), Path("runs/b/oppo-2")])
    assert validate.calibrated_on("cpu-longtail", [Path("runs/bench-longtail-v4/oppo-2")])  # the last, before a `
    assert not validate.calibrated_on("paper-7b-h200", [Path("runs/bench-longtail-v4/partial-2")])  # not calibrated
