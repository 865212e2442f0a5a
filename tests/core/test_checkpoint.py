"""The scheduler's checkpoint: written, loaded and written again, it is the same dict;
the checkpoint module works on the in-flight record, never on the scheduler."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from openrlhf_oppo.config import ChunkConfig, DeltaConfig
from openrlhf_oppo.core import StepStats, checkpoint

REWARD = ("reward",)


def _round_trip(sched, make):
    state = sched.state_dict()
    fresh = make()
    fresh.load_state_dict(json.loads(json.dumps(state)))
    return state, fresh.state_dict()


def test_a_chunk_trial_step_without_tokens_keeps_its_measurement_across_a_load(make_scheduler):
    # Found by random event streams with restarts: candidates [4, 11, 1], one trial step each,
    # every sample finished empty. The start value C=8 is no candidate; the load took the
    # checkpoint for one of other candidates and started a new round, losing the measurement.
    chunk = ChunkConfig(size_tokens=8, adaptive=True, candidates=(4, 11, 1), trial_steps=1, period_steps=3)

    def make():
        return make_scheduler(1, 1, REWARD, delta=DeltaConfig(enable=False), chunk=chunk)

    sched = make()
    for step in range(4):
        plan = sched.begin_step(step)
        for sid in plan.admit[0].sample_ids:
            sched.on_scored_many("reward", sched.on_finished(sid))  # no token: one empty final chunk
        assert sched.take_batch() is not None
        sched.end_step(StepStats(mean_reward=0.0, generated_tokens=0, generation_time_s=1.0))
        before, after = _round_trip(sched, make)
        assert after == before
    assert before["chunk"]["trial_queue"] == [4, 11, 1]  # the second round started, as before the fix


def test_mid_round_the_loaded_controller_goes_on_with_the_same_trials(make_scheduler):
    chunk = ChunkConfig(size_tokens=8, adaptive=True, candidates=(4, 11, 1), trial_steps=1, period_steps=3)

    def make():
        return make_scheduler(1, 1, REWARD, delta=DeltaConfig(enable=False), chunk=chunk)

    sched = make()
    plan = sched.begin_step(0)
    sched.on_scored_many("reward", sched.on_finished(plan.admit[0].sample_ids[0]))
    sched.take_batch()
    sched.end_step(StepStats(0.0, 0, 1.0))
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(sched.state_dict())))
    assert resumed.state_dict()["chunk"] == {
        "best": 8, "steps_since_round": 1, "trial_queue": [11, 1], "tokens": {"4": 0}, "seconds": {"4": 1.0},
    }
    assert resumed.begin_step(1).chunk_size_tokens == 11


def test_a_load_keeps_the_completion_order_until_the_scorers_have_seen_everything_again(make_scheduler):
    # B=2, Δ=2: four groups complete, two are trained, two are carried complete, in the order 2, 0
    def make():
        return make_scheduler(2, 1, REWARD, delta=2, chunk=2)

    sched = make()
    plan = sched.begin_step(0)
    for gid in (1, 3, 2, 0):
        sid = plan.admit[gid].sample_ids[0]
        sched.on_scored_many("reward", sched.on_tokens(sid, [gid, 7, 7], None, 0) + sched.on_finished(sid))
    assert [g.group_id for g in sched.take_batch().groups] == [1, 3]
    sched.end_step(StepStats(0.0, 9, 1.0))
    before, after = _round_trip(sched, make)
    assert before["complete_order"] == [2, 0] and after == before


def test_the_checkpoint_module_does_not_import_the_scheduler():
    source = Path(checkpoint.__file__).read_text()
    imported = [
        node.module or "" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
    ] + [a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for a in node.names]
    assert not [m for m in imported if "scheduler" in m]
    assert "OverlapScheduler" not in source
