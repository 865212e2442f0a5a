"""The fits of `simulate calibrate` on hand-made timelines with known costs."""

from __future__ import annotations

import pytest

from oppo_lab.sim import fitting

STEP_S, PER_SEQ_S, DECODE_SLOW = 0.004, 0.001, 2.5  # an iteration: (0.004 + 0.001 b) x 2.5 beside training
SCORING = 1.3  # ... x 1.3 beside a streaming scorer's prefill (the trainer idle)


def span(stage, t0, t1, role="driver"):
    return {"kind": "span", "role": role, "host": "n0", "pid": 1, "stage": stage, "t0": t0, "t1": t1}


def response(t0, t1, tokens, key):
    return [{"kind": "open", "role": "rollout", "host": "n0", "pid": 2, "key": key, "t0": t0, "t1": t0},
            {"kind": "sample", "role": "rollout", "host": "n0", "pid": 2, "key": key, "t0": t0, "t1": t1,
             "tokens": tokens, "finish": "stop"}]


def test_a_life_is_cut_where_the_batch_or_the_trainer_changes():
    rows = (response(0.0, 10.0, 100, 0) + response(2.0, 6.0, 50, 1) + [span("train", 5.0, 8.0)]
            + [span("prefill", 1.0, 1.5, role="reward"), span("score", 7.0, 9.0, role="reward")])
    lives = sorted(fitting.decode_lives(rows, warmup_steps=0), key=lambda life: -life.tokens)
    # a scorer's span counts only while the trainer is idle (7-8 is the trainer's)
    assert lives[0].seconds == pytest.approx({(1, False, False): 2.5, (1, False, True): 1.5, (2, False, False): 3.0,
                                              (2, True, False): 1.0, (1, True, False): 2.0})
    assert lives[1].seconds == pytest.approx({(2, False, False): 3.0, (2, True, False): 1.0})


def test_responses_before_the_warm_up_syncs_end_or_across_a_sync_are_left_out():
    rows = (response(0.0, 1.0, 10, 0) + [span("weight_sync", 1.0, 1.5)] + response(1.2, 3.0, 10, 1)
            + response(2.0, 3.0, 10, 2) + [span("weight_sync", 4.0, 4.5)] + response(5.0, 6.0, 10, 3))
    assert [life.tokens for life in fitting.decode_lives(rows, warmup_steps=1)] == [10, 10]  # keys 2 and 3
    assert len(fitting.decode_lives(rows, warmup_steps=2)) == 1


def test_the_decode_fit_recovers_the_iteration_cost_and_the_slowdowns_beside_training_and_scoring():
    rows, t, key = [], 0.0, 0
    for b, tokens, beside in [(1, 200, ""), (4, 100, ""), (8, 50, ""), (2, 1200, "train"), (6, 800, "train"),
                              (3, 900, "score"), (5, 400, "score")]:
        dur = tokens * (STEP_S + PER_SEQ_S * b) * {"": 1.0, "train": DECODE_SLOW, "score": SCORING}[beside]
        for _ in range(b):
            rows += response(t, t + dur, tokens, key)
            key += 1
        if beside:
            rows.append(span("make_experience", t, t + dur) if beside == "train"
                        else span("prefill", t, t + dur, role="ref"))
        t += dur + 1.0
    fit = fitting.fit_decode(fitting.decode_lives(rows, 0), prior_slowdown=1.5)
    assert (fit.step_s, fit.per_seq_s, fit.slowdown, fit.scoring) == pytest.approx(
        (STEP_S, PER_SEQ_S, DECODE_SLOW, SCORING))
    assert fit.slowdown_measured and fit.scoring_measured and fit.responses == 29


def test_a_slowdown_seen_for_a_few_response_seconds_only_is_the_prior():
    rows = response(0.0, 10.0, 1000, 0) + response(20.0, 21.0, 100, 1) + [span("prefill", 20.0, 21.0, role="reward")]
    fit = fitting.fit_decode(fitting.decode_lives(rows, 0), prior_slowdown=1.5, prior_scoring=0.0)
    assert not fit.scoring_measured and fit.scoring == 0.0  # 1 s beside a scorer: not enough to tell


def test_without_decoding_beside_training_the_decode_slowdown_is_the_prior():
    rows = response(0.0, 1.0, 200, 0) + response(2.0, 2.5, 50, 1) + response(2.0, 2.5, 50, 2)
    fit = fitting.fit_decode(fitting.decode_lives(rows, 0), prior_slowdown=1.5, prior_scoring=0.0)
    assert not fit.slowdown_measured and fit.slowdown == 1.5
    assert not fit.scoring_measured and fit.scoring == 0.0


def test_the_phase_fit_recovers_each_line_and_the_shared_slowdown():
    points = []
    for stage, over, per in (("make_experience", 0.3, 2e-4), ("train", 0.05, 6e-4)):
        for tokens, share in ((2000, 0.0), (6000, 0.0), (9000, 0.0), (3000, 1.0), (5000, 0.5), (8000, 0.25)):
            points.append(fitting.PhasePoint(stage, tokens, over + per * tokens * (1 + 0.4 * share), share))
    lines, slowdown, measured = fitting.fit_phases(points, prior_slowdown=1.0)
    assert measured and slowdown == pytest.approx(1.4)
    assert lines["make_experience"] == pytest.approx((0.3, 2e-4))
    assert lines["train"] == pytest.approx((0.05, 6e-4))


def test_without_spans_beside_decoding_the_train_slowdown_is_the_prior():
    points = [fitting.PhasePoint("train", t, 0.1 + 1e-4 * t, 0.0) for t in (1000, 2000, 4000)]
    assert fitting.fit_phases(points, prior_slowdown=1.25)[1:] == (1.25, False)


def test_one_phase_slowdown_fits_modes_that_overlap_decoding_by_different_shares():
    # two "modes" on one host with the same k = 0.6: one trains mostly beside decoding, one hardly
    points = [fitting.PhasePoint(stage, tokens, over + per * tokens * (1 + 0.6 * share), share)
              for stage, over, per in (("make_experience", 0.3, 2e-4), ("train", 0.05, 6e-4))
              for tokens, share in ((2000, 0.0), (7000, 0.0), (3000, 0.9), (8000, 1.0), (4000, 0.2), (9000, 0.1))]
    lines, slowdown, measured = fitting.fit_phases(points, prior_slowdown=1.0)
    assert measured and slowdown == pytest.approx(1.6)
