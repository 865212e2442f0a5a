"""OppoSamplesGenerator driving whole steps with a fake engine pool and a fake reward
dispatcher around the real scheduler: B = 2 groups, n = 2 samples, Δ = 1."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

from openrlhf_oppo.core import OverlapScheduler
from openrlhf_oppo.integrations.runtime.generator import OppoSamplesGenerator
from openrlhf_oppo.integrations.runtime.reward_dispatch import REFERENCE, REWARD, ScorerDispatcher, Scorers
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter
from openrlhf_oppo.integrations.runtime.step_mode import Carried, Phase, StepKind, resolve_mode

B = 2  # groups a batch trains
N = 2  # samples per group
DELTA = 1  # groups admitted beyond B
PROMPTS = [f"p{i}" for i in range(6)]  # one pass
GENERATE_KWARGS = {"max_new_tokens": 8, "max_len": 64}


class FakePool:
    """Engines that decode one token per started sample per poll: token `10 * sid + position`,
    stamped with the policy version set at the last resume; a sample finishes at `length(sid)` tokens."""

    def __init__(self, length, make_delta) -> None:
        self.length = length
        self.make_delta = make_delta
        self.decoding: dict[int, int] = {}  # sample id -> tokens decoded so far (held ones included)
        self.started: list[tuple[int, list[int]]] = []  # (sample id, held tokens) of every request
        self.version = 0
        self.paused = False
        self.aborted_this_step = 0
        self.placed: dict[int, int] = {}
        self.asleep = False
        self.stopped: list[int] = []  # parked, their "abort" deltas not yet polled
        self.events: list[tuple] = []  # every call but polls, in order: ("start", sample ids), ("pause",), ...

    def set_reward_tokenizer(self, tokenizer) -> None:
        raise AssertionError("streamed rewards: the engines score nothing")

    def begin_step(self, step: int) -> None:
        pass

    def place(self, group_id: int) -> int:
        self.placed[group_id] = 0
        return 0

    def release(self, group_id: int, sample_ids) -> None:
        del self.placed[group_id]

    def start(self, requests, params) -> None:
        assert not self.asleep
        for gid, req in requests:
            assert gid in self.placed and req.max_tokens == GENERATE_KWARGS["max_new_tokens"]
            self.started.append((req.sample_id, list(req.held_ids)))
            self.decoding[req.sample_id] = len(req.held_ids)
        self.events.append(("start", [req.sample_id for _, req in requests]))

    def restart_aborted(self, aborted, params) -> None:
        assert aborted == []

    def poll(self, wake_tokens: int, also=()) -> list:
        assert not self.paused and not self.asleep
        deltas = [self.make_delta(sid, [], self.version, "abort") for sid in self.stopped]
        self.stopped = []
        for sid, pos in list(self.decoding.items()):
            self.decoding[sid] = pos + 1
            done = pos + 1 == self.length(sid)
            if done:
                del self.decoding[sid]
            finish = "stop" if done else None
            deltas.append(self.make_delta(sid, [10 * sid + pos], self.version, finish, time_s=float(pos)))
        return deltas

    def pause(self, keep_kv_cache: bool) -> None:
        assert not self.paused, "paused twice"
        self.paused = True
        self.events.append(("pause",))

    def park(self) -> None:
        self.events.append(("park",))
        self.stopped = sorted(self.decoding)
        self.decoding = {}

    def sleep(self) -> None:
        self.events.append(("sleep",))
        self.asleep = True

    def wake(self) -> None:
        self.events.append(("wake",))
        self.asleep = False

    def resume(self, policy_version: int) -> None:
        self.events.append(("resume", policy_version))
        self.version = policy_version
        self.paused = False

    def take_paused_s(self) -> float:
        return 0.0

    def resume_when_loaded(self, loads: list, policy_version: int, reset_prefix_cache: bool) -> None:
        self.events.append(("resume_when_loaded", loads, policy_version, reset_prefix_cache))


class FakeRewards:
    """Acknowledges every chunk at once; a finished sample's reward is its id."""

    def __init__(self, scheduler: OverlapScheduler) -> None:
        self.scheduler = scheduler
        self.actors = ["a streaming reward actor"]
        self.scores: dict[int, float] = {}
        self.opened: dict[int, list[int]] = {}
        self.dispatched: list = []
        self.open_calls: list[dict] = []
        self.restarts_this_step = 0

    def begin_step(self, step: int) -> None:
        pass

    def in_flight(self) -> list:
        return []

    def open(self, prompts) -> None:
        self.open_calls.append(dict(prompts))
        self.opened.update(prompts)

    def confirm_opened(self) -> None:
        pass

    def dispatch(self, chunks) -> None:
        self.dispatched += chunks
        for ch in chunks:
            if ch.final:
                self.scores[ch.sample_id] = float(ch.sample_id)
        self.scheduler.on_scored_many(REWARD, chunks)

    def collect(self) -> None:
        pass

    def forget(self, sample_ids) -> None:
        for sid in sample_ids:
            self.scores.pop(sid, None)
            self.opened.pop(sid, None)

    def forget_all(self) -> None:
        self.scores = {}
        self.opened = {}


class Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool):
        return {"input_ids": [ord(c) for c in text]}


def group1_is_slow(sid: int) -> int:
    """Group 1 (samples 2, 3) needs 3 tokens, every other sample 2: it misses step 0's batch."""
    return 3 if sid in (2, 3) else 2


def make_generator(fakes, prompts=PROMPTS, per_pass: int = len(PROMPTS), max_lag: int = 0, sleep: bool = False,
                   carried: str = "auto", background_sync: bool = False):
    """A generator on the fakes, its config and step mode made as `trainer.build_samples_generator` makes
    them (on a host with GPUs, without --train.colocate_all: 'auto' resolves to decode)."""
    args = fakes.make_args(B=B, n=N)
    args.vllm.enable_sleep = sleep
    config = fakes.make_config(delta=DELTA, chunk=2, max_lag=max_lag)
    staleness = dataclasses.replace(config.staleness, carried_in_training=carried, background_sync=background_sync)
    mode = resolve_mode(staleness, args, cpu_host=False)
    staleness = dataclasses.replace(staleness, carried_in_training=mode.carried.value,
                                    keep_kv_cache=mode.keep_kv_cache)
    config = dataclasses.replace(config, staleness=staleness)
    scheduler = OverlapScheduler(config, batch_groups=B, samples_per_group=N, scorers=(REWARD,))
    # OpenRLHF's prompt dataloader: (indices, prompts, labels, images) batches of one
    loader = Loader([(None, [p], [f"label {p}"], [None]) for p in prompts], per_pass)
    meter = StepMeter(0, show_progress=False)
    return OppoSamplesGenerator(
        SimpleNamespace(args=args), loader, None, Tokenizer(), [], oppo=config, mode=mode, scheduler=scheduler,
        engines=FakePool(group1_is_slow, fakes.make_delta), meter=meter,
        scorers=Scorers(FakeRewards(scheduler), ScorerDispatcher([], scheduler, meter, None, None, name=REFERENCE)),
    )


class Loader(list):
    """A dataloader holding the rest of a pass of `per_pass` prompts (a resumed one starts mid-pass)."""

    def __init__(self, items, per_pass: int) -> None:
        super().__init__(items)
        self.per_pass = per_pass

    def __len__(self) -> int:
        return self.per_pass


def run_step(gen: OppoSamplesGenerator):
    """One step as OPPO's trainer runs it: generate, weight sync, finish with the batch's mean reward."""
    experiences, _, admitted, exhausted = gen.generate_samples(**GENERATE_KWARGS)
    order = gen.batch_sample_ids
    batch = gen.state.taken.batch
    gen.pause_for_weight_sync()
    gen.resume_after_weight_sync()
    metrics = gen.finish_step(sum(e.rewards.item() for e in experiences) / len(experiences))
    return SimpleNamespace(experiences=experiences, admitted=admitted, exhausted=exhausted, order=order,
                           batch=batch, metrics=metrics)


def engine_timeline(gen: OppoSamplesGenerator, steps: int) -> list[tuple]:
    """Run `steps` more steps as OPPO's trainer runs them; returns the engines' calls since the generator was
    made, ("batch",) marking where `generate_samples` returned its batch. A background sync's loads land at once."""
    for _ in range(steps):
        experiences, _, _, _ = gen.generate_samples(**GENERATE_KWARGS)
        gen.engines.events.append(("batch",))
        gen.pause_for_weight_sync()
        if gen.mode.background_sync:
            gen.resume_after_weight_sync(["load"])
            gen.engines.resume(gen.step + 1)  # the engines loaded the weights
        else:
            gen.resume_after_weight_sync()
        gen.finish_step(sum(e.rewards.item() for e in experiences) / len(experiences))
    return gen.engines.events


def response_tokens(exp) -> list[int]:
    seq = exp.sequences[0].tolist()
    mask = exp.action_mask[0].tolist()
    return [t for t, m in zip(seq[1:], mask, strict=True) if m]


# One test per step mode: three steps over the six prompts (the third trains the pass's last groups).
# Group 1 (samples 2, 3) is carried at step 0; groups 3 and 4 are samples 6-9, group 5 samples 10, 11.


def test_a_sync_step_starts_its_groups_after_the_weight_sync_which_pauses_only_carried_groups(fakes):
    gen = make_generator(fakes)
    assert (gen.mode.kind, gen.mode.carried) == (StepKind.SYNC, Carried.DECODE)
    assert engine_timeline(gen, steps=3) == [
        ("start", [0, 1, 2, 3, 4, 5]), ("batch",), ("pause",), ("resume", 1),  # group 1 decodes through training
        ("start", [6, 7, 8, 9]), ("batch",), ("pause",), ("resume", 2),
        ("start", [10, 11]), ("batch",), ("resume", 3),  # nothing carried: nothing to pause
    ]
    assert gen.state.phase is Phase.READY


def test_held_carried_groups_pause_as_the_batch_is_taken_and_decode_on_after_the_weight_sync(fakes):
    gen = make_generator(fakes, carried="hold")
    assert (gen.mode.kind, gen.mode.carried) == (StepKind.SYNC, Carried.HOLD)
    assert engine_timeline(gen, steps=3) == [
        ("start", [0, 1, 2, 3, 4, 5]), ("pause",), ("batch",), ("resume", 1),  # paused before experience making
        ("start", [6, 7, 8, 9]), ("pause",), ("batch",), ("resume", 2),
        ("start", [10, 11]), ("batch",), ("resume", 3),
    ]


def test_sleep_mode_wakes_the_engines_for_a_step_and_parks_its_carried_samples_before_they_sleep(fakes):
    gen = make_generator(fakes, sleep=True)
    assert gen.mode.kind is StepKind.SLEEP and not gen.mode.keep_kv_cache
    engine_timeline(gen, steps=1)
    assert gen.state.phase is Phase.PARKED  # group 1 stopped where it was: the next step restarts it
    assert engine_timeline(gen, steps=2) == [
        ("wake",), ("start", [0, 1, 2, 3, 4, 5]), ("park",), ("sleep",), ("batch",), ("resume", 1),  # no pause
        ("wake",), ("start", [6, 7, 8, 9, 2, 3]), ("sleep",), ("batch",), ("resume", 2),  # group 1 from its tokens
        ("wake",), ("start", [10, 11]), ("sleep",), ("batch",), ("resume", 3),
    ]


def test_an_async_step_begins_the_next_one_as_its_batch_is_taken_but_not_past_the_pass_end(fakes):
    gen = make_generator(fakes, max_lag=2)
    assert gen.mode.kind is StepKind.ASYNC
    engine_timeline(gen, steps=1)
    assert gen.state.phase is Phase.BEGUN and gen.state.begun.plan.step == 1
    assert engine_timeline(gen, steps=2) == [
        ("start", [0, 1, 2, 3, 4, 5]), ("start", [6, 7, 8, 9]), ("batch",), ("pause",), ("resume", 1),
        ("start", [10, 11]), ("batch",), ("pause",), ("resume", 2),  # step 2 began here, before the update
        ("batch",), ("resume", 3),  # the pass's last batch: the next pass waits for OpenRLHF's next episode
    ]
    assert gen.state.phase is Phase.READY


def test_a_background_sync_pauses_the_engines_for_every_sync_and_resumes_them_once_they_loaded(fakes):
    gen = make_generator(fakes, max_lag=2, background_sync=True)
    assert gen.mode.kind is StepKind.ASYNC_BACKGROUND_SYNC
    assert engine_timeline(gen, steps=3) == [
        ("start", [0, 1, 2, 3, 4, 5]), ("start", [6, 7, 8, 9]), ("batch",),
        ("pause",), ("resume_when_loaded", ["load"], 1, False), ("resume", 1),
        ("start", [10, 11]), ("batch",),
        ("pause",), ("resume_when_loaded", ["load"], 2, False), ("resume", 2),
        # nothing carried: paused all the same, nothing may start on half-loaded weights
        ("batch",), ("pause",), ("resume_when_loaded", ["load"], 3, False), ("resume", 3),
    ]


def test_the_first_b_complete_groups_are_trained_in_prompt_order_and_the_slow_one_is_carried(fakes):
    gen = make_generator(fakes)
    step = run_step(gen)
    assert step.admitted == B + DELTA and not step.exhausted
    assert step.order == [0, 1, 4, 5]  # groups 0 and 2, by prompt position
    assert [e.prompts[0] for e in step.experiences] == ["p0", "p0", "p2", "p2"]
    assert [response_tokens(e) for e in step.experiences] == [[0, 1], [10, 11], [40, 41], [50, 51]]
    assert [e.rewards.item() for e in step.experiences] == [0.0, 1.0, 4.0, 5.0]  # the streamed rewards
    assert gen.scheduler.in_flight_groups == (1,) and gen.scheduler.held_tokens(2) == [20, 21]
    assert gen.engines.paused is False and gen.engines.version == 1  # paused for the sync: group 1 decodes
    assert step.metrics["oppo/policy_version"] == 0.0 and step.metrics["oppo/generated_tokens"] == 12.0
    # the trained groups are dropped
    assert set(gen.prompts.by_group) == {1} and set(gen.scorers.reward.opened) == {2, 3}


def test_carried_sample_keeps_its_tokens_and_later_tokens_carry_the_new_policy_version(fakes):
    gen = make_generator(fakes)
    run_step(gen)
    step = run_step(gen)
    assert step.admitted == 2 and step.order == [2, 3, 6, 7]  # group 1 (carried), then group 3
    carried = {s.sample_id: s for g in step.batch.groups for s in g.samples}[2]
    assert (carried.token_ids, carried.token_versions) == ([20, 21, 22], [0, 0, 1])
    assert response_tokens(step.experiences[0]) == [20, 21, 22]
    # a carried sample is never started again: it decodes on where it was
    assert [sid for sid, _ in gen.engines.started] == list(range(10))
    assert gen.scheduler.in_flight_groups == (4,)


def test_a_resumed_run_restarts_carried_samples_from_their_recorded_tokens(fakes):
    first = make_generator(fakes)
    run_step(first)
    state = json.loads(json.dumps(first.state_dict()))  # as OpenRLHF's client_states keep it
    resumed = make_generator(fakes, prompts=PROMPTS[3:])  # OpenRLHF restores the dataloader mid-pass
    resumed.load_state_dict(state)
    resumed.resume_after_weight_sync()  # the checkpoint's weights: policy version 1
    step = run_step(resumed)
    assert (2, [20, 21]) in resumed.engines.started and (3, [30, 31]) in resumed.engines.started
    assert set(resumed.scorers.reward.open_calls[0]) == {2, 3, 6, 7, 8, 9}  # reopened on the fresh reward actors
    restream = [ch for ch in resumed.scorers.reward.dispatched if ch.sample_id in (2, 3)][:2]
    assert [(ch.sample_id, ch.start, ch.end) for ch in restream] == [(2, 0, 2), (3, 0, 2)]  # held tokens re-scored
    assert step.order == [2, 3, 6, 7] and response_tokens(step.experiences[0]) == [20, 21, 22]


class RulePool(FakePool):
    """Engines that score each finished sample with --reward.remote_url: its reward is its id."""

    def set_reward_tokenizer(self, tokenizer) -> None:
        pass

    def poll(self, wake_tokens: int, also=()) -> list:
        return [dataclasses.replace(d, reward={"reward": float(d.sample_id), "scores": float(d.sample_id),
                                               "extra_logs": {}}) if d.finish_reason == "stop" else d
                for d in super().poll(wake_tokens, also)]


def make_rule_generator(fakes, prompts=PROMPTS):
    """A generator whose engines score each sample with a rule reward (nothing streamed); sample 3 needs
    3 tokens, every other one 2: group 1 is carried at step 0 with sample 2 finished and scored."""
    args = fakes.make_args(B=B, n=N, remote_url="/reward.py")
    config = fakes.make_config(delta=DELTA, chunk=2)
    mode = resolve_mode(config.staleness, args, cpu_host=False)
    config = dataclasses.replace(config, staleness=dataclasses.replace(
        config.staleness, carried_in_training=mode.carried.value, keep_kv_cache=mode.keep_kv_cache))
    scheduler = OverlapScheduler(config, batch_groups=B, samples_per_group=N, scorers=())
    meter = StepMeter(0, show_progress=False)
    no_reward = ScorerDispatcher([], scheduler, meter, None, None, name=REWARD)
    no_reference = ScorerDispatcher([], scheduler, meter, None, None, name=REFERENCE)
    return OppoSamplesGenerator(
        SimpleNamespace(args=args), Loader([(None, [p], [f"label {p}"], [None]) for p in prompts], len(PROMPTS)),
        None, Tokenizer(), [], oppo=config, mode=mode, scheduler=scheduler,
        engines=RulePool(lambda sid: 3 if sid == 3 else 2, fakes.make_delta), meter=meter,
        scorers=Scorers(no_reward, no_reference),
    )


def test_a_resume_keeps_the_rule_rewards_of_carried_samples_that_had_finished(fakes):
    first = make_rule_generator(fakes)
    assert first.reward_mode == "rule"
    run_step(first)
    assert first.scheduler.in_flight_groups == (1,) and first.scheduler.is_finished(2)
    state = json.loads(json.dumps(first.state_dict()))  # as OpenRLHF's client_states keep it
    resumed = make_rule_generator(fakes, prompts=PROMPTS[3:])
    resumed.load_state_dict(state)
    resumed.resume_after_weight_sync()
    step = run_step(resumed)
    assert [sid for sid, _ in resumed.engines.started if sid in (2, 3)] == [3]  # the finished sample is not decoded
    assert 2 in step.order
    rewards = {sid: exp.rewards.item() for sid, exp in zip(step.order, step.experiences)}
    assert rewards[2] == 2.0 and rewards[3] == 3.0  # sample 2's reward is the one its engine gave before the resume


def test_groups_admitted_at_the_batch_are_in_the_ledger_and_a_resume_admits_them_not_again(fakes, tmp_path):
    gen = make_generator(fakes, max_lag=2)
    gen.ledger.path = str(tmp_path / "ledger.jsonl")
    experiences, _, admitted, _ = gen.generate_samples(**GENERATE_KWARGS)
    # the batch is taken: step 1 already began and its new groups 3 and 4 were started, before any update
    assert gen.batch_sample_ids == [0, 1, 4, 5] and admitted == 3 + 2
    assert [sid for sid, _ in gen.engines.started] == list(range(10)) and gen.engines.version == 0
    assert gen.scheduler.in_flight_groups == (1, 3, 4)
    gen.pause_for_weight_sync()
    gen.resume_after_weight_sync()
    metrics = gen.finish_step(2.5)
    assert metrics["oppo/trained_groups"] == 2.0 and metrics["oppo/lag_tokens/0"] == 8.0
    events = [json.loads(line) for line in open(gen.ledger.path)]
    assert events[-1]["admitted"] == [[g, g, events[-1]["admitted"][g][2]] for g in range(5)]
    assert events[-1]["held"] == [1, 3, 4]  # with the groups admitted at the batch
    state = json.loads(json.dumps(gen.state_dict()))  # a checkpoint in step 1, before its batch
    step = run_step(gen)
    assert step.admitted == 1  # group 5 (the pass's last prompt), admitted at step 1's batch
    carried = {s.sample_id: s for g in step.batch.groups for s in g.samples}[2]
    assert (carried.token_ids, carried.token_versions) == ([20, 21, 22], [0, 0, 1])
    assert step.metrics["oppo/lag_tokens/1"] == 4.0  # group 1's tokens of version 0, trained at step 1

    resumed = make_generator(fakes, prompts=PROMPTS[5:], max_lag=2)
    resumed.load_state_dict(state)
    resumed.resume_after_weight_sync()
    again = run_step(resumed)
    assert again.admitted == 1 and again.order == step.order  # the resumed step 1 admitted nothing again
    assert resumed.scheduler.admitted_groups_total == gen.scheduler.admitted_groups_total == 6


def test_the_engines_are_asked_for_no_text_nobody_reads(fakes):
    gen = make_generator(fakes)
    run_step(gen)
    assert gen.sampling_params.detokenize is False


def test_a_parked_sample_decodes_on_after_the_wake_from_its_tokens_re_prefilled(fakes):
    gen = make_generator(fakes, sleep=True)
    step = run_step(gen)
    assert step.order == [0, 1, 4, 5]
    assert gen.engines.paused is False  # asleep through the update: nothing to pause
    assert gen.scheduler.held_tokens(2) == [20, 21] and gen.scheduler.held_tokens(3) == [30, 31]
    assert step.metrics["oppo/reprefilled_tokens"] == 0.0
    step = run_step(gen)
    assert ("park",) not in gen.engines.events[5:]  # every sample finished by step 1's batch: none to stop
    # group 1 decodes on from the tokens it had, after group 3's new samples are started
    assert gen.engines.started[-2:] == [(2, [20, 21]), (3, [30, 31])]
    carried = {s.sample_id: s for g in step.batch.groups for s in g.samples}[2]
    assert (carried.token_ids, carried.token_versions) == ([20, 21, 22], [0, 0, 1])
    assert step.metrics["oppo/reprefilled_tokens"] == 2 * (len("p1") + 2)  # prompt + held, re-prefilled
