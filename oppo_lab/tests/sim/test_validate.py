"""`simulate validate`: the verdict flags a simulated figure off by more than the tolerance and
an order of the schedules that is not the measured one; run names and replayed lengths."""

from __future__ import annotations

import json

import pytest

from oppo_lab.sim import validate


def test_a_schedule_off_by_more_than_the_tolerance_is_a_miss():
    v = validate.compare({"sync": [9.0, 11.0], "async": [7.0]}, {"sync": [14.0, 14.0], "async": [7.7]}, 0.25)
    rows = {r.schedule: r for r in v.rows}
    assert rows["sync"].ratio == pytest.approx(1.4) and not rows["sync"].within
    assert validate.verdict(rows["sync"], 0.25) == "MISS: too slow"
    assert rows["async"].within and validate.verdict(rows["async"], 0.25) == "within"
    assert v.order_reproduced and not v.passed


def test_a_too_fast_schedule_is_a_miss_too():
    row = validate.compare({"oversample": [6.6]}, {"oversample": [4.0]}, 0.25).rows[0]
    assert validate.verdict(row, 0.25) == "MISS: too fast"


def test_every_schedule_within_but_in_another_order_fails():
    v = validate.compare({"oppo": [6.2], "oversample": [6.6], "sync": [9.4]},
                         {"oppo": [6.3], "oversample": [5.8], "sync": [9.5]}, 0.25)
    assert all(r.within for r in v.rows)
    assert v.measured_order == ("oppo", "oversample", "sync")
    assert v.simulated_order == ("oversample", "oppo", "sync")
    assert not v.order_reproduced and not v.passed


def test_every_schedule_within_and_in_the_measured_order_passes(capsys):
    v = validate.compare({"sync": [9.4, 9.2], "async": [7.7]}, {"sync": [9.0], "async": [8.0, 7.0]}, 0.25)
    assert v.passed
    validate.print_validation(v, "title", "replay")
    out = capsys.readouterr().out
    assert "measured order (fastest first):  async < sync" in out and "verdict: PASS (2/2" in out


def test_schedules_whose_repeats_overlap_are_a_tie_either_order_stands(capsys):
    measured = {"oversample": [1.58, 1.60, 1.79], "oppo": [1.62, 1.63], "sync": [2.30, 2.68]}
    v = validate.compare(measured, {"oversample": [1.7], "oppo": [1.6], "sync": [2.3]}, 0.25)
    assert v.measured_order == ("oversample", "oppo", "sync") and v.simulated_order == ("oppo", "oversample", "sync")
    assert v.order_reproduced and v.passed
    validate.print_validation(v, "title", "replay")
    assert "oversample ≈ oppo < sync" in capsys.readouterr().out
    # a pair the repeats do order, simulated the other way round, still fails
    v = validate.compare(measured, {"oversample": [1.7], "oppo": [2.4], "sync": [2.3]}, 0.25)
    assert v.swapped == (("oppo", "sync"),) and not v.passed
    validate.print_validation(v, "title", "replay")
    assert "NOT reproduced: oppo measured faster than sync" in capsys.readouterr().out


def test_the_tolerance_must_be_a_fraction():
    with pytest.raises(ValueError, match="--tolerance"):
        validate.compare({"sync": [1.0]}, {"sync": [1.0]}, 1.5)


def test_a_run_is_named_schedule_dash_repeat():
    assert validate.schedule_of(validate.Path("runs/bench/oversample-1")) == "oversample"
    assert validate.schedule_of(validate.Path("oppo-async-0")) == "oppo-async"
    with pytest.raises(ValueError, match="<schedule>-<repeat>"):
        validate.schedule_of(validate.Path("runs/bench/fast-0"))


def test_replayed_lengths_follow_sample_ids_where_the_timeline_has_them(tmp_path):
    (tmp_path / "timeline").mkdir()
    rows = [{"kind": "sample", "role": "rollout", "host": "h", "pid": 1, "key": k, "t0": 0.0, "t1": 1.0,
             "tokens": tokens, "sample": sid} for k, (sid, tokens) in enumerate([(1, 30), (0, 20), (None, 16)])]
    (tmp_path / "timeline" / "h-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert validate.replay_lengths(tmp_path, prompt_tokens=8) == [20, 30]  # the sync probe (no id) left out


def test_replayed_lengths_are_rollouts_order_without_sample_ids(tmp_path):
    steps = [{"step": 0, "samples": [{"sequence": [1] * 18}, {"sequence": [1] * 9}]},
             {"step": 1, "samples": [{"sequence": [1] * 40}]}]
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    assert validate.replay_lengths(tmp_path, prompt_tokens=8) == [10, 1, 32]


def test_the_shipped_cpu_preset_is_calibrated_on_every_modes_runs():
    from openrlhf_oppo.sim import presets

    header = (presets.PRESET_DIR / "cpu-longtail.yaml").read_text().splitlines()[0]
    for schedule in ("sync", "async", "partial", "oversample", "oppo"):
        assert f"/{schedule}-0" in header and f"/{schedule}-1" in header


def test_leave_one_out_calibrates_without_the_held_out_schedules_runs(tmp_path, monkeypatch):
    from pathlib import Path

    from oppo_lab.sim import calibrate

    runs = {Path(f"/r/{s}-{k}"): {"steps": 16} for s in ("sync", "oppo", "async") for k in (0, 1)}
    calibrated, replays, priors = [], [], set()

    def fake_calibrate(seen, base, prompt_tokens, warmup_steps):
        calibrated.append({validate.schedule_of(r) for r in seen})
        priors.add(tuple(getattr(base.efficiency, k) for k in validate.SHARED_HOST_FACTORS))
        return {"efficiency": {"train_slowdown_shared": 1.0 + len(calibrated) / 10, "decode_slowdown_shared": 2.0,
                               "decode_slowdown_scoring": 0.0}}

    def fake_replayed(unseen, preset, sets, tmp):
        replays.append(({validate.schedule_of(r) for r in unseen}, Path(preset).name))
        return {validate.schedule_of(r): [1.0] for r in unseen}

    monkeypatch.setattr(calibrate, "calibrate", fake_calibrate)
    monkeypatch.setattr(calibrate, "write_preset", lambda *a: None)
    monkeypatch.setattr(validate, "replayed", fake_replayed)
    simulated, slowdowns = validate.leave_one_out(runs, "cpu-longtail", [], tmp_path, 2)
    assert calibrated == [{"oppo", "sync"}, {"async", "sync"}, {"async", "oppo"}]  # held: async, oppo, sync
    assert replays == [({"async"}, "without-async.yaml"), ({"oppo"}, "without-oppo.yaml"),
                       ({"sync"}, "without-sync.yaml")]
    assert set(simulated) == {"sync", "oppo", "async"}
    assert {s: k["train_slowdown_shared"] for s, k in slowdowns.items()} == {"async": 1.1, "oppo": 1.2, "sync": 1.3}
    # the shipped preset's fitted factors (its runs include the held-out schedule's) do not leak in
    assert priors == {(1.0, 1.0, 0.0)}
