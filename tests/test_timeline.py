"""openrlhf_oppo.timeline's arithmetic and its recorder, by hand-built records."""

from __future__ import annotations

import pytest

from openrlhf_oppo import timeline


def test_overlapping_intervals_merge_and_idle_is_the_uncovered_share():
    assert timeline.merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    rows = [{"kind": "span", "role": "actor", "t0": 1.0, "t1": 3.0},
            {"kind": "span", "role": "actor", "t0": 2.0, "t1": 4.0},
            {"kind": "sample", "role": "rollout", "t0": 0.0, "t1": 5.0},
            {"kind": "span", "role": "rollout", "t0": 6.0, "t1": 7.0}]
    idle = timeline.idle_fractions(rows, 0.0, 10.0)
    assert idle["actor"] == pytest.approx(0.7) and idle["rollout"] == pytest.approx(0.4)


def test_recorder_writes_one_line_per_span_and_nothing_without_a_directory(tmp_path):
    rec = timeline.Recorder(str(tmp_path / "tl"))
    with rec.timed("actor", "train"):
        pass
    rec.sample("rollout", 1.0, 2.0, tokens=7, finish="stop", sample=3)
    rows = timeline.read(tmp_path / "tl")
    assert [(r["kind"], r["role"]) for r in rows] == [("sample", "rollout"), ("span", "actor")]
    assert rows[0]["tokens"] == 7 and rows[0]["sample"] == 3 and rows[1]["t1"] >= rows[1]["t0"]
    (tmp_path / "tl" / "999.jsonl").write_text('{"kind": "span", "t0": 1')  # cut by a kill
    assert len(timeline.read(tmp_path / "tl")) == 2
    off = timeline.Recorder(None)
    with off.timed("actor", "train"):
        pass
    assert not off.enabled
