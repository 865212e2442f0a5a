"""The scheduler's invariants (docs/design.md) as properties over random event streams.

A random driver plays engine and scorers: random batch size B, group size n,
Δ bounds and rule (so Δ changes), chunk size, deferral limit, scorer set,
response lengths, token deltas, finish order and scorer acknowledgement order,
and may checkpoint and restore the scheduler between steps. It keeps its own
record of everything it sent and checks every batch, and every chunk's tokens,
against it. At every step boundary a checkpoint loaded into a fresh scheduler must
write the same checkpoint again. Between any two events it may also send a bad call,
which must be refused and change nothing.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openrlhf_oppo.config import ChunkConfig, DeltaConfig
from openrlhf_oppo.core import ChunkReady, StepStats


@st.composite
def setups(draw):
    B = draw(st.integers(1, 4))
    dmax = draw(st.integers(0, B))
    dmin = draw(st.integers(0, dmax))
    return dict(
        B=B,
        n=draw(st.integers(1, 3)),
        delta=DeltaConfig(
            enable=True,
            init=draw(st.integers(dmin, dmax)),
            min=dmin,
            max=dmax,
            window_steps=2,
            inc=draw(st.integers(0, 2)),
            dec=draw(st.integers(0, 2)),
            rule=draw(st.sampled_from(["eq4", "alg1"])),
        ),
        chunk=draw(st.integers(1, 6) | adaptive_chunks()),
        stream=draw(st.booleans()),
        scorers=draw(st.sampled_from([(), ("reward",), ("reward", "reference")])),
        max_deferral=draw(st.integers(1, 3)),
        steps=draw(st.integers(1, 6)),
        checkpoint=draw(st.booleans()),
    )


@st.composite
def adaptive_chunks(draw):
    """Adaptive C: a round of trials over random candidates, trials that may see no token."""
    candidates = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3, unique=True)))
    trial_steps = draw(st.integers(1, 2))
    return ChunkConfig(
        size_tokens=draw(st.integers(1, 12)),
        adaptive=True,
        candidates=candidates,
        trial_steps=trial_steps,
        period_steps=len(candidates) * trial_steps + draw(st.integers(0, 2)),
    )


class Driver:
    """Engine + scorers + bookkeeping of what was sent."""

    def __init__(self, setup, data, make_scheduler, freeze=None):
        self.setup = setup
        self.make_scheduler = make_scheduler
        self.data = data
        self.freeze = freeze  # set: inject bad calls
        self.sched = self._new_scheduler()
        self.sent_tokens: dict[int, list[int]] = {}
        self.sent_logprobs: dict[int, list[float]] = {}
        self.sent_versions: dict[int, list[int]] = {}
        self.target_len: dict[int, int] = {}
        self.finished: set[int] = set()
        self.pending: dict[str, list] = {name: [] for name in setup["scorers"]}  # chunks not yet acked
        self.acked: dict[tuple[str, int], int] = {}
        self.final_acked: set[tuple[str, int]] = set()
        self.chunk_ends: dict[int, int] = {}
        self.admitted: dict[int, tuple[int, ...]] = {}  # group -> sample ids
        self.trained: list[int] = []
        self.next_token = 0
        self.step_tokens = 0  # generated in the step under way: what StepStats reports
        self.committed: list[int] = []  # the step's committed_groups() when last asked

    def _new_scheduler(self):
        s = self.setup
        return self.make_scheduler(
            s["B"], s["n"], s["scorers"], delta=s["delta"], chunk=s["chunk"], stream=s["stream"],
            max_deferral=s["max_deferral"],
        )

    def route(self, chunks, c_now):
        for ch in chunks:
            # chunks tile the response: contiguous, full-size unless final
            assert ch.start == self.chunk_ends.get(ch.sample_id, 0)
            assert ch.final or ch.end - ch.start == c_now
            assert list(ch.token_ids) == self.sent_tokens[ch.sample_id][ch.start : ch.end], "a chunk's tokens"
            self.chunk_ends[ch.sample_id] = ch.end
            for name in self.setup["scorers"]:
                self.pending[name].append(ch)

    def emit(self, sid, step, c_now):
        left = self.target_len[sid] - len(self.sent_tokens[sid])
        k = self.data.draw(st.integers(0, min(left, 7)))
        toks = list(range(self.next_token, self.next_token + k))
        self.next_token += k
        self.step_tokens += k
        lps = [-(t % 5) / 10 for t in toks]
        self.sent_tokens[sid] += toks
        self.sent_logprobs[sid] += lps
        self.sent_versions[sid] += [step] * k
        self.route(self.sched.on_tokens(sid, toks, lps, step), c_now)

    def finish(self, sid, c_now):
        self.finished.add(sid)
        self.route(self.sched.on_finished(sid, "stop"), c_now)

    def ack_one(self, name, index):
        # a scorer prefills one sample's chunks in order; samples interleave freely
        sid = self.pending[name][index].sample_id
        index = next(i for i, ch in enumerate(self.pending[name]) if ch.sample_id == sid)
        ch = self.pending[name].pop(index)
        self.sched.on_scored(ch.sample_id, name, ch.end, ch.final)
        self.acked[(name, ch.sample_id)] = ch.end
        if ch.final:
            self.final_acked.add((name, ch.sample_id))

    def run_step(self, step):
        sched, setup = self.sched, self.setup
        plan = sched.begin_step(step)
        self.step_tokens = 0
        assert setup["delta"].min <= plan.delta <= setup["delta"].max
        assert len(plan.carried) + len(plan.admit) >= setup["B"]
        for ch in plan.restream:
            self.chunk_ends[ch.sample_id] = 0 if ch.start == 0 else self.chunk_ends[ch.sample_id]
        self.route(plan.restream, plan.chunk_size_tokens)
        for g in plan.admit:
            self.admitted[g.group_id] = g.sample_ids
            for sid in g.sample_ids:
                self.sent_tokens[sid], self.sent_logprobs[sid], self.sent_versions[sid] = [], [], []
                self.target_len[sid] = self.data.draw(st.integers(0, 12))
        live = [sid for gid in sched.in_flight_groups for sid in self.admitted[gid] if sid not in self.finished]
        batch = None
        for _ in range(self.data.draw(st.integers(0, 40))):  # random interleaving
            actions = ["emit", "finish"] if live else []
            actions += [f"ack:{n}" for n in setup["scorers"] if self.pending[n]]
            if not actions:
                break
            action = self.data.draw(st.sampled_from(actions))
            self.maybe_bad_call(step, live)
            if action.startswith("ack:"):
                name = action[4:]
                self.ack_one(name, self.data.draw(st.integers(0, len(self.pending[name]) - 1)))
            else:
                sid = self.data.draw(st.sampled_from(live))
                if action == "emit":
                    self.emit(sid, step, plan.chunk_size_tokens)
                else:
                    self.emit(sid, step, plan.chunk_size_tokens)
                    self.finish(sid, plan.chunk_size_tokens)
                    live.remove(sid)
            batch = batch or self.take_batch()
        # drain: finish forced groups first, then the rest in random order, until the batch forms
        order = sorted(live, key=lambda sid: sched.group_of(sid) not in plan.must_finish)
        while batch is None:
            for name in setup["scorers"]:
                while self.pending[name]:
                    self.ack_one(name, 0)
            batch = self.take_batch()
            if batch is None:
                sid = order.pop(0)
                while len(self.sent_tokens[sid]) < self.target_len[sid]:
                    self.emit(sid, step, plan.chunk_size_tokens)
                self.finish(sid, plan.chunk_size_tokens)
        self.check_batch(batch, plan, step)
        self.maybe_bad_call(step, [], batch_taken=True)
        seconds = self.data.draw(st.sampled_from([0.0, 0.5, 1.0, 3.0]))
        report = sched.end_step(StepStats(self.data.draw(st.floats(-1, 1)), self.step_tokens, seconds))
        assert setup["delta"].min <= report.next_delta <= setup["delta"].max
        carried_tokens = sum(len(self.sent_tokens[sid]) for gid in report.carried_groups for sid in self.admitted[gid])
        assert report.carried_tokens == carried_tokens

    def take_batch(self):
        """take_batch, after asking committed_groups: what it names only grows within a step (no
        scorer restarts here), and the batch, once taken, is exactly what it named last."""
        committed = self.sched.committed_groups()
        assert set(self.committed) <= set(committed), (self.committed, committed)
        batch = self.sched.take_batch()
        if batch is None:
            self.committed = committed
            return None
        assert [g.group_id for g in batch.groups] == committed
        assert self.sched.committed_groups() == []
        self.committed = []
        return batch

    def maybe_bad_call(self, step, live, batch_taken=False):
        """Maybe send one bad call, built from the current state; it must raise and change nothing."""
        if self.freeze is None or not self.data.draw(st.booleans()):
            return
        sched, scorers = self.sched, self.setup["scorers"]
        finished = [sid for gid in sched.in_flight_groups for sid in self.admitted[gid] if sid in self.finished]
        ok = [(live[0], [1], None)] if live else []  # a valid entry before the bad one: must not be applied
        bad = [
            lambda: sched.on_tokens_many(ok + [(10**9, [1], None)], step),
            lambda: sched.on_tokens_many(ok + [(ok[0][0] if ok else 10**9, [1.5], None)], step),
            lambda: sched.on_tokens_many(ok, None),
            lambda: sched.on_finished(10**9),
            lambda: sched.begin_step(step + 1),
        ]
        if live:
            bad += [
                lambda: sched.on_tokens(live[-1], [1, 2], [0.0], step),
                lambda: sched.on_finished(live[-1], "eos"),
                lambda: sched.on_tokens(live[-1], [0.5], None, step),
            ]
        version = sched._flight.samples[live[-1]].version if live else None
        if version:  # the sample's tokens so far came from this version: an older one is refused
            bad.append(lambda: sched.on_tokens(live[-1], [1], None, version - 1))
        if finished:
            bad += [lambda: sched.on_tokens(finished[0], [1], None, step), lambda: sched.on_finished(finished[0])]
        for name in scorers:
            pending = self.pending[name]
            if pending:
                first = pending[0]
                bad.append(lambda name=name, first=first: sched.on_scored_many(
                    name, [first, ChunkReady(first.sample_id, first.end, first.end + 10**6, False)]))
                later = [ch for ch in pending[1:] if ch.sample_id == first.sample_id]
                if later:  # a later chunk of a sample before its earlier one
                    bad.append(lambda name=name, ch=later[0]: sched.on_scored_many(name, [ch]))
                    if later[-1].final:  # the final one acknowledged as [0, end), skipping the earlier ones
                        bad.append(lambda name=name, ch=later[-1]: sched.on_scored(ch.sample_id, name, ch.end, True))
            if live:
                bad.append(lambda name=name: sched.on_scored(live[0], name, 0, final=True))
        bad.append(lambda: sched.on_scored(next(iter(sched._flight.samples), 0), "no-such-scorer", 0))
        if batch_taken:
            bad += [
                lambda: sched.end_step(StepStats(math.nan, 1, 1.0)),
                lambda: sched.end_step(StepStats(0.0, -5, 1.0)),
            ]
        elif sched._batch is None:
            bad.append(lambda: sched.end_step(StepStats(0.0, 1, 1.0)))
        call = self.data.draw(st.sampled_from(bad))
        before = self.freeze(sched)
        with pytest.raises((ValueError, TypeError, RuntimeError)):
            call()
        assert self.freeze(sched) == before, "a rejected call changed the scheduler"

    def check_batch(self, batch, plan, step):
        setup = self.setup
        assert len(batch.groups) == setup["B"]
        gids = [g.group_id for g in batch.groups]
        assert set(plan.must_finish) <= set(gids), "a group at max_deferral_steps was not trained"
        for g in batch.groups:
            assert g.deferrals <= setup["max_deferral"]
            assert g.deferrals == step - g.admitted_step
            assert tuple(s.sample_id for s in g.samples) == self.admitted[g.group_id]
            for s in g.samples:
                sid = s.sample_id
                assert sid in self.finished, "trained before it finished"
                for name in setup["scorers"]:
                    assert (name, sid) in self.final_acked, "trained before every scorer saw the final chunk"
                    assert self.acked[(name, sid)] == len(self.sent_tokens[sid]), "trained before fully scored"
                assert s.token_ids == self.sent_tokens[sid], "carried tokens lost or changed"
                assert s.rollout_logprobs == self.sent_logprobs[sid]
                assert s.token_versions == self.sent_versions[sid]
        self.trained += gids

    def check_round_trip(self):
        """A checkpoint loaded into a fresh scheduler writes the same checkpoint again."""
        state = self.sched.state_dict()
        fresh = self._new_scheduler()
        fresh.load_state_dict(json.loads(json.dumps(state)))
        assert fresh.state_dict() == state, "a loaded checkpoint wrote a different checkpoint"

    def checkpoint_restore(self):
        state = json.loads(json.dumps(self.sched.state_dict()))
        self.sched = self._new_scheduler()
        self.sched.load_state_dict(state)
        assert self.sched.state_dict() == state
        # fresh scorers: caches and un-acked chunks are gone; restream resends
        for name in self.pending:
            self.pending[name].clear()
        for key in list(self.acked):
            self.acked[key] = 0
        self.final_acked.clear()
        self.chunk_ends.clear()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), data=st.data())
def test_invariants_hold_on_random_event_streams(setup, data, make_scheduler):
    d = Driver(setup, data, make_scheduler)
    _run(d, setup, data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setup=setups(), data=st.data())
def test_a_bad_call_anywhere_is_refused_and_changes_nothing(setup, data, frozen, make_scheduler):
    d = Driver(setup, data, make_scheduler, freeze=frozen)
    _run(d, setup, data)


def _run(d, setup, data):
    for step in range(setup["steps"]):
        d.run_step(step)
        d.check_round_trip()
        if setup["checkpoint"] and data.draw(st.booleans()):
            d.checkpoint_restore()
    # every admitted group trained exactly once, or still held
    assert len(d.trained) == len(set(d.trained))
    held = set(d.sched.in_flight_groups)
    assert not held & set(d.trained)
    assert held | set(d.trained) == set(d.admitted)
    assert d.sched.admitted_groups_total == len(d.admitted)
    # held samples kept every token
    for gid in held:
        for sid in d.admitted[gid]:
            assert d.sched.held_tokens(sid) == d.sent_tokens[sid]


@settings(max_examples=100, deadline=None)
@given(
    B=st.integers(1, 4),
    n=st.integers(1, 3),
    scorers=st.sampled_from([(), ("reward",), ("reward", "reference")]),
    data=st.data(),
)
def test_delta_zero_and_no_streaming_is_exactly_synchronous_ppo(B, n, scorers, data, make_scheduler):
    sched = make_scheduler(B, n, scorers, delta=DeltaConfig(enable=False), chunk=ChunkConfig(), stream=False)
    for step in range(3):
        plan = sched.begin_step(step)
        assert plan.delta == 0 and plan.carried == () and plan.must_finish == ()
        assert [g.prompt_index for g in plan.admit] == list(range(step * B, step * B + B))
        sids = [sid for g in plan.admit for sid in g.sample_ids]
        for sid in data.draw(st.permutations(sids)):
            toks = [1] * data.draw(st.integers(0, 9))
            assert sched.on_tokens(sid, toks, None, step) == []
            chunks = sched.on_finished(sid)
            assert all(c.start == 0 and c.end == len(toks) and c.final for c in chunks)
            for name in scorers:
                assert sched.take_batch() is None
                sched.on_scored(sid, name, len(toks), final=True)
        batch = sched.take_batch()
        assert sorted(g.group_id for g in batch.groups) == [g.group_id for g in plan.admit]
        assert batch.offpolicy_token_fraction == 0.0
        report = sched.end_step(StepStats(0.0, 1, 1.0))
        assert report.carried_groups == () and report.deferral_hist["0"] == B
