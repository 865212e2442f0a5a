"""Async admission in the simulator (`oppo-async`, staleness.max_policy_lag 2): the lag bound
holds, the ledger balances, and where the engines have their own GPUs the next step decodes
while the trainer trains (colocated: it does not)."""

from __future__ import annotations

import pytest

from openrlhf_oppo.core.types import TrainBatch
from openrlhf_oppo.integrations.launch import schedules as launch_schedules
from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers
from openrlhf_oppo.sim.presets import load_preset

SMALL = ["workload.steps=8", "workload.seeds=1", "workload.batch_groups=16", "delta.max=16"]
DISAGGREGATED = ["split.colocate=false", "split.generate_gpus=4", "split.train_gpus=3"]  # + 1 scoring GPU
HEAVY_TAIL = ["lengths.mean_tokens=350", "lengths.std_tokens=1000", "lengths.cap_tokens=4096"]


def make_driver(*sets: str, schedule: str = "oppo-async", seed: int = 0) -> drivers.OppoDriver:
    cfg = load_preset("paper-7b-h200", [*SMALL, *sets])
    return drivers.OppoDriver(cfg, cost_model.build(cfg), seed, schedule)


def run_capturing_batches(driver: drivers.OppoDriver) -> tuple[drivers.RunResult, list[TrainBatch]]:
    """Run `driver`, keeping every batch the scheduler hands out (they carry each token's version)."""
    batches: list[TrainBatch] = []
    take = driver.sched.take_batch

    def take_and_keep() -> TrainBatch | None:
        batch = take()
        if batch is not None:
            batches.append(batch)
        return batch

    driver.sched.take_batch = take_and_keep
    return driver.run(), batches


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds of `a`'s intervals that fall inside `b`'s (b's intervals do not overlap each other)."""
    return sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in a for b0, b1 in b)


def decode_during_training_s(res: drivers.RunResult) -> float:
    return overlap_s(res.busy["rollout"], res.busy["train"])


@pytest.mark.parametrize("layout", [[], DISAGGREGATED], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("lengths", [[], HEAVY_TAIL], ids=["preset", "heavy-tail"])
def test_no_trained_token_is_more_than_two_policy_versions_old(layout, lengths):
    res = make_driver(*layout, *lengths).run()
    assert len(res.reports) == len(res.steps) == 8
    assert all(r.lag_tokens["3+"] == 0 for r in res.reports)
    assert sum(sum(r.lag_tokens.values()) for r in res.reports) == sum(s.tokens for s in res.steps)


@pytest.mark.parametrize("layout", [[], DISAGGREGATED], ids=["colocated", "disaggregated"])
def test_every_admitted_group_is_trained_exactly_once_or_held_at_the_end(layout):
    res = make_driver(*layout, *HEAVY_TAIL).run()
    trained = res.trained_group_ids
    assert len(trained) == len(set(trained)) == 8 * 16
    assert not set(trained) & set(res.held_groups)
    assert set(trained) | set(res.held_groups) == set(range(res.admitted_groups))
    assert res.held_groups  # the step after the last trained one was already admitted


def test_disaggregated_groups_admitted_at_the_batch_decode_with_the_old_weights_until_the_sync():
    res, batches = run_capturing_batches(make_driver(*DISAGGREGATED))
    fresh = [(b.step, s.version_runs[0][1]) for b in batches[1:] for g in b.groups if g.deferrals == 0
             for s in g.samples]
    assert fresh and all(v in (step - 1, step) for step, v in fresh)
    assert any(v == step - 1 for step, v in fresh)  # first tokens decoded while step - 1 trained
    assert sum(r.lag_tokens["1"] + r.lag_tokens["2"] for r in res.reports) > 0


def test_colocated_engines_do_not_decode_while_the_trainer_trains():
    res, batches = run_capturing_batches(make_driver())
    assert decode_during_training_s(res) == 0.0
    # admitted early, they wait: their first tokens come after the sync, with the new weights
    assert all(s.version_runs[0][1] == b.step for b in batches for g in b.groups if g.deferrals == 0
               for s in g.samples)


@pytest.mark.parametrize("lengths", [[], HEAVY_TAIL], ids=["preset", "heavy-tail"])
def test_disaggregated_async_admission_decodes_more_during_training_than_oppo(lengths):
    async_run = make_driver(*DISAGGREGATED, *lengths).run()
    oppo_run = make_driver(*DISAGGREGATED, *lengths, schedule="oppo").run()
    assert decode_during_training_s(async_run) > decode_during_training_s(oppo_run) > 0.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_disaggregated_async_admission_shortens_the_step_at_the_preset_lengths(seed):
    # only at the preset lengths: with a heavy tail the lag bound forces stragglers into the
    # batch within two steps and the batch waits for them (docs/simulator.md)
    cfg = load_preset("paper-7b-h200", [*SMALL, *DISAGGREGATED])
    costs = cost_model.build(cfg)
    mean = {s: drivers.summarize(drivers.simulate(cfg, costs, s, seed), 3)["mean_step_s"]
            for s in ("oppo", "oppo-async")}
    assert mean["oppo-async"] < 0.9 * mean["oppo"]


def test_the_simulator_lists_oppos_schedules_and_one_registered_beside_them(monkeypatch):
    monkeypatch.setattr(launch_schedules, "REGISTERED", {})  # none registered (the lab's tests register theirs)
    assert drivers.oppo_schedules() == ("oppo", "oppo-async", "oppo-async-bg")
    assert drivers.schedule_names() == (*drivers.BASELINES, *drivers.oppo_schedules())
    launch_schedules.register(launch_schedules.Schedule("eq4-registered", "OPPO with the eq. 4 Δ rule",
                                                        entry_module=launch_schedules.OPPO_ENTRY,
                                                        oppo={"delta": {"rule": "eq4"}}))
    assert drivers.schedule_names()[-1] == "eq4-registered"
    for schedule, sets in (("eq4-registered", ()), ("oppo", ("delta.rule=eq4",))):
        driver = make_driver(*sets, schedule=schedule)
        assert driver.sched.config.delta.rule == "eq4"
        res = driver.run()
        assert res.reports[0].lag_tokens["3+"] == 0 and len(res.steps) == 8


def test_a_lag_given_with_set_reaches_a_schedule_that_sets_its_own():
    """`oppo-async` runs lag 2; `--set staleness.max_policy_lag=3` wins over it (and over any other
    OPPO schedule's setting of that key), while what --set leaves alone stays the schedule's."""
    plain = make_driver(*DISAGGREGATED, *HEAVY_TAIL)
    assert plain.sched.config.staleness.max_policy_lag == 2
    lag3 = make_driver(*DISAGGREGATED, *HEAVY_TAIL, "staleness.max_policy_lag=3")
    assert lag3.sched.config.staleness.max_policy_lag == 3
    assert lag3.sched.config.streaming == plain.sched.config.streaming
    bg = make_driver(*DISAGGREGATED, "staleness.max_policy_lag=3", schedule="oppo-async-bg")
    assert (bg.sched.config.staleness.max_policy_lag, bg.sched.config.streaming.enable) == (3, False)
    assert bg.sched.config.staleness.background_sync
    res, batches = run_capturing_batches(lag3)
    assert max(b.max_lag for b in batches) <= 3
    assert any(b.max_lag == 3 for b in batches)  # the heavy tail uses the room the bound gives


def test_a_looser_lag_bound_keeps_more_sequences_on_each_engine_iteration():
    """With a heavy tail, the bound forces a straggler into the next batch and the batch waits for it
    while the engines decode little else; each version of room more keeps more sequences decoding
    an iteration, and the step shortens. Every trained token stays within its bound. The wait the
    bound causes is measured (`forced_wait_s`): within the step's wait for its batch, and shrinking
    as the bound loosens."""
    from openrlhf_oppo.sim.drivers import summarize

    seqs, steps, forced = [], [], []
    for lag in (2, 3, 4):
        driver = make_driver(*DISAGGREGATED, *HEAVY_TAIL, "workload.steps=16", f"staleness.max_policy_lag={lag}")
        res, batches = run_capturing_batches(driver)
        assert max(b.max_lag for b in batches) <= lag
        summary = summarize(res, driver.cfg.workload.warmup_steps)
        seqs.append(summary["seqs_per_iteration"])
        steps.append(summary["mean_step_s"])
        assert 1.0 <= summary["seqs_per_iteration"] <= driver.costs.seqs_per_engine
        assert len(res.reports) == len(res.steps)
        for report, step in zip(res.reports, res.steps):
            assert 0.0 <= report.forced_wait_s <= step.batch_ready_s - step.generate_start_s + 1e-9
            assert report.forced_wait_s == 0.0 or report.forced_groups > 0
        forced.append(sum(r.forced_wait_s for r in res.reports))
    assert seqs[0] < seqs[1] < seqs[2]
    assert steps[0] > steps[1] > steps[2]
    assert forced[0] > forced[1] > 0.0 and forced[0] > forced[2]
