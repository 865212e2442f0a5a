"""OverlapScheduler on hand-built event streams."""

from __future__ import annotations

import json
import sys
from array import array

import pytest

from openrlhf_oppo.core import StepStats

SCORERS = ("reward", "reference")  # the factory's default scorers

def finish_and_score(sched, sid, reason="stop"):
    for ch in sched.on_finished(sid, reason):
        for name in sched.scorers:
            sched.on_scored(sid, name, ch.end, ch.final)


def stats(reward=0.0):
    return StepStats(mean_reward=reward, generated_tokens=100, generation_time_s=1.0)


def test_core_and_simulator_import_without_heavy_dependencies():
    code = (
        "import sys\n"
        "for m in ('torch', 'ray', 'vllm', 'deepspeed', 'transformers'):\n"
        "    sys.modules[m] = None\n"
        "import openrlhf_oppo.core\n"
        "import openrlhf_oppo.sim.engine, openrlhf_oppo.sim.drivers, openrlhf_oppo.sim.report\n"
        "import openrlhf_oppo.sim.cli\n"
        "print('ok')\n"
    )
    import subprocess

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_figure1_first_four_finished_are_trained_and_two_carried_with_partial_tokens(make_scheduler):
    # Paper Figure 1: B=4, Δ=2. Six prompts run; g1, g5, g4, g0 finish first.
    sched = make_scheduler(batch_groups=4, delta=2, chunk=4)
    plan = sched.begin_step(0)
    assert [g.group_id for g in plan.admit] == [0, 1, 2, 3, 4, 5]
    sids = {g.group_id: g.sample_ids[0] for g in plan.admit}
    lengths = {0: 5, 1: 2, 2: 9, 3: 6, 4: 3, 5: 2}
    for gid, length in lengths.items():
        for ch in sched.on_tokens(sids[gid], list(range(100 * gid, 100 * gid + length)), [-0.5] * length, 0):
            for name in SCORERS:  # each chunk acknowledged, in order, before the final one
                sched.on_scored(sids[gid], name, ch.end)
    for gid in (1, 5, 4, 0):
        assert sched.take_batch() is None
        finish_and_score(sched, sids[gid])
    batch = sched.take_batch()
    assert [g.group_id for g in batch.groups] == [1, 5, 4, 0]
    report = sched.end_step(stats())
    assert set(report.carried_groups) == {2, 3}
    assert report.carried_tokens == 9 + 6
    # the carried samples keep their partial tokens; the next step tops up to B+Δ with 4 new groups
    plan = sched.begin_step(1)
    assert set(plan.carried) == {2, 3} and len(plan.admit) == 4
    assert sched.held_tokens(sids[2]) == list(range(200, 209))
    sched.on_tokens(sids[2], [7, 7], None, 1)
    assert sched.held_tokens(sids[2]) == list(range(200, 209)) + [7, 7]


def test_delta_zero_streaming_off_is_synchronous_ppo(make_scheduler):
    sched = make_scheduler(batch_groups=3, samples_per_group=2, delta=0, stream=False)
    for step in range(3):
        plan = sched.begin_step(step)
        assert plan.carried == () and len(plan.admit) == 3
        assert [g.prompt_index for g in plan.admit] == [3 * step, 3 * step + 1, 3 * step + 2]
        for g in reversed(plan.admit):
            for sid in g.sample_ids:
                assert sched.on_tokens(sid, [1] * 10, None, step) == []  # nothing streamed
                chunks = sched.on_finished(sid)
                assert [(c.start, c.end, c.final) for c in chunks] == [(0, 10, True)]  # one-shot scoring
                for name in SCORERS:
                    sched.on_scored(sid, name, 10, final=True)
        batch = sched.take_batch()
        assert {g.group_id for g in batch.groups} == {g.group_id for g in plan.admit}
        assert sched.end_step(stats()).carried_groups == ()


def test_chunks_are_cut_every_C_tokens_and_final_chunk_holds_the_rest(make_scheduler):
    sched = make_scheduler(batch_groups=1, chunk=4)
    (g,) = sched.begin_step(0).admit
    sid = g.sample_ids[0]
    assert sched.on_tokens(sid, [1, 2, 3], None, 0) == []
    assert [(c.start, c.end) for c in sched.on_tokens(sid, [4, 5, 6, 7, 8, 9], None, 0)] == [(0, 4), (4, 8)]
    assert [(c.start, c.end, c.final) for c in sched.on_finished(sid)] == [(8, 9, True)]


def test_sample_is_not_complete_until_every_scorer_acknowledged_the_final_chunk(make_scheduler):
    sched = make_scheduler(batch_groups=1, chunk=2)
    (g,) = sched.begin_step(0).admit
    sid = g.sample_ids[0]
    for ch in sched.on_tokens(sid, [1, 2], None, 0):
        sched.on_scored(sid, "reward", ch.end)
        sched.on_scored(sid, "reference", ch.end)
    (final,) = sched.on_finished(sid)
    assert (final.start, final.end) == (2, 2)  # empty last chunk: the reward head still has to run
    assert sched.take_batch() is None  # both scorers reached token 2, but no score yet
    sched.on_scored(sid, "reward", 2, final=True)
    assert sched.take_batch() is None
    sched.on_scored(sid, "reference", 2, final=True)
    assert sched.take_batch() is not None


def test_group_is_trained_only_when_all_its_samples_finished(make_scheduler):
    sched = make_scheduler(batch_groups=1, samples_per_group=3, chunk=8)
    (g,) = sched.begin_step(0).admit
    for sid in g.sample_ids[:2]:
        sched.on_tokens(sid, [1], None, 0)
        finish_and_score(sched, sid)
    assert sched.take_batch() is None
    finish_and_score(sched, g.sample_ids[2])
    assert len(sched.take_batch().groups[0].samples) == 3


def test_group_at_max_deferral_must_finish_and_the_batch_waits_for_it(make_scheduler):
    sched = make_scheduler(batch_groups=2, delta=1, max_deferral=1, chunk=8)
    plan = sched.begin_step(0)
    slow = plan.admit[0].sample_ids[0]
    sched.on_tokens(slow, [1, 2, 3], None, 0)
    for g in plan.admit[1:]:
        finish_and_score(sched, g.sample_ids[0])
    assert sched.take_batch() is not None
    sched.end_step(stats())
    plan = sched.begin_step(1)
    assert plan.must_finish == (0,)
    for g in plan.admit:  # the new groups finish first ...
        finish_and_score(sched, g.sample_ids[0])
    assert sched.take_batch() is None  # ... but the batch waits for the forced one
    finish_and_score(sched, slow)
    batch = sched.take_batch()
    assert batch.groups[0].group_id == 0 and batch.groups[0].deferrals == 1
    assert len(batch.groups) == 2


def test_token_policy_versions_and_offpolicy_fraction(make_scheduler):
    sched = make_scheduler(batch_groups=1, delta=1, chunk=100)
    plan = sched.begin_step(0)
    carried, fast = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    sched.on_tokens(carried, [1, 2, 3], [-1.0, -1.0, -1.0], 0)
    finish_and_score(sched, fast)
    sched.take_batch()
    sched.end_step(stats())
    sched.begin_step(1)
    sched.on_tokens(carried, [4], [-2.0], 1)
    finish_and_score(sched, carried)
    batch = sched.take_batch()
    (sample,) = batch.groups[0].samples
    assert sample.token_ids == [1, 2, 3, 4]
    assert sample.token_versions == [0, 0, 0, 1]
    assert sample.rollout_logprobs == [-1.0, -1.0, -1.0, -2.0]
    assert batch.offpolicy_token_fraction == pytest.approx(3 / 4)
    report = sched.end_step(stats())
    assert report.deferral_hist == {"0": 0, "1": 1, "2": 0, "3+": 0}
    assert report.deferred_fraction == 1.0
    assert report.metrics()["oppo/deferral_hist/1"] == 1.0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s, sid: s.on_tokens(999, [1], None, 0), "unknown sample_id 999"),
        (lambda s, sid: s.on_tokens(sid, [1, 2], [0.0], 0), "2 tokens but 1 logprobs"),
        (lambda s, sid: s.on_scored(sid, "critic", 0), "unknown scorer 'critic'"),
        (lambda s, sid: s.on_scored(sid, "reward", 1), r"but \[0, 0\) was sent"),
        (lambda s, sid: s.on_finished(sid, "eos"), "finish reason must be one of"),
        (lambda s, sid: s.on_scored(sid, "reward", 0, final=True), "has not finished"),
    ],
)
def test_bad_events_raise_clear_errors(make_scheduler, call, match):
    sched = make_scheduler(batch_groups=1)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    with pytest.raises(ValueError, match=match):
        call(sched, sid)


def test_tokens_after_finish_and_version_going_back_are_rejected(make_scheduler):
    sched = make_scheduler(batch_groups=1)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    sched.on_tokens(sid, [1], None, 3)
    with pytest.raises(ValueError, match="went back from 3 to 2"):
        sched.on_tokens(sid, [1], None, 2)
    sched.on_finished(sid)
    with pytest.raises(ValueError, match="tokens after on_finished"):
        sched.on_tokens(sid, [1], None, 3)


def test_step_protocol_errors(make_scheduler):
    sched = make_scheduler(batch_groups=1)
    with pytest.raises(RuntimeError, match="begin_step first"):
        sched.take_batch()
    sched.begin_step(0)
    with pytest.raises(RuntimeError, match="before a batch was taken"):
        sched.end_step(stats())
    with pytest.raises(RuntimeError, match="call end_step first"):
        sched.begin_step(1)


def test_delta_max_above_batch_size_is_rejected(make_scheduler):
    with pytest.raises(ValueError, match=r"--oppo\.delta\.max must be <= the rollout batch size \(2"):
        make_scheduler(batch_groups=2, delta=1, max_delta=3)


def test_checkpoint_holds_carried_samples_and_resume_restreams_them(make_scheduler):
    sched = make_scheduler(batch_groups=1, delta=1, chunk=2)
    plan = sched.begin_step(0)
    carried, fast = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    for ch in sched.on_tokens(carried, [5, 6, 7], [-0.1, -0.2, -0.3], 0):
        for name in SCORERS:
            sched.on_scored(carried, name, ch.end)
    finish_and_score(sched, fast)
    sched.take_batch()
    sched.end_step(stats(0.5))
    state = json.loads(json.dumps(sched.state_dict()))  # survives JSON

    resumed = make_scheduler(batch_groups=1, delta=1, chunk=2)
    resumed.load_state_dict(state)
    plan = resumed.begin_step(1)
    assert plan.carried == (0,) and plan.admit[0].prompt_index == 2
    assert [(c.sample_id, c.start, c.end, c.final) for c in plan.restream] == [(carried, 0, 2, False)]
    assert resumed.held_tokens(carried) == [5, 6, 7]
    for ch in plan.restream:
        for name in SCORERS:
            resumed.on_scored_many(name, [ch])
    for ch in resumed.on_tokens(carried, [8], [-0.4], 1):
        for name in SCORERS:
            resumed.on_scored(carried, name, ch.end)
    finish_and_score(resumed, carried)
    batch = resumed.take_batch()
    (sample,) = batch.groups[0].samples
    assert sample.token_ids == [5, 6, 7, 8] and sample.token_versions == [0, 0, 0, 1]
    assert sample.rollout_logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert resumed.trained_groups_total == 2


def test_checkpoint_from_other_shape_is_rejected(make_scheduler):
    sched = make_scheduler(batch_groups=2)
    with pytest.raises(ValueError, match="batch_groups"):
        make_scheduler(batch_groups=3).load_state_dict(sched.state_dict())


def test_logprobs_first_recorded_midway_keep_one_entry_per_token_chunk(make_scheduler):
    sched = make_scheduler(batch_groups=1, chunk=100)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    sched.on_tokens(sid, [1, 2], None, 0)
    sched.on_tokens(sid, [3], [-0.5], 0)
    sched.on_tokens(sid, [4], None, 0)
    finish_and_score(sched, sid)
    (sample,) = sched.take_batch().groups[0].samples
    assert [list(c) for c in sample.token_chunks] == [[1, 2], [3], [4]]
    assert [list(c) for c in sample.logprob_chunks] == [[], [-0.5], []]
    assert sample.rollout_logprobs == [-0.5]


def test_samples_without_logprobs_get_an_empty_entry_per_token_chunk(make_scheduler):
    sched = make_scheduler(batch_groups=2, chunk=100)
    a, b = (g.sample_ids[0] for g in sched.begin_step(0).admit)
    sched.on_tokens(a, [1], None, 0)
    sched.on_tokens(a, [2, 3], None, 0)
    sched.on_tokens(b, [4], None, 0)
    finish_and_score(sched, a)
    finish_and_score(sched, b)
    chunks = {s.sample_id: s.logprob_chunks for g in sched.take_batch().groups for s in g.samples}
    assert [list(c) for c in chunks[a]] == [[], []] and [list(c) for c in chunks[b]] == [[]]


def test_a_new_policy_version_run_leaves_other_samples_runs_alone(make_scheduler):
    sched = make_scheduler(batch_groups=1, delta=1, chunk=100)
    plan = sched.begin_step(0)
    fast, carried = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    sched.on_tokens(fast, [1, 2], None, 0)
    sched.on_tokens(carried, [3], None, 0)  # both start a run at version 0
    finish_and_score(sched, fast)
    fast_sample = sched.take_batch().groups[0].samples[0]
    sched.end_step(stats())
    sched.begin_step(1)
    sched.on_tokens(carried, [4], None, 1)
    finish_and_score(sched, carried)
    carried_sample = sched.take_batch().groups[0].samples[0]
    assert list(fast_sample.version_runs) == [(0, 0)]
    assert list(carried_sample.version_runs) == [(0, 0), (1, 1)]


def test_unknown_sample_in_a_batch_of_events_is_named(make_scheduler):
    sched = make_scheduler(batch_groups=1)
    sid = sched.begin_step(0).admit[0].sample_ids[0]
    with pytest.raises(ValueError, match="unknown sample_id 77"):
        sched.on_tokens_many([(sid, [1], None), (77, [2], None)], 0)
    chunks = sched.on_finished(sid)
    with pytest.raises(ValueError, match="unknown sample_id 78"):
        sched.on_scored_many("reward", [chunks[0], chunks[0]._replace(sample_id=78)])


def test_a_pass_boundary_admits_no_prompt_of_the_next_pass_and_ends_with_a_short_batch(make_scheduler):
    """Prompts 0-9 are one pass (an OpenRLHF episode), B=4, Δ=2: the overcommit stops at the
    boundary, every prompt of the pass is trained before any of the next, and the pass ends
    with the 2 groups left (OpenRLHF's last batch of an episode is short too)."""
    sched = make_scheduler(batch_groups=4, delta=2, stream=False, scorers=())
    per_pass, trained, step = 10, [], 0
    while len(trained) < per_pass:
        boundary = (sched.oldest_prompt_index // per_pass + 1) * per_pass
        plan = sched.begin_step(step, admit_until=boundary)
        assert all(g.prompt_index < per_pass for g in plan.admit)
        for g in plan.admit:  # later prompts finish first: first-B picks them, the early ones are carried
            sched.on_tokens(g.sample_ids[0], [1] * (20 - g.prompt_index), None, step)
        for gid in sorted(sched.in_flight_groups, reverse=True):
            if not sched.is_finished(gid):
                finish_and_score(sched, gid)
        batch = sched.take_batch()
        trained.append([g.prompt_index for g in batch.groups])
        sched.end_step(stats())
        step += 1
        if sum(map(len, trained)) == per_pass:
            break
    assert [len(b) for b in trained] == [4, 4, 2]
    assert sorted(i for b in trained for i in b) == list(range(per_pass))
    assert sched.in_flight_groups == () and sched.next_prompt_index == per_pass
    plan = sched.begin_step(step, admit_until=2 * per_pass)  # the next pass starts full: B + Δ
    assert [g.prompt_index for g in plan.admit] == list(range(10, 16))


def test_admit_until_is_checked_before_the_step_opens(make_scheduler):
    sched = make_scheduler(batch_groups=4)
    for bad in (-1, 2.0, "3"):
        with pytest.raises(ValueError, match="admit_until"):
            sched.begin_step(0, admit_until=bad)
    assert sched.begin_step(0, admit_until=0).admit == ()  # nothing left to admit: a valid, empty step


def test_every_chunk_carries_its_tokens_as_the_engine_handed_them(make_scheduler):
    sched = make_scheduler(batch_groups=1, delta=1, chunk=4, scorers=("reward",))
    plan = sched.begin_step(0)
    sid, other = plan.admit[0].sample_ids[0], plan.admit[1].sample_ids[0]
    assert sched.on_tokens(sid, array("i", [1, 2, 3]), None, 0) == []
    # the first chunk reaches back into the first delta, the second is a slice of this one
    c1, c2 = sched.on_tokens(sid, array("i", [4, 5, 6, 7, 8, 9, 10]), None, 0)
    assert sched.on_tokens(sid, array("i", [11]), None, 0) == []
    (final,) = sched.on_finished(sid)
    assert [(c.start, c.end, list(c.token_ids)) for c in (c1, c2, final)] == [
        (0, 4, [1, 2, 3, 4]), (4, 8, [5, 6, 7, 8]), (8, 11, [9, 10, 11])
    ]
    assert type(c1.token_ids) is array and c1.token_ids.typecode == "i"  # a slice copy, not an int per token
    (empty,) = sched.on_finished(other)
    assert (empty.start, empty.end, tuple(empty.token_ids)) == (0, 0, ())
    (again,) = sched.rescore("reward", [sid])
    assert (again.start, again.end, again.final, list(again.token_ids)) == (0, 11, True, list(range(1, 12)))
