"""Async admission (``staleness.max_policy_lag`` N >= 1): the next step's groups are
admitted as soon as a batch is taken and decode while the trainer trains, with the
weights of the step just taken; the weight sync then bumps the version. A random driver
plays engine, scorers and trainer in that order; every batch must hold only tokens at
most N versions older than the step that trains them, and every admitted group is
trained exactly once or still held. Decoded tokens may reach the scheduler late, as an
engine's reply does (a sample may hold tokens the scheduler has not seen yet)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_oppo.config import DeltaConfig, OppoConfig, StalenessConfig
from openrlhf_oppo.core import StepStats


@st.composite
def async_setups(draw):
    B = draw(st.integers(1, 4))
    lag = draw(st.integers(1, 3))
    if lag == 1:  # no room to carry: Δ off (the config refuses anything else)
        delta = DeltaConfig(enable=False)
    else:
        dmax = draw(st.integers(0, B))
        delta = DeltaConfig(init=draw(st.integers(0, dmax)), min=0, max=dmax, window_steps=2,
                            rule=draw(st.sampled_from(["system", "eq4", "alg1"])))
    return dict(B=B, n=draw(st.integers(1, 3)), lag=lag, delta=delta,
                scorers=draw(st.sampled_from([(), ("reward",)])), stream=draw(st.booleans()),
                max_deferral=draw(st.integers(1, 4)), steps=draw(st.integers(2, 8)),
                checkpoint=draw(st.booleans()))


class AsyncDriver:
    def __init__(self, setup, data, make_scheduler):
        self.setup, self.data, self.make_scheduler = setup, data, make_scheduler
        self.sched = self.new_scheduler()
        self.admitted: dict[int, tuple[int, ...]] = {}
        self.length: dict[int, int] = {}  # sample -> tokens it will have
        self.tokens: dict[int, list[int]] = {}  # sample -> versions of the tokens sent
        self.finished: set[int] = set()  # decoded to their end (their finish may still be on its way)
        self.outbox: dict[int, list] = {}  # sample -> [(version, tokens, finished)] decoded, not yet delivered
        self.pending: list = []  # chunks the scorer has not acknowledged
        self.trained: list[int] = []

    def new_scheduler(self):
        s = self.setup
        return self.make_scheduler(s["B"], s["n"], s["scorers"], delta=s["delta"], chunk=3, stream=s["stream"],
                                   max_deferral=s["max_deferral"], max_lag=s["lag"])

    def admit(self, plan):
        for g in plan.admit:
            self.admitted[g.group_id] = g.sample_ids
            for sid in g.sample_ids:
                self.length[sid], self.tokens[sid] = self.data.draw(st.integers(0, 9)), []

    def live(self):
        return [sid for gid in self.sched.in_flight_groups for sid in self.admitted[gid] if sid not in self.finished]

    def decode(self, sid, version, until_end=False):
        """Decode tokens of ``sid`` with ``version`` (and its finish when it reaches its length);
        delivered now or later."""
        left = self.length[sid] - len(self.tokens[sid])
        k = left if until_end else self.data.draw(st.integers(0, min(left, 4)))
        self.tokens[sid] += [version] * k
        done = len(self.tokens[sid]) == self.length[sid]
        if done:
            self.finished.add(sid)
        self.outbox.setdefault(sid, []).append((version, k, done))
        if until_end or self.data.draw(st.integers(0, 3)) == 0:  # mostly late: as an engine's reply
            self.deliver(sid)

    def deliver(self, sid):
        for version, k, done in self.outbox.pop(sid, ()):
            self.pending += self.sched.on_tokens(sid, [7] * k, None, version)
            if done:
                self.pending += self.sched.on_finished(sid, "stop")

    def deliver_all(self):
        for sid in list(self.outbox):
            self.deliver(sid)

    def ack_all(self):
        if self.setup["scorers"]:
            self.sched.on_scored_many("reward", self.pending)
        self.pending = []

    def play(self, version, events):
        """Random decoding and scoring with the engines at ``version``; a batch the moment one forms
        (a driver asks after every engine reply)."""
        for _ in range(events):
            live = self.live()
            if live:
                self.decode(self.data.draw(st.sampled_from(live)), version)
            if self.data.draw(st.booleans()):
                self.ack_all()

    def take(self, step, plan):
        """Generation phase of ``step`` (engines at version ``step``) until the batch forms:
        forced groups are decoded to their end first, then the others in random order."""
        self.play(step, self.data.draw(st.integers(0, 12)))
        self.ack_all()
        batch = self.sched.take_batch()
        order = sorted(self.data.draw(st.permutations(self.live() + list(self.outbox))),
                       key=lambda sid: self.sched.group_of(sid) not in plan.must_finish)
        while batch is None:
            sid = order.pop(0)
            if sid in self.finished:
                self.deliver(sid)
            else:
                self.decode(sid, step, until_end=True)
            self.ack_all()
            batch = self.sched.take_batch()
        return batch

    def check(self, batch, step):
        lag = self.setup["lag"]
        assert len(batch.groups) <= self.setup["B"]
        for g in batch.groups:
            for s in g.samples:
                assert s.token_versions == self.tokens[s.sample_id]
                assert all(step - v <= lag for v in s.token_versions), (
                    f"step {step} trains tokens of versions {s.token_versions}: more than {lag} behind")
        counted = sum(batch.lag_tokens.values())
        assert counted == sum(len(self.tokens[s.sample_id]) for g in batch.groups for s in g.samples)
        assert all(batch.lag_tokens[b] == 0 for b in ("0", "1", "2", "3+") if b != "3+" and int(b) > lag)
        self.trained += [g.group_id for g in batch.groups]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=async_setups(), data=st.data())
def test_async_admission_trains_no_token_more_than_max_policy_lag_behind(setup, data, make_scheduler):
    d = AsyncDriver(setup, data, make_scheduler)
    plan = d.sched.begin_step(0)
    d.admit(plan)
    for step in range(setup["steps"]):
        batch = d.take(step, plan)
        d.check(batch, step)
        d.sched.end_step(StepStats(0.0, 1, 1.0))
        plan = d.sched.begin_step(step + 1)  # async: at once, before the weights of `step` are trained
        d.admit(plan)
        d.play(step, data.draw(st.integers(0, 12)))  # decoding while the trainer trains: still version `step`
        if setup["checkpoint"] and data.draw(st.booleans()):  # a checkpoint between the update and the next batch
            d.deliver_all()  # (a real restart loses undelivered tokens and restarts from the held ones)
            d.ack_all()
            state = json.loads(json.dumps(d.sched.state_dict()))
            d.sched = d.new_scheduler()
            d.sched.load_state_dict(state)
            plan = d.sched.begin_step(step + 1)  # the resumed run begins that step again
            assert plan.admit == ()
            d.pending = list(plan.restream)
    assert len(d.trained) == len(set(d.trained))
    held = set(d.sched.in_flight_groups)
    assert held | set(d.trained) == set(d.admitted) and not held & set(d.trained)


def test_forced_by_lag_hand_computed(make_scheduler):
    # B = 1, n = 1, Δ = 1, lag 2. Step 0 admits g0, g1; g0 trains; g1 holds a version-0 token.
    sched = make_scheduler(1, 1, (), delta=1, stream=False, max_deferral=5, max_lag=2)
    plan = sched.begin_step(0)
    assert [g.group_id for g in plan.admit] == [0, 1]
    sched.on_tokens(1, [5], None, 0)
    sched.on_tokens(0, [5], None, 0)
    sched.on_finished(0)
    assert [g.group_id for g in sched.take_batch().groups] == [0]
    sched.end_step(StepStats(0.0, 2, 1.0))
    # step 1 begins before the sync: g1's token (version 0) would be 2 behind at step 2: allowed, not forced
    plan = sched.begin_step(1)
    assert plan.must_finish == () and [g.group_id for g in plan.admit] == [2]
    sched.on_finished(2, "stop")
    assert [g.group_id for g in sched.take_batch().groups] == [2]
    sched.end_step(StepStats(0.0, 0, 1.0))
    # at step 2 it would be 3 behind at step 3: forced now, and the batch waits for it
    plan = sched.begin_step(2)
    assert plan.must_finish == (1,) and [g.group_id for g in plan.admit] == [3]
    assert not sched.waiting_on_forced  # no group complete: the batch waits for B, not only for g1
    sched.on_finished(3, "stop")
    assert sched.take_batch() is None
    assert sched.waiting_on_forced  # g3 alone would make the batch: only the bound holds it
    sched.on_tokens(1, [6], None, 2)
    sched.on_finished(1, "stop")
    batch = sched.take_batch()
    assert [g.group_id for g in batch.groups] == [1] and batch.lag_tokens == {"0": 1, "1": 0, "2": 1, "3+": 0}
    assert not sched.waiting_on_forced
    report = sched.end_step(StepStats(0.0, 1, 1.0, forced_wait_s=0.5))
    metrics = report.metrics()
    assert metrics["oppo/lag_max"] == 2.0 and metrics["oppo/lag_tokens/2"] == 1.0
    assert metrics["oppo/forced_groups"] == 1.0 and metrics["oppo/forced_wait_s"] == 0.5


def test_a_group_whose_tokens_have_not_arrived_yet_counts_as_old_as_its_admission(make_scheduler):
    # B = 2, n = 1, Δ = 2, lag 2. g4 is admitted at step 1's begin (engines at version 0) and
    # decodes version-0 tokens while step 0 trains, but its engine's reply is not polled
    # before step 1's batch forms. At step 2's begin it has no recorded token: it must still
    # count as version 0, or it could be carried to step 3 and train 3 versions behind.
    sched = make_scheduler(2, 1, (), delta=2, stream=False, max_deferral=5, max_lag=2)
    sched.begin_step(0)
    for sid in range(4):
        sched.on_tokens(sid, [5], None, 0)
        sched.on_finished(sid)
    assert [g.group_id for g in sched.take_batch().groups] == [0, 1]
    sched.end_step(StepStats(0.0, 4, 1.0))
    assert [g.group_id for g in sched.begin_step(1).admit] == [4, 5]
    assert [g.group_id for g in sched.take_batch().groups] == [2, 3]  # before any reply of g4
    sched.end_step(StepStats(0.0, 0, 1.0))
    plan = sched.begin_step(2)
    assert plan.must_finish == (4, 5)  # both carried without a recorded token: both as old as version 0
    sched.on_tokens(4, [6, 6], None, 0)  # the late reply: version 0
    for sid in (5, 6, 7):
        sched.on_finished(sid)
    assert sched.take_batch() is None  # waits for g4
    sched.on_finished(4)
    batch = sched.take_batch()
    assert [g.group_id for g in batch.groups] == [5, 4] and batch.max_lag == 2


def test_stale_kv_tokens_are_counted_apart_from_off_policy_tokens(make_scheduler):
    for keep_kv, stale in ((True, 2 / 5), (False, 0.0)):
        sched = make_scheduler(1, 1, (), delta=1, stream=False, keep_kv=keep_kv)
        sched.begin_step(0)
        sched.on_tokens(1, [1, 2, 3], None, 0)
        sched.on_finished(0)
        sched.take_batch()
        sched.end_step(StepStats(0.0, 3, 1.0))
        sched.begin_step(1)
        sched.on_tokens(1, [4, 5], None, 1)  # after the sync: on the KV of version 0, when it was kept
        sched.on_finished(1)
        batch = sched.take_batch()
        assert [g.group_id for g in batch.groups] == [1]
        assert batch.lag_tokens == {"0": 2, "1": 3, "2": 0, "3+": 0}
        report = sched.end_step(StepStats(0.0, 2, 1.0))
        assert report.stale_kv_token_fraction == pytest.approx(stale)
        assert report.offpolicy_token_fraction == pytest.approx(3 / 5)  # versions only: the stale KV is apart


def test_lag_1_with_a_carry_is_refused_naming_the_flags():
    with pytest.raises(ValueError, match=r"--oppo.staleness.max_policy_lag.*--oppo.delta.enable false"):
        OppoConfig(staleness=StalenessConfig(max_policy_lag=1))
    OppoConfig(staleness=StalenessConfig(max_policy_lag=1), delta=DeltaConfig(enable=False))  # allowed
