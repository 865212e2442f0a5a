"""A run's timeline as Chrome trace-event JSON (`bench.trace_events`, `openrlhf-oppo plot trace`),
on hand-built timeline rows: the format's required keys, and every record of the run on its track."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from openrlhf_oppo import timeline
from openrlhf_oppo.bench import trace_events
from openrlhf_oppo.cli.main import main as cli_main

ORIGIN = 100.0  # the run's first timestamp (the driver's first generate)
RUN_END = 108.0  # its last (OpenRLHF's final ask of the generator)
ENGINE = ("rollout", "n0", 30)


def _span(role, stage, t0, t1, host="n0", pid=10, **attrs):
    return {"kind": "span", "role": role, "host": host, "pid": pid, "stage": stage, "t0": t0, "t1": t1, **attrs}


def _response(key, t0, t1=None, held=0):
    """An engine response's records: its `open` and, unless `t1` is None (still decoding), its `sample`."""
    role, host, pid = ENGINE
    opened = {"kind": "open", "role": role, "host": host, "pid": pid, "key": key, "t0": t0, "t1": t0}
    if t1 is None:
        return [opened]
    return [opened, {"kind": "sample", "role": role, "host": host, "pid": pid, "key": key, "t0": t0, "t1": t1,
                     "tokens": 10 + key, "finish": "stop", "sample": key, "held": held}]


def make_run() -> list[dict]:
    """Two steps (batches at 102 and 106) and OpenRLHF's empty final ask at 108; two actor ranks with the
    same OS pid on two hosts (and a background-sync role in one of them); one engine whose responses
    overlap: sample 1 decodes across step 1's batch, sample 3 decodes on from tokens held at it, key 4
    is still decoding when the run ends."""
    rows = [_span("driver", "generate", 100.0, 102.0), _span("driver", "make_experience", 102.0, 103.0),
            _span("driver", "train", 103.0, 104.0), _span("driver", "weight_sync", 104.0, 104.5),
            _span("driver", "generate", 104.5, 106.0), _span("driver", "train", 106.5, 107.5),
            _span("driver", "generate", 108.0, 108.0),
            _span("actor", "train", 103.0, 104.0, host="n0", pid=20),
            _span("actor", "train", 103.1, 104.2, host="n1", pid=20, tokens=512),
            _span("sync", "send", 104.0, 104.3, host="n0", pid=20),  # beside the actor: a role of its own
            _span("rollout", "load_weights", 104.2, 104.4, host="n0", pid=30)]
    rows += _response(0, 100.1, 101.0) + _response(1, 100.2, 103.0) + _response(2, 101.0, 101.5)
    rows += _response(3, 104.6, 105.0, held=5) + _response(4, 106.5)
    return sorted(rows, key=lambda r: (r["t0"], r["t1"]))


# ------------------------------------------------------------------ the format

REQUIRED = {"X": ("name", "ph", "ts", "dur", "pid", "tid"), "M": ("name", "ph", "pid", "args"),
            "i": ("name", "ph", "ts", "pid", "s")}
METADATA_ARG = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
                "thread_sort_index": "sort_index"}


def format_errors(trace: dict) -> list[str]:
    """What breaks Chrome's trace-event JSON Object Format in `trace` (the phases this module writes)."""
    errors = [f"top-level key {k} missing" for k in ("traceEvents", "displayTimeUnit") if k not in trace]
    if trace.get("displayTimeUnit") not in ("ms", "ns"):
        errors.append(f"displayTimeUnit {trace.get('displayTimeUnit')!r}")
    for i, e in enumerate(trace.get("traceEvents", [])):
        ph = e.get("ph")
        if ph not in REQUIRED:
            errors.append(f"event {i}: phase {ph!r}")
            continue
        errors += [f"event {i} ({ph}): no {k}" for k in REQUIRED[ph] if k not in e]
        if not isinstance(e.get("pid"), int) or ("tid" in e and not isinstance(e["tid"], int)):
            errors.append(f"event {i}: pid/tid not integers")
        if ph in ("X", "i") and not (isinstance(e.get("ts"), (int, float)) and e["ts"] >= 0):
            errors.append(f"event {i}: ts {e.get('ts')!r}")
        if ph == "X" and not (isinstance(e.get("dur"), (int, float)) and e["dur"] >= 0):
            errors.append(f"event {i}: dur {e.get('dur')!r}")
        if ph == "M" and METADATA_ARG.get(e.get("name")) not in e.get("args", {}):
            errors.append(f"event {i}: metadata {e.get('name')!r} without its argument")
        if ph == "i" and e.get("s") not in ("g", "p", "t"):
            errors.append(f"event {i}: instant scope {e.get('s')!r}")
    return errors


def test_the_validator_rejects_what_the_format_forbids():
    good = [{"name": "a", "ph": "X", "ts": 1.0, "dur": 0, "pid": 1, "tid": 0},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "x"}},
            {"name": "c", "ph": "i", "ts": 1, "pid": 1, "s": "p"}]
    bad = [{"name": "a", "ph": "X", "ts": 1.0, "pid": 1, "tid": 0},  # no dur
           {"name": "b", "ph": "X", "ts": 1.0, "dur": -1.0, "pid": 1, "tid": 0},
           {"name": "b", "ph": "X", "ts": 1.0, "dur": 1.0, "pid": "1", "tid": 0},
           {"name": "process_name", "ph": "M", "pid": 1, "args": {}},
           {"name": "c", "ph": "i", "ts": 1.0, "pid": 1, "s": "x"},
           {"name": "d", "ph": "Q", "pid": 1}]
    assert format_errors({"traceEvents": good, "displayTimeUnit": "ms"}) == []
    for e in bad:
        assert format_errors({"traceEvents": [e], "displayTimeUnit": "ms"}), e
    assert format_errors({"traceEvents": good})


def test_the_trace_has_the_trace_event_format_and_survives_a_json_round_trip():
    trace = trace_events.chrome_trace(make_run())
    assert format_errors(trace) == []
    assert {e["ph"] for e in trace["traceEvents"]} == {"X", "M", "i"}
    assert json.loads(json.dumps(trace)) == trace
    assert trace["otherData"]["origin_unix_s"] == ORIGIN


# ------------------------------------------------------------------ the run on its tracks


def _tracks(trace: dict) -> dict[str, int]:
    """process name -> pid."""
    names = [(e["args"]["name"], e["pid"]) for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len({pid for _, pid in names}) == len(names) == len(dict(names)), names
    return dict(names)


def _complete(trace: dict, cat: str | None = None) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and cat in (None, e["cat"])]


def test_one_track_per_worker_and_engine_driver_and_trainers_before_the_engines():
    trace = trace_events.chrome_trace(make_run())
    tracks = _tracks(trace)
    assert set(tracks) == {"steps", "driver n0:10", "actor n0:20", "actor n1:20", "sync n0:20", "rollout n0:30"}
    order = {e["pid"]: e["args"]["sort_index"] for e in trace["traceEvents"] if e["name"] == "process_sort_index"}
    ranked = sorted(tracks, key=lambda name: order[tracks[name]])
    assert ranked[:2] == ["steps", "driver n0:10"] and ranked[-2:] == ["sync n0:20", "rollout n0:30"]


def test_every_span_is_one_complete_event_on_its_workers_track_at_its_own_times():
    rows = make_run()
    trace = trace_events.chrome_trace(rows)
    tracks = _tracks(trace)
    spans = [r for r in rows if r["kind"] == "span"]
    stage_events = [e for e in _complete(trace) if e["cat"] not in ("step", "response")]
    assert len(stage_events) == len(spans)
    for r in spans:
        role, host, pid = timeline.worker(r)
        ts = (r["t0"] - ORIGIN) * 1e6
        dur = (r["t1"] - r["t0"]) * 1e6
        matches = [e for e in stage_events if e["pid"] == tracks[f"{role} {host}:{pid}"] and e["name"] == r["stage"]
                   and e["cat"] == role and e["ts"] == ts and e["dur"] == dur]
        assert len(matches) == 1, r
    assert [e["args"] for e in stage_events if e["pid"] == tracks["actor n1:20"]] == [{"tokens": 512}]


def test_responses_sit_on_their_engine_in_lanes_that_never_overlap():
    trace = trace_events.chrome_trace(make_run())
    engine = _tracks(trace)["rollout n0:30"]
    answers = _complete(trace, "response")
    assert sorted(e["name"] for e in answers) == ["response 4", "sample 0", "sample 1", "sample 2", "sample 3"]
    assert {e["pid"] for e in answers} == {engine} and all(e["tid"] >= 1 for e in answers)
    lanes: dict[int, list[dict]] = {}
    for e in answers:
        lanes.setdefault(e["tid"], []).append(e)
    for events in lanes.values():
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a["name"], b["name"])
    by_name = {e["name"]: e for e in answers}
    assert by_name["sample 2"]["tid"] == by_name["sample 0"]["tid"] != by_name["sample 1"]["tid"]  # a lane reused
    assert by_name["sample 0"]["args"] == {"key": 0, "tokens": 10, "finish": "stop", "sample": 0, "held": 0}


def test_a_response_still_decoding_ends_at_the_runs_last_timestamp_marked_unfinished():
    trace = trace_events.chrome_trace(make_run())
    [still] = [e for e in _complete(trace, "response") if e["args"].get("unfinished")]
    assert still["name"] == "response 4"
    assert still["ts"] == pytest.approx((106.5 - ORIGIN) * 1e6)
    assert still["ts"] + still["dur"] == pytest.approx((RUN_END - ORIGIN) * 1e6)


def test_steps_are_numbered_from_1_and_the_final_empty_ask_is_not_a_step():
    rows = make_run()
    trace = trace_events.chrome_trace(rows)
    steps = sorted(_complete(trace, "step"), key=lambda e: e["ts"])
    assert {e["pid"] for e in steps} == {_tracks(trace)["steps"]}
    assert [e["name"] for e in steps] == ["step 1", "step 2"] and trace["otherData"]["steps"] == 2
    assert [(e["ts"], e["dur"]) for e in steps] == [
        pytest.approx((0.0, 4.5e6)), pytest.approx(((104.5 - ORIGIN) * 1e6, (RUN_END - 104.5) * 1e6))]
    # the final ask stays on the driver's track as what it was
    assert len([e for e in _complete(trace, "driver") if e["name"] == "generate"]) == 3
    # a run whose last step is not trained yet (killed in it) keeps it: a response started in it
    cut = [r for r in rows if not (r["role"] == "driver" and r["t0"] >= 106.5)] + _response(9, 107.0, 107.5)
    cut.append(_span("driver", "generate", 107.0, 107.6))
    assert [s.number for s in trace_events.steps(cut)] == [1, 2, 3]


def test_a_response_carried_across_a_batch_is_coloured_and_marked_at_that_batch():
    trace = trace_events.chrome_trace(make_run())
    engine = _tracks(trace)["rollout n0:30"]
    answers = _complete(trace, "response")
    carried = sorted(e["name"] for e in answers if e["args"].get("carried"))
    # sample 1 decodes across step 1's batch (102); sample 3 decodes on from 5 tokens held at it
    assert carried == ["sample 1", "sample 3"]
    assert {e["cname"] for e in answers if e["args"].get("carried")} == {trace_events.CARRIED_COLOUR}
    assert trace_events.CARRIED_COLOUR not in {e["cname"] for e in answers if not e["args"].get("carried")}
    assert all(e["args"]["carried_into_steps"] == [2] for e in answers if e["args"].get("carried"))
    marks = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert sorted(e["name"] for e in marks) == ["sample 1 carried into step 2", "sample 3 carried into step 2"]
    assert all(e["pid"] == engine and e["s"] == "p" and e["ts"] == pytest.approx(2e6) for e in marks)


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), max_size=40))
def test_lanes_without_a_cap_never_hold_two_overlapping_intervals(spans):
    rows = sorted(({"t0": a, "t1": a + d} for a, d in spans), key=lambda r: r["t0"])
    placed = trace_events.lanes(rows)
    for i, (a, lane_a) in enumerate(zip(rows, placed)):
        for b, lane_b in zip(rows[i + 1:], placed[i + 1:]):
            assert lane_a != lane_b or a["t1"] <= b["t0"] or b["t1"] <= a["t0"]


# ------------------------------------------------------------------ the file and the command


def _write_run(run_dir, rows) -> None:
    (run_dir / "timeline").mkdir(parents=True)
    with open(run_dir / "timeline" / "n0-10.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def test_plot_trace_writes_the_runs_trace_and_says_where_to_open_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write_run(run_dir, make_run())
    assert cli_main(["plot", "trace", str(run_dir)]) == 0
    out = run_dir / "timeline.trace.json"
    trace = json.loads(out.read_text())
    assert format_errors(trace) == [] and trace["otherData"]["steps"] == 2
    printed = capsys.readouterr().out
    assert str(out) in printed and "https://ui.perfetto.dev" in printed
    elsewhere = tmp_path / "t" / "x.json"
    assert cli_main(["plot", "trace", str(run_dir), "--out", str(elsewhere)]) == 0 and elsewhere.exists()


def test_a_run_without_timeline_records_names_the_folder(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "timeline")):
        trace_events.write_chrome_trace(tmp_path)
    assert cli_main(["plot", "trace", str(tmp_path)]) == 2
    assert str(tmp_path / "timeline") in capsys.readouterr().err
    assert not (tmp_path / "timeline.trace.json").exists()
