"""`bench schedules`' breakdown of a step from a run's timeline, on hand-made spans."""

from __future__ import annotations

import pytest

from openrlhf_oppo.bench.breakdown import stage_seconds


def _span(stage, t0, t1, role="driver"):
    return {"kind": "span", "role": role, "stage": stage, "t0": t0, "t1": t1}


def _sample(t0, t1):
    return {"kind": "sample", "role": "rollout", "t0": t0, "t1": t1}


def test_stage_seconds_hand_computed():
    rows = [_span("generate", 0, 2), _span("make_experience", 2, 3), _span("train", 3, 5),
            _span("weight_sync", 5, 5.5), _span("train", 4, 5, role="actor"),  # not the driver's
            _sample(1, 4), _sample(3.5, 4.5),  # decoding 1-4.5: 1.5 s of it inside the train span 3-5
            _span("generate", 6, 9)]  # after the window: left out
    got = stage_seconds(rows, t0=0.0, t1=6.0, steps=2)
    assert got == pytest.approx({"generate": 1.0, "make_experience": 0.5, "train": 1.0, "weight_sync": 0.25,
                                 "decode_during_train": 0.75})


def test_a_response_open_on_a_paused_engine_is_not_decoding_while_the_driver_trains():
    """carried_in_training 'hold': the engine's pause call runs 3-3.2, as training starts, and its resume call
    from 5.6, after the weight sync. The response open from 1 to 7 decodes during training only until the
    pause took hold (0.2 s); without the pause and resume spans, all 2 s of training."""
    rows = [_span("generate", 0, 3), _span("train", 3, 5), _span("weight_sync", 5, 5.5),
            {**_span("pause", 3.0, 3.2, role="rollout"), "pid": 7},
            {**_span("resume", 5.6, 5.7, role="rollout"), "pid": 7},
            _sample(1, 7)]
    got = stage_seconds(rows, t0=0.0, t1=6.0, steps=1)
    assert got["decode_during_train"] == pytest.approx(0.2)
    assert stage_seconds(rows[:3] + rows[5:], t0=0.0, t1=6.0, steps=1)["decode_during_train"] == pytest.approx(2.0)
