"""StepMeter on hand-built events and a hand-set clock: the `oppo/*` values it reports."""

from __future__ import annotations

import dataclasses

import pytest

from openrlhf_oppo.core import StepReport
from openrlhf_oppo.integrations.runtime.scorer import ScoreReply
from openrlhf_oppo.integrations.runtime.step_meter import FORCED_WARN_EVERY, StepMeter


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_meter(scorers: int = 2, start_s: float = 100.0, gen_s: float = 10.0, generated: int = 50):
    """A meter whose step started at `start_s` and generated for `gen_s` seconds."""
    clock = Clock(start_s)
    meter = StepMeter(scorers=scorers, clock=clock, show_progress=False)
    meter.start_step()
    clock.now = start_s + gen_s
    meter.end_generation(generated)
    return meter


def report() -> StepReport:
    return StepReport(step=0, delta=1, next_delta=1, chunk_size_tokens=4, next_chunk_size_tokens=4, trained_groups=2,
                      admitted_groups=3, carried_groups=(1,), carried_tokens=5, deferred_fraction=0.0)


def reply(start_s: float, end_s: float, kv: int = 0) -> ScoreReply:
    return ScoreReply({}, start_s, end_s, kv_tokens=kv, kv_budget_tokens=1000)


def test_tokens_prefilled_before_their_sample_finished_count_as_overlapped():
    meter = make_meter()
    meter.on_reply(0, reply(101.0, 102.0), ahead={7: 8})  # before sample 7 finishes: judged then
    meter.on_finished(7, time_s=103.0)
    meter.on_finished(9, time_s=103.0)
    meter.on_reply(1, reply(103.0, 104.0), ahead={9: 4})  # sample 9 finished before this prefill did
    meter.on_final_tokens(4)  # sent with a final chunk
    assert meter.overlap_tokens == [8, 8]
    assert meter.metrics(report(), 0, 0, 0)["oppo/overlap_fraction"] == pytest.approx(0.5)


def test_scorer_idle_fraction_counts_busy_time_clipped_to_the_generation_phase():
    meter = make_meter(scorers=2, start_s=100.0, gen_s=10.0)
    meter.on_reply(0, reply(98.0, 103.0), ahead={})  # 3 s inside the phase
    meter.on_reply(1, reply(108.0, 112.0), ahead={})  # 2 s inside; ends after the phase
    metrics = meter.metrics(report(), 0, 0, 0)
    assert metrics["oppo/scorer_idle_fraction"] == pytest.approx(1 - 5 / 20)
    assert meter.scorer_busy == [(108.0, 112.0)]  # only a call outlasting the phase is kept


def test_kv_tokens_are_each_actors_most_this_step_then_its_latest():
    meter = make_meter(scorers=2)
    meter.on_reply(0, reply(101, 102, kv=30), ahead={})
    meter.on_reply(0, reply(102, 103, kv=10), ahead={})
    meter.on_reply(1, reply(101, 102, kv=5), ahead={})
    metrics = meter.metrics(report(), 0, 0, 0)
    assert (metrics["oppo/scorer_kv_tokens"], metrics["oppo/scorer_kv_budget_tokens"]) == (35.0, 2000.0)
    # next step, no reply: each actor still holds what it held after its latest call
    assert meter.metrics(report(), 1, 0, 0)["oppo/scorer_kv_tokens"] == 15.0


def test_evictions_and_reprefilled_tokens_are_reported_per_step_across_a_restart():
    meter = make_meter(scorers=2)
    counted = dict(start_s=101, end_s=102, kv_tokens=0, kv_budget_tokens=1000)
    meter.on_reply(0, ScoreReply({}, **counted, evictions=3, reprefilled_tokens=300), ahead={})
    meter.on_reply(1, ScoreReply({}, **counted, evictions=1, reprefilled_tokens=50, oom_retries=1), ahead={})
    meter.on_reply(0, ScoreReply({}, **counted, evictions=5, reprefilled_tokens=420), ahead={})
    m = meter.metrics(report(), 0, 0, 0)
    assert (m["oppo/scorer_evictions"], m["oppo/scorer_reprefilled_tokens"], m["oppo/scorer_oom_retries"]) == (
        6.0, 470.0, 1.0)
    meter.on_reply(0, ScoreReply({}, **counted, evictions=6, reprefilled_tokens=500), ahead={})
    meter.on_reply(1, ScoreReply({}, **counted, evictions=2, reprefilled_tokens=10), ahead={})  # restarted
    m = meter.metrics(report(), 1, 0, 0)
    assert (m["oppo/scorer_evictions"], m["oppo/scorer_reprefilled_tokens"], m["oppo/scorer_oom_retries"]) == (
        3.0, 90.0, 0.0)


def test_metrics_carry_the_schedulers_report_and_the_steps_counts_in_order():
    meter = make_meter(scorers=0, generated=50)
    meter.reprefilled_tokens = 7
    metrics = meter.metrics(report(), policy_version=3, scorer_restarts=1, aborted_requests=2, engines_paused_s=0.5)
    assert list(metrics)[: len(report().metrics())] == list(report().metrics())
    assert {k: v for k, v in metrics.items() if k not in report().metrics()} == {
        "oppo/generated_tokens": 50.0, "oppo/policy_version": 3.0, "oppo/overlap_fraction": 0.0,
        "oppo/scorer_restarts": 1.0, "oppo/aborted_requests": 2.0, "oppo/reprefilled_tokens": 7.0,
        "oppo/engines_paused_s": 0.5,
    }  # no scorer_* values without streamed rewards
    meter.start_step()
    assert meter.metrics(report(), 4, 0, 0)["oppo/reprefilled_tokens"] == 0.0  # counted per step


def test_a_new_step_resets_overlap_but_keeps_unjudged_prefills():
    meter = make_meter()
    meter.on_reply(0, reply(101.0, 102.0), ahead={7: 8})
    meter.on_final_tokens(3)
    meter.start_step()
    assert meter.overlap_tokens == [0, 0] and meter.prefilled_early == {7: [(102.0, 8)]}


def test_a_second_streamed_scorer_is_metered_in_the_same_step_under_its_own_names():
    """The streaming reference actors' meter (`add_scorer`): judged against the same sample ends
    and the same generation phase, reported as `oppo/reference_scorer_*`; the reward's figures
    are untouched by its replies."""
    clock = Clock(100.0)
    meter = StepMeter(scorers=1, clock=clock, show_progress=False)
    ref = meter.add_scorer("reference_scorer", 2)
    meter.start_step()
    ref.on_reply(0, reply(101.0, 102.0, kv=30), ahead={7: 8})  # prefilled before sample 7 ends
    meter.on_reply(0, reply(101.0, 101.5), ahead={7: 8})
    meter.on_finished(7, time_s=103.0)  # judges both meters' early prefills
    ref.on_final_tokens(8)
    clock.now = 110.0
    meter.end_generation(50)
    metrics = meter.metrics(report(), 0, 0, 0)
    assert metrics["oppo/overlap_fraction"] == 1.0  # the reward's 8 tokens, none sent at the end
    assert metrics["oppo/reference_scorer_overlap_fraction"] == pytest.approx(0.5)
    assert metrics["oppo/scorer_idle_fraction"] == pytest.approx(1 - 0.5 / 10)
    assert metrics["oppo/reference_scorer_idle_fraction"] == pytest.approx(1 - 1 / 20)  # 2 actors x 10 s
    assert metrics["oppo/reference_scorer_kv_tokens"] == 30.0 and metrics["oppo/scorer_kv_tokens"] == 0.0
    meter.forget([7])
    assert 7 not in ref.finished_s


def test_the_forced_wait_runs_from_the_first_poll_that_only_forced_groups_hold_the_batch_to_the_batch():
    clock = Clock(0.0)
    meter = StepMeter(scorers=0, clock=clock, show_progress=False)
    meter.start_step()
    for now, only_forced in ((1.0, False), (2.0, False), (3.5, True), (4.0, True), (6.0, True)):
        clock.now = now
        meter.waiting(only_forced)
    clock.now = 7.25
    meter.batch_taken()
    assert meter.forced_wait_s == 7.25 - 3.5
    meter.start_step()  # a batch that never waited on a forced group
    clock.now = 9.0
    meter.waiting(False)
    meter.batch_taken()
    assert meter.forced_wait_s == 0.0


def test_a_step_held_by_forced_groups_for_a_quarter_of_it_warns_naming_the_bound_and_then_rests(capsys):
    clock = Clock(0.0)
    meter = StepMeter(scorers=0, clock=clock, show_progress=False, bounds="--oppo.staleness.max_policy_lag 2")

    def warnings_after_step(index: int, forced_wait_s: float, step_s: float = 10.0) -> list[str]:
        meter.start_step()
        clock.now += step_s
        held = dataclasses.replace(report(), step=index, forced_groups=3, forced_wait_s=forced_wait_s)
        meter.show(held, mean_reward=0.0, response_tokens=[4])
        return [line for line in capsys.readouterr().out.splitlines() if "forced into it" in line]

    assert warnings_after_step(0, 2.4) == []  # under a quarter of the step
    (message,) = warnings_after_step(1, 2.5)
    assert message.startswith("OPPO step 1: the batch waited 2.5 s of the step's 10.0 s only for the 3 group(s)")
    assert "--oppo.staleness.max_policy_lag 2 forced into it" in message
    assert warnings_after_step(2, 9.0) == []  # within FORCED_WARN_EVERY steps of the last warning
    assert len(warnings_after_step(1 + FORCED_WARN_EVERY, 9.0)) == 1


def test_the_progress_bar_counts_the_runs_steps_from_a_resumed_one_and_times_from_the_first_step(capsys):
    """The bar's total is the run's global steps, so tqdm shows the ETA; a resumed run's bar starts at the
    checkpoint's step, and its clock (elapsed, rate, ETA) at the first step, not at the models' load."""
    now = [100.0]
    meter = StepMeter(scorers=0)
    meter.progress._time = lambda: now[0]  # tqdm's clock
    meter.plan(8, done=2)  # resumed after global step 2 of 8
    now[0] = 160.0  # a minute of start-up: Ray, vLLM, the models
    meter.start_step()
    now[0] = 170.0
    meter.progress.update()
    shown = meter.progress.format_dict
    assert (shown["n"], shown["total"], shown["initial"]) == (3, 8, 2)
    assert shown["elapsed"] == 10.0  # from the first step's start: one step in 10 s, 5 left, 50 s to go
    assert "| 3/8 [00:10<00:50, 10.00s/step]" in meter.progress.format_meter(**shown)
