"""openrlhf_oppo.timeline's arithmetic and its recorder, by hand-built records."""

from __future__ import annotations

import pytest

from openrlhf_oppo import timeline


def test_overlapping_intervals_merge_and_idle_is_the_uncovered_share():
    assert timeline.merge([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    rows = [{"kind": "span", "role": "actor", "pid": 1, "t0": 1.0, "t1": 3.0},
            {"kind": "span", "role": "actor", "pid": 2, "t0": 2.0, "t1": 4.0},
            {"kind": "sample", "role": "rollout", "pid": 3, "key": 0, "t0": 0.0, "t1": 5.0},
            {"kind": "span", "role": "rollout", "pid": 3, "t0": 6.0, "t1": 7.0}]
    idle = timeline.idle_fractions(rows, 0.0, 10.0)
    assert idle["actor"] == pytest.approx(0.7) and idle["rollout"] == pytest.approx(0.4)


def test_a_response_still_decoding_keeps_its_engine_busy_to_the_end_of_the_window():
    rows = [{"kind": "open", "role": "rollout", "host": "h", "pid": 3, "key": 0, "t0": 2.0, "t1": 2.0},
            {"kind": "open", "role": "rollout", "host": "h", "pid": 3, "key": 1, "t0": 1.0, "t1": 1.0},
            {"kind": "sample", "role": "rollout", "host": "h", "pid": 3, "key": 1, "t0": 1.0, "t1": 1.5}]
    # key 1 ended at 1.5; key 0 has no end yet: busy from 2 to the window's end
    assert timeline.idle_fractions(rows, 0.0, 10.0)["rollout"] == pytest.approx(1.0 - (0.5 + 8.0) / 10.0)


def test_recorder_writes_one_line_per_record_and_nothing_without_a_directory(tmp_path):
    rec = timeline.Recorder(str(tmp_path / "tl"))
    opened = rec.open_sample("rollout")
    with rec.timed("actor", "train"):
        pass
    rec.sample("rollout", opened, tokens=7, finish="stop", sample=3)
    [path] = (tmp_path / "tl").glob("*.jsonl")
    assert path.name.startswith(rec.host + "-")
    rows = timeline.read(tmp_path / "tl")
    assert [r["kind"] for r in rows] == ["open", "sample", "span"]  # by start time; open and sample share it
    assert rows[1]["key"] == rows[0]["key"] and rows[1]["tokens"] == 7 and rows[1]["sample"] == 3
    assert rows[2]["role"] == "actor" and rows[2]["t1"] >= rows[2]["t0"]
    (tmp_path / "tl" / "other-999.jsonl").write_text('{"kind": "span", "t0": 1')  # cut by a kill
    assert len(timeline.read(tmp_path / "tl")) == 3
    off = timeline.Recorder(None)
    with off.timed("actor", "train"):
        pass
    assert not off.enabled


def test_tail_reads_only_what_was_appended_and_keeps_what_may_still_matter(tmp_path):
    rec = timeline.Recorder(str(tmp_path))
    rec.span("actor", "train", 1.0, 2.0)
    decoding = rec.open_sample("rollout")
    tail = timeline.Tail(tmp_path)
    assert [r["kind"] for r in tail.read(keep_after_s=0.0)] == ["span", "open"]
    rec.span("actor", "train", 5.0, 6.0)
    rows = tail.read(keep_after_s=3.0)  # the first span ended before the window: dropped
    assert [(r["kind"], r["t0"]) for r in rows] == [("open", decoding[1]), ("span", 5.0)]
    rec.sample("rollout", decoding, tokens=1, finish="stop")
    rows = tail.read(keep_after_s=1e12)  # everything ended before: nothing kept, the open one closed
    assert rows == []


def test_paused_intervals_run_from_each_pause_to_the_next_resume_of_the_same_engine_and_are_cut_out():
    def span(pid, stage, t0, t1):
        return {"kind": "span", "role": "rollout", "host": "h", "pid": pid, "stage": stage, "t0": t0, "t1": t1}

    rows = [span(1, "pause", 2.0, 2.5), span(1, "load_weights", 3.0, 4.0), span(1, "resume", 5.0, 5.5),
            span(2, "pause", 2.1, 2.2), span(2, "resume", 4.5, 4.6),
            span(1, "pause", 8.0, 8.1),  # not resumed within the rows: no interval
            {"kind": "span", "role": "driver", "host": "h", "pid": 9, "stage": "pause", "t0": 0.0, "t1": 1.0}]
    assert sorted(timeline.paused_intervals(rows)) == [(2.2, 4.5), (2.5, 5.0)]
    assert timeline.subtract([(0, 3), (4, 10)], [(2.2, 4.5), (2.5, 5.0), (6, 7)]) == [(0, 2.2), (5.0, 6), (7, 10)]
    assert timeline.subtract([(0, 1)], [(0, 2)]) == [] and timeline.subtract([(0, 1)], []) == [(0, 1)]
