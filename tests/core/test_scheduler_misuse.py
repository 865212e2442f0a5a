"""Every scheduler entry point is all-or-nothing: a rejected call leaves the whole
state as it was, and the call can be retried. Checkpoints are restored whole or not
at all, and reconciled with the new run's flags."""

from __future__ import annotations

import json
import logging
import math
from array import array

import pytest

from openrlhf_oppo.config import ChunkConfig, DeltaConfig
from openrlhf_oppo.core import StepStats
from openrlhf_oppo.core.ledger import check_state

REWARD = ("reward",)
# adaptive C: one trial step per candidate, a new round every 2 steps
ADAPTIVE_C = ChunkConfig(size_tokens=2, adaptive=True, candidates=(2, 4), trial_steps=1, period_steps=2)


def stats(reward=0.5):
    return StepStats(mean_reward=reward, generated_tokens=10, generation_time_s=1.0)


def rejected(sched, frozen, exc, match, call):
    before = frozen(sched)
    with pytest.raises(exc, match=match):
        call()
    assert frozen(sched) == before, "a rejected call changed the scheduler"


def test_a_batch_of_tokens_failing_half_way_records_none_and_a_resend_does_not_duplicate(make_scheduler, frozen):
    sched = make_scheduler(delta=1, chunk=2, scorers=REWARD)
    a, b = (g.sample_ids[0] for g in sched.begin_step(0).admit)
    rejected(sched, frozen, ValueError, "unknown sample_id 99",
             lambda: sched.on_tokens_many([(a, array("i", [1, 2, 3]), None), (99, array("i", [4]), None)], 0))
    rejected(sched, frozen, ValueError, "2 tokens but 1 logprobs",
             lambda: sched.on_tokens_many([(a, [1, 2, 3], None), (b, [4, 5], [0.1])], 0))
    chunks = sched.on_tokens_many([(a, array("i", [1, 2, 3]), None)], 0)  # the re-send
    assert [(c.start, c.end) for c in chunks] == [(0, 2)]  # the chunk cut inside the failed call is returned now
    assert sched.held_tokens(a) == [1, 2, 3]


def test_float_token_ids_and_a_missing_policy_version_are_refused(make_scheduler, frozen):
    sched = make_scheduler(delta=1, chunk=2, scorers=REWARD)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    rejected(sched, frozen, TypeError, "token ids must be ints", lambda: sched.on_tokens(sid, [1.0, 2.0], None, 0))
    rejected(sched, frozen, TypeError, "token ids must be ints", lambda: sched.on_tokens(sid, [True], None, 0))
    rejected(sched, frozen, TypeError, "policy_version must be an int", lambda: sched.on_tokens(sid, [1], None, None))
    rejected(sched, frozen, TypeError, "policy_version must be an int", lambda: sched.on_tokens(sid, [1], None, -1))
    sched.on_tokens(sid, [1], None, 2)
    rejected(sched, frozen, ValueError, "went back from 2 to 1", lambda: sched.on_tokens(sid, [1], None, 1))
    rejected(sched, frozen, TypeError, "step must be an int", lambda: sched.begin_step(1.0))


def test_a_batch_of_acknowledgements_failing_half_way_applies_none(make_scheduler, frozen):
    sched = make_scheduler(delta=0, chunk=2, scorers=REWARD)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    c1, c2 = sched.on_tokens(sid, [1, 2, 3, 4], None, 0)
    rejected(sched, frozen, ValueError, r"acknowledged \[0, 9\)",
             lambda: sched.on_scored_many("reward", [c1, c1._replace(end=9)]))
    sched.on_scored_many("reward", [c1, c2])
    (final,) = sched.on_finished(sid)
    sched.on_scored_many("reward", [final])
    assert sched.take_batch() is not None


def test_a_final_chunk_acknowledged_before_the_earlier_ones_is_refused_and_in_order_still_works(make_scheduler, frozen):
    sched = make_scheduler(delta=0, chunk=2, scorers=REWARD)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    c1, c2 = sched.on_tokens(sid, [1, 2, 3, 4], None, 0)
    (final,) = sched.on_finished(sid)
    rejected(sched, frozen, ValueError, "acknowledged in order", lambda: sched.on_scored_many("reward", [final]))
    rejected(sched, frozen, ValueError, "acknowledged in order", lambda: sched.on_scored_many("reward", [c2, c1]))
    assert sched.take_batch() is None
    for ch in (c1, c2, final):
        sched.on_scored_many("reward", [ch])
    assert sched.take_batch() is not None


def test_a_final_acknowledgement_up_to_the_end_before_the_earlier_chunks_is_refused(make_scheduler, frozen):
    # on_scored(final=True) acknowledges [0, end): it must not skip the chunks sent before the final one
    sched = make_scheduler(delta=0, chunk=2, scorers=REWARD)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    c1, c2 = sched.on_tokens(sid, [1, 2, 3, 4, 5], None, 0)
    (final,) = sched.on_finished(sid)
    rejected(sched, frozen, ValueError, "acknowledged in order", lambda: sched.on_scored(sid, "reward", 5, final=True))
    rejected(sched, frozen, ValueError, "acknowledged in order",
             lambda: sched.on_scored_many("reward", [(sid, 0, 5, True)]))
    sched.on_scored_many("reward", [c1])
    rejected(sched, frozen, ValueError, "acknowledged in order", lambda: sched.on_scored(sid, "reward", 5, final=True))
    sched.on_scored(sid, "reward", c2.end)
    assert sched.take_batch() is None
    sched.on_scored(sid, "reward", final.end, final=True)
    assert sched.take_batch() is not None


def test_a_final_acknowledgement_skipping_a_chunk_at_the_last_token_is_refused(make_scheduler, frozen):
    sched = make_scheduler(delta=0, chunk=2, scorers=REWARD)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    c1, c2 = sched.on_tokens(sid, [1, 2, 3, 4], None, 0)
    (final,) = sched.on_finished(sid)
    assert (final.start, final.end) == (4, 4)  # the unacknowledged [2, 4) ends where the final chunk does
    sched.on_scored_many("reward", [c1])
    rejected(sched, frozen, ValueError, "acknowledged in order", lambda: sched.on_scored(sid, "reward", 4, final=True))
    sched.on_scored_many("reward", [c2, final])
    assert sched.take_batch() is not None


def test_a_restarted_scorers_whole_final_chunk_is_acknowledged_and_the_others_keep_their_order(make_scheduler, frozen):
    sched = make_scheduler(delta=0, chunk=2, scorers=("reward", "reference"))
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    c1, c2 = sched.on_tokens(sid, [1, 2, 3, 4, 5], None, 0)
    (final,) = sched.on_finished(sid)
    sched.on_scored_many("reference", [c1])
    (again,) = sched.rescore("reward", [sid])
    assert (again.start, again.end, again.final) == (0, 5, True)  # the reward scorer's final chunk starts at 0
    sched.on_scored_many("reward", [again])
    rejected(sched, frozen, ValueError, "acknowledged in order",
             lambda: sched.on_scored(sid, "reference", 5, final=True))
    sched.on_scored_many("reference", [c2, final])
    assert sched.take_batch() is not None


def test_end_step_with_bad_stats_changes_nothing_and_a_retry_counts_deferrals_once(make_scheduler, frozen):
    # adaptive C: a double update used to raise KeyError
    sched = make_scheduler(delta=1, chunk=ADAPTIVE_C, scorers=REWARD)
    plan = sched.begin_step(0)
    fast, carried = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    sched.on_tokens(carried, [1], None, 0)
    for ch in sched.on_finished(fast):
        sched.on_scored_many("reward", [ch])
    sched.take_batch()
    rejected(sched, frozen, ValueError, "mean reward is nan", lambda: sched.end_step(stats(math.nan)))
    rejected(sched, frozen, ValueError, "generated_tokens", lambda: sched.end_step(StepStats(0.0, -1, 1.0)))
    rejected(sched, frozen, ValueError, "generation_time_s", lambda: sched.end_step(StepStats(0.0, 1, math.inf)))
    rejected(sched, frozen, ValueError, "forced_wait_s", lambda: sched.end_step(StepStats(0.0, 1, 1.0, -0.1)))
    report = sched.end_step(stats())
    assert report.carried_groups == (1,)
    assert sched.state_dict()["groups"][0]["deferrals"] == 1
    rejected(sched, frozen, RuntimeError, "without begin_step", lambda: sched.end_step(stats()))


def test_step_protocol_misuse_changes_nothing(make_scheduler, frozen):
    sched = make_scheduler(delta=1, chunk=2, scorers=REWARD)
    rejected(sched, frozen, RuntimeError, "begin_step first", sched.take_batch)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    rejected(sched, frozen, RuntimeError, "call end_step first", lambda: sched.begin_step(1))
    rejected(sched, frozen, RuntimeError, "before a batch was taken", lambda: sched.end_step(stats()))
    rejected(sched, frozen, ValueError, "finish reason must be one of", lambda: sched.on_finished(sid, "eos"))
    sched.on_finished(sid)
    rejected(sched, frozen, ValueError, "called twice", lambda: sched.on_finished(sid))
    rejected(sched, frozen, ValueError, "tokens after on_finished", lambda: sched.on_tokens(sid, [1], None, 0))


def _carrying_checkpoint(make_scheduler, **overrides):
    """A checkpoint after step 0 of B=1, Δ=1: group 0 trained, group 1 carried with 3 tokens."""
    sched = make_scheduler(**{"delta": 1, "chunk": 2, "scorers": REWARD, **overrides})
    plan = sched.begin_step(0)
    fast, carried = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    for ch in sched.on_tokens(carried, [5, 6, 7], None, 0):
        sched.on_scored_many("reward", [ch])
    for ch in sched.on_finished(fast):
        sched.on_scored_many("reward", [ch])
    sched.take_batch()
    sched.end_step(stats())
    return carried, json.loads(json.dumps(sched.state_dict()))


def test_tokens_between_load_and_begin_step_are_streamed_once_with_the_checkpoints_C(make_scheduler):
    carried, state = _carrying_checkpoint(make_scheduler, chunk=2)
    resumed = make_scheduler(delta=1, chunk=3, scorers=REWARD)  # the constructor's C differs from the checkpoint's
    resumed.load_state_dict(state)
    assert resumed.on_tokens(carried, [8, 9], None, 1) == []  # no chunk now: the restream sends everything
    assert resumed.on_finished(carried) == []
    plan = resumed.begin_step(1)
    assert plan.chunk_size_tokens == 3
    assert [(c.start, c.end, c.final) for c in plan.restream] == [(0, 3, False), (3, 5, True)]
    resumed.on_scored_many("reward", plan.restream)
    batch = resumed.take_batch()
    assert [s.token_ids for g in batch.groups for s in g.samples if s.sample_id == carried] == [[5, 6, 7, 8, 9]]


def test_resume_with_delta_disabled_clamps_the_checkpoints_delta_with_a_notice(make_scheduler, caplog):
    _, state = _carrying_checkpoint(make_scheduler, delta=1)
    assert state["delta"]["value"] == 1
    resumed = make_scheduler(delta=DeltaConfig(enable=False), chunk=2, scorers=REWARD)
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(state)
    assert "Δ=1 becomes Δ=0 (--oppo.delta.enable is false)" in caplog.text
    plan = resumed.begin_step(1)
    assert plan.delta == 0 and plan.admit == ()  # B=1 is taken by the carried group: it drains first


def test_resume_with_new_chunk_candidates_starts_a_new_round(make_scheduler, caplog):
    _, state = _carrying_checkpoint(make_scheduler, chunk=ADAPTIVE_C)
    new_c = ChunkConfig(size_tokens=8, adaptive=True, candidates=(8, 16), trial_steps=1, period_steps=2)
    resumed = make_scheduler(delta=DeltaConfig(init=1, max=1), chunk=new_c, scorers=REWARD)
    with caplog.at_level(logging.WARNING):
        resumed.load_state_dict(state)
    assert "not all in --oppo.chunk.candidates [8, 16]" in caplog.text
    assert resumed.begin_step(1).chunk_size_tokens == 8


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda st: st["groups"][0]["samples"][0]["tokens"][0].__setitem__(0, 1.5), "tokens must be ints"),
        (lambda st: st["groups"][0]["samples"][0].__setitem__("finish_reason", "eos"), "finish reason 'eos'"),
        (lambda st: st["groups"][0].__setitem__("group_id", 7), "do not belong to it"),
        (lambda st: st["groups"][0]["samples"][0].__setitem__("version_runs", [[1, 0]]), "do not fit"),
        (lambda st: st.__setitem__("ledger", st["ledger"] * 2), "trained twice"),
        (lambda st: st.__setitem__("ledger", []), "neither trained nor held"),
        (lambda st: st.pop("totals"), "malformed"),
    ],
)
def test_a_malformed_checkpoint_is_refused_and_leaves_the_scheduler_fresh(make_scheduler, frozen, edit, match):
    _, state = _carrying_checkpoint(make_scheduler)
    edit(state)
    fresh = make_scheduler(delta=1, chunk=2, scorers=REWARD)
    rejected(fresh, frozen, ValueError, match, lambda: fresh.load_state_dict(state))


def test_the_checkpoints_ledger_lists_every_trained_group_once(make_scheduler):
    carried, state = _carrying_checkpoint(make_scheduler)
    assert state["ledger"] == [0, 0, 0, 0, 0]  # group 0 at prompt 0, admitted and trained at step 0, not deferred
    assert check_state(state) == []
    resumed = make_scheduler(delta=1, chunk=2, scorers=REWARD)
    resumed.load_state_dict(state)
    resumed.on_scored_many("reward", resumed.begin_step(1).restream)
    for ch in resumed.on_finished(carried):
        resumed.on_scored_many("reward", [ch])
    for ch in resumed.on_finished(2):
        resumed.on_scored_many("reward", [ch])
    resumed.take_batch()
    resumed.end_step(stats())
    assert resumed.ledger == [(0, 0, 0, 0, 0), (1, 1, 0, 1, 1)]
    assert check_state(resumed.state_dict()) == []


def test_a_restarted_scorer_gets_every_held_token_again_and_completion_waits_for_it(make_scheduler, frozen):
    sched = make_scheduler(batch_groups=1, delta=1, chunk=2, scorers=REWARD)
    plan = sched.begin_step(0)
    done, partial = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    sched.on_scored_many("reward", sched.on_tokens(done, [1, 2, 3], None, 0) + sched.on_finished(done))
    sched.on_scored_many("reward", sched.on_tokens(partial, [4, 5, 6], None, 0))
    rejected(sched, frozen, ValueError, "unknown sample_id 99", lambda: sched.rescore("reward", [done, 99]))
    chunks = sched.rescore("reward", [done, partial])
    assert [(c.sample_id, c.start, c.end, c.final) for c in chunks] == [(done, 0, 3, True), (partial, 0, 2, False)]
    assert sched.take_batch() is None  # the finished sample's score is gone with the scorer
    sched.on_scored_many("reward", chunks)
    batch = sched.take_batch()
    assert [s.token_ids for g in batch.groups for s in g.samples] == [[1, 2, 3]]
