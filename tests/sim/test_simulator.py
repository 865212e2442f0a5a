"""Invariants of simulated runs: groups trained once or held, time monotone, Δ=0 = sync."""

from __future__ import annotations

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, engine
from openrlhf_oppo.sim.presets import load_preset

SMALL = ["workload.steps=8", "workload.seeds=1"]
# OPPO's schedules, then `oppo` and `oppo-async` with one part switched off or changed by their settings
SETTINGS = {
    "fixed-delta": ("oppo", ("delta.adaptive=false",)),
    "streaming-only": ("oppo", ("delta.enable=false",)),
    "carry-over-only": ("oppo", ("streaming.enable=false",)),
    "eq4": ("oppo", ("delta.rule=eq4",)),
    "padded": ("oppo", ("oppo.train.length_buckets=false", "oppo.train.vectorized_advantages=false")),
    "async-carry-over-only": ("oppo-async", ("streaming.enable=false",)),
}
OPPO_RUNS = {**{s: (s, ()) for s in drivers.oppo_schedules()}, **SETTINGS}
RUNS = {**{s: (s, ()) for s in drivers.schedule_names()}, **SETTINGS}


def small(*sets: str, preset: str = "cpu-longtail"):
    cfg = load_preset(preset, [*SMALL, *sets])
    return cfg, cost_model.build(cfg)


# that the simulator imports no torch/ray/vllm/deepspeed is checked with the core's own
# check: tests/core/test_scheduler.py::test_core_and_simulator_import_without_heavy_dependencies


@pytest.mark.parametrize("run", OPPO_RUNS)
@pytest.mark.parametrize("preset", ["cpu-longtail", "paper-7b-h200"])
def test_every_admitted_group_is_trained_exactly_once_or_held_at_the_end(run, preset):
    schedule, settings = OPPO_RUNS[run]
    sets = ["workload.batch_groups=16", "delta.max=16"] if preset != "cpu-longtail" else []
    cfg, costs = small(*sets, *settings, preset=preset)
    res = drivers.simulate(cfg, costs, schedule, seed=3)
    trained = res.trained_group_ids
    assert len(trained) == len(set(trained)) == cfg.workload.steps * cfg.workload.batch_groups
    assert not set(trained) & set(res.held_groups)
    assert set(trained) | set(res.held_groups) == set(range(res.admitted_groups))


@pytest.mark.parametrize("run", RUNS)
def test_simulated_time_is_monotone(run, monkeypatch):
    schedule, settings = RUNS[run]
    seen: list[float] = []
    original_at = engine.EventLoop.at

    def at(self, t_s, fn, *args):
        def traced(*a):
            seen.append(self.now_s)
            return fn(*a)
        original_at(self, t_s, traced, *args)

    monkeypatch.setattr(engine.EventLoop, "at", at)
    cfg, costs = small(*settings)
    res = drivers.simulate(cfg, costs, schedule, seed=1)
    assert seen and all(a <= b for a, b in zip(seen, seen[1:]))
    for r in res.steps:
        assert r.generate_start_s <= r.batch_ready_s <= r.train_end_s <= r.sync_end_s
    ends = [r.train_end_s for r in res.steps]
    assert all(a < b for a, b in zip(ends, ends[1:]))


def test_the_event_loop_refuses_an_event_in_the_past():
    loop = engine.EventLoop()
    loop.at(2.0, lambda: loop.at(1.0, lambda: None))
    with pytest.raises(RuntimeError, match="past"):
        loop.run(lambda: False)


@pytest.mark.parametrize("old_logprobs,openrlhf", [("recompute", "sync"), ("rollout", "sync" + drivers.CUT)])
@pytest.mark.parametrize("preset", ["cpu-longtail", "paper-7b-h200"])
def test_delta_zero_without_streaming_gives_exactly_the_sync_schedules_batches(preset, old_logprobs, openrlhf):
    # packed training: without packing the padding depends on the order of a batch's samples
    # (OPPO hands them over in completion order), not on which samples it holds; OPPO's old-log-prob
    # cut against sync with the same cut
    sets = ["delta.enable=false", "streaming.enable=false", "workload.packing=true",
            f"train.old_logprobs={old_logprobs}"]
    if preset != "cpu-longtail":
        sets += ["workload.batch_groups=24", "delta.max=24"]
    cfg, costs = small(*sets, preset=preset)
    sync = drivers.simulate(cfg, costs, openrlhf, seed=5)
    oppo = drivers.OppoDriver(cfg, costs, 5, "oppo").run()
    assert [r.prompt_indices for r in oppo.steps] == [r.prompt_indices for r in sync.steps]
    assert [r.tokens for r in oppo.steps] == [r.tokens for r in sync.steps]
    assert [r.train_end_s for r in oppo.steps] == pytest.approx([r.train_end_s for r in sync.steps], rel=1e-9)
    assert oppo.held_groups == ()


def test_a_run_repeats_bit_for_bit_with_its_seed():
    cfg, costs = small()
    a = drivers.simulate(cfg, costs, "oppo", seed=7)
    b = drivers.simulate(cfg, costs, "oppo", seed=7)
    assert a.rows == b.rows and a.steps == b.steps


def test_overcommit_trains_first_b_and_carries_the_rest():
    cfg, costs = small("delta.adaptive=false", "delta.init=8")
    res = drivers.simulate(cfg, costs, "oppo", seed=2)
    assert all(len(r.prompt_indices) == cfg.workload.batch_groups for r in res.steps)
    assert any(r.deferred_fraction > 0 for r in res.steps)  # some groups were carried into a later step


def test_streaming_moves_reward_scoring_off_the_critical_path():
    cfg, costs = small("delta.enable=false", preset="paper-7b-h200")  # streaming only
    sync = drivers.summarize(drivers.simulate(cfg, costs, "sync", 0), cfg.workload.warmup_steps)
    intra = drivers.summarize(drivers.simulate(cfg, costs, "oppo", 0), cfg.workload.warmup_steps)
    assert intra["mean_step_s"] < sync["mean_step_s"]


REASONING_4_4 = ["lengths.mean_tokens=3000", "lengths.std_tokens=3000", "lengths.cap_tokens=16384",
                 "workload.micro_batch_size=1", "workload.gradient_checkpointing=true", "workload.seeds=1",
                 "split.colocate=false", "split.generate_gpus=4", "split.train_gpus=4", "split.score_gpus=0",
                 "split.reward_with_train=true", "split.tensor_parallel=2"]


def test_a_window_over_an_odd_count_of_alternating_steps_is_reported(capsys):
    """Over-sampling's steps alternate long (a 2B call's stragglers) and short (its first B): over
    the preset's 11 measured gaps, six long and five short, the mean is biased, and the report says
    so; over 32 gaps it does not."""
    from openrlhf_oppo.sim import report

    short = report.run_all(load_preset("paper-7b-h200", REASONING_4_4), ("oversample",))
    assert report.window_drift(short, "oversample") < -report.WINDOW_DRIFT
    report.print_tables(short)
    assert "window: " in capsys.readouterr().out
    longer = [*REASONING_4_4, "workload.steps=40", "workload.warmup_steps=8"]
    long = report.run_all(load_preset("paper-7b-h200", longer), ("oversample",))
    assert abs(report.window_drift(long, "oversample")) < report.WINDOW_DRIFT
    report.print_tables(long)
    assert "window: " not in capsys.readouterr().out
