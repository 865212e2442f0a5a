"""ScorerDispatcher with fake reward actors and the real scheduler: sticky routing,
in-order acknowledgements, a dead actor's restart and re-scoring."""

from __future__ import annotations

import pytest
import ray

from openrlhf_oppo.integrations.runtime.reward_dispatch import REFERENCE, REWARD, ScorerDispatcher, Scorers
from openrlhf_oppo.integrations.runtime.run_config import SCORER_RESTARTS
from openrlhf_oppo.integrations.runtime.scorer import ScoreReply
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter

PROMPT = [101, 102]


def score_of(tokens: list[int]) -> float:
    return float(sum(tokens))


def make_dispatcher(fakes, actors: int = 2, n: int = 2, dead: bool = False):
    """A dispatcher over `actors` fake reward actors for one group of `n` samples (C = 2 tokens),
    opened on the actors; `dead`: every `process` call fails as on a dead actor."""
    sched = fakes.make_scheduler(B=1, n=n, chunk=2)
    plan = sched.begin_step(0)

    def process(extends, finishes):
        if dead:
            return fakes.FakeRef(error=ray.exceptions.RayActorError())
        scores = {sid: score_of(PROMPT + toks) for sid, toks in finishes.items()}
        return ScoreReply(scores, 1.0, 2.0, kv_tokens=10, kv_budget_tokens=100)

    handles = [fakes.make_actor(process=process, open_many=None, init_model_from_pretrained=None)
               for _ in range(actors)]
    meter = StepMeter(scorers=actors, show_progress=False)
    rewards = ScorerDispatcher(handles, sched, meter, "strategy", "/rm", calls=fakes.FakeCalls())
    rewards.begin_step(0)
    rewards.open({sid: PROMPT for sid in plan.admit[0].sample_ids})
    rewards.confirm_opened()
    acked: list[list] = []
    on_scored_many = sched.on_scored_many

    def record(name, chunks):
        acked.append([tuple(c[:4]) for c in chunks])  # (sample_id, start, end, final)
        on_scored_many(name, chunks)

    sched.on_scored_many = record
    return rewards, sched, acked


def test_samples_are_opened_on_their_sticky_actor(fakes):
    rewards, _, _ = make_dispatcher(fakes)
    assert [a.open_many.calls for a in rewards.actors] == [[({0: PROMPT},)], [({1: PROMPT},)]]


def test_chunks_go_to_their_samples_actor_in_one_call_per_actor(fakes):
    rewards, sched, _ = make_dispatcher(fakes)
    rewards.dispatch(sched.on_tokens(0, [1, 2, 3]) + sched.on_tokens(1, [4, 5]))
    assert rewards.actors[0].process.calls == [({0: [1, 2]}, {})]
    assert rewards.actors[1].process.calls == [({1: [4, 5]}, {})]


def test_chunks_arriving_with_their_final_one_are_prefilled_as_one(fakes):
    rewards, sched, _ = make_dispatcher(fakes)
    rewards.dispatch(sched.on_tokens(0, [1, 2, 3]) + sched.on_finished(0, "stop"))
    assert rewards.actors[0].process.calls == [({}, {0: [1, 2, 3]})]
    assert rewards.meter.overlap_tokens == [0, 3]  # sent with the final chunk: not overlapped


def test_a_finished_samples_score_is_acknowledged_to_the_scheduler(fakes):
    rewards, sched, acked = make_dispatcher(fakes)
    rewards.dispatch(sched.on_tokens(0, [1, 2, 3]) + sched.on_finished(0, "stop"))
    rewards.collect()
    assert rewards.scores == {0: score_of(PROMPT + [1, 2, 3])}
    assert acked == [[(0, 0, 2, False), (0, 2, 3, True)]] and rewards.pending == []


def test_an_actors_acks_reach_the_scheduler_in_submission_order(fakes):
    rewards, sched, acked = make_dispatcher(fakes)
    rewards.dispatch(sched.on_tokens(0, [1, 2]))
    rewards.dispatch(sched.on_tokens(0, [3, 4]))
    first, second = rewards.pending
    first.ref.ready = False  # ray.wait reports the later call first
    rewards.collect()
    assert acked == [] and rewards.pending == [first, second]
    first.ref.ready = True
    rewards.collect()
    assert acked == [[(0, 0, 2, False)], [(0, 2, 4, False)]] and rewards.pending == []


def test_a_dead_actor_is_reloaded_reopened_and_its_held_samples_rescored(fakes):
    rewards, sched, acked = make_dispatcher(fakes)
    rewards.dispatch(sched.on_tokens(0, [1, 2, 3]))
    rewards.pending[0].ref.error = ray.exceptions.RayActorError()
    rewards.collect()
    actor = rewards.actors[0]
    assert actor.init_model_from_pretrained.calls == [("strategy", "/rm")]
    assert actor.open_many.calls[-1] == ({0: PROMPT},)
    # its held sample's whole chunks are sent again (the third token waits for its chunk to fill)
    assert actor.process.calls[-1] == ({0: [1, 2]}, {})
    assert rewards.restarts_this_step == 1 and acked == []


def test_more_than_scorer_restarts_deaths_in_a_step_give_up(fakes):
    rewards, sched, _ = make_dispatcher(fakes, dead=True)
    rewards.dispatch(sched.on_tokens(0, [1, 2]))
    for _ in range(SCORER_RESTARTS):
        rewards.collect()  # each restart re-sends sample 0's chunk, which fails again
    with pytest.raises(RuntimeError, match=rf"reward actor 0 died {SCORER_RESTARTS + 1} times in step 0; giving up"):
        rewards.collect()


def test_without_actors_the_dispatcher_does_nothing(fakes):
    sched = fakes.make_scheduler(scorers=())
    rewards = ScorerDispatcher([], sched, StepMeter(scorers=0, show_progress=False), None, None,
                               calls=fakes.FakeCalls())
    rewards.open({0: PROMPT})
    rewards.confirm_opened()
    rewards.dispatch([])
    rewards.collect()
    assert (rewards.pending, rewards.opened, rewards.in_flight()) == ([], {}, [])


def test_trained_samples_are_forgotten(fakes):
    rewards, sched, _ = make_dispatcher(fakes)
    rewards.dispatch(sched.on_tokens(0, [1, 2]) + sched.on_finished(0, "stop"))
    rewards.collect()
    rewards.forget([0, 1])
    assert rewards.scores == {} and rewards.opened == {}


def test_a_sample_is_complete_only_once_the_reward_and_the_reference_actors_both_acknowledged_it(fakes):
    """`Scorers`: every chunk goes to both groups; each acknowledges under its own name, and the
    reference's result (a log-prob per response token) is kept apart from the reward."""
    sched = fakes.make_scheduler(B=1, n=1, chunk=2, scorers=(REWARD, REFERENCE))
    plan = sched.begin_step(0)

    def actor(result):
        process = lambda extends, finishes: ScoreReply({s: result(t) for s, t in finishes.items()}, 1.0, 2.0)  # noqa: E731
        return fakes.make_actor(process=process, open_many=None, init_model_from_pretrained=None)

    meter = StepMeter(scorers=1, show_progress=False)
    reward = ScorerDispatcher([actor(score_of)], sched, meter, None, "/rm", calls=fakes.FakeCalls())
    reference = ScorerDispatcher([actor(lambda toks: [-1.0] * len(toks))], sched,
                                 meter.add_scorer("reference_scorer", 1), None, "/actor", calls=fakes.FakeCalls(),
                                 name=REFERENCE)
    scorers = Scorers(reward, reference)
    scorers.open({sid: PROMPT for sid in plan.admit[0].sample_ids})
    scorers.dispatch(sched.on_tokens(0, [1, 2, 3]) + sched.on_finished(0, "stop"))
    assert reward.actors[0].process.calls == reference.actors[0].process.calls == [({}, {0: [1, 2, 3]})]
    reward.collect()
    assert sched.take_batch() is None  # the reference has not acknowledged yet
    reference.collect()
    assert sched.take_batch() is not None
    assert reward.scores == {0: 6.0} and reference.scores == {0: [-1.0, -1.0, -1.0]}
