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
