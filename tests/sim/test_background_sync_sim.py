"""The weight sync off the trainer's path (`staleness.background_sync`, a projection): the trainer
goes on once the actor's weights are gathered, the engines stay paused for the whole broadcast and
take the new version at its end, a sync waits for the one before; the lag bound and the ledger
hold; the buffer is charged to the training devices' memory; runs refuse the flag."""

from __future__ import annotations

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, layouts, memory
from openrlhf_oppo.sim.presets import load_preset

SMALL = ["workload.steps=8", "workload.seeds=1"]  # B = 112: the trainer bounds the step (preset lengths)
# 1 vLLM / 7 DeepSpeed devices with the reward model among them (oppo-async-inter's best at 7B)
SPLIT = ["split.colocate=false", "split.generate_gpus=1", "split.train_gpus=7", "split.score_gpus=0",
         "split.reward_with_train=true"]
BACKGROUND = "staleness.background_sync=true"


def run(*sets: str, schedule: str = "oppo-async-inter") -> tuple[drivers.RunResult, cost_model.CostModel]:
    cfg, why = layouts.check(load_preset("paper-7b-h200", [*SMALL, *SPLIT, *sets]), schedule)
    assert why == []
    costs = cost_model.build(cfg)
    return drivers.simulate(cfg, costs, schedule, 0), costs


def spans(res: drivers.RunResult, role: str, stage: str) -> list[tuple[float, float]]:
    return sorted((r["t0"], r["t1"]) for r in res.rows if r["kind"] == "span" and r["role"] == role
                  and r["stage"] == stage)


@pytest.mark.parametrize("sync", [[], ["efficiency.weight_sync_base_s=20"]], ids=["preset", "sync-longer-than-a-step"])
def test_the_trainer_goes_on_after_the_gather_while_the_engines_wait_for_the_broadcast(sync):
    res, costs = run(BACKGROUND, *sync)
    syncs, experience = spans(res, "driver", "weight_sync"), spans(res, "driver", "make_experience")
    assert costs.sync_gather_s < costs.weight_sync_s + costs.sync_overhead_s
    for (s0, s1), step in zip(syncs, res.steps):
        assert s1 - s0 == pytest.approx(costs.weight_sync_s + costs.sync_overhead_s)  # the whole broadcast
        assert step.sync_end_s == pytest.approx(s0 + costs.sync_gather_s)  # the trainer's share of it
        assert step.train_end_s <= s0 + 1e-9  # a sync that waited for the last one starts after its train
    # the next step's experience making starts inside the broadcast, not after it
    assert any(s0 < e0 < s1 for s0, s1 in syncs for e0, _ in experience)
    # the engines decode nothing while weights are loaded: no decoding interval crosses into a sync
    assert all(d1 <= s0 + 1e-9 or d0 >= s1 - 1e-9 for d0, d1 in res.busy["rollout"] for s0, s1 in syncs)
    # and one sync never starts before the last one ended
    assert all(b0 >= a1 - 1e-9 for (_, a1), (b0, _) in zip(syncs, syncs[1:]))


def test_lag_bound_and_ledger_hold_and_the_step_shortens():
    res, _ = run(BACKGROUND)
    plain, _ = run()
    assert all(r.lag_tokens["3+"] == 0 for r in res.reports)
    trained = res.trained_group_ids
    assert len(trained) == len(set(trained)) == 8 * 112
    assert set(trained) | set(res.held_groups) == set(range(res.admitted_groups))
    mean = {name: drivers.summarize(r, 3)["mean_step_s"] for name, r in (("background", res), ("plain", plain))}
    assert mean["background"] < mean["plain"]


def test_without_async_admission_the_setting_changes_nothing():
    ends = []
    for sets in ([BACKGROUND], []):
        cfg = load_preset("paper-7b-h200", [*SMALL, *sets])  # the paper's colocated layout
        ends.append([s.sync_end_s for s in drivers.simulate(cfg, cost_model.build(cfg), "oppo-inter", 0).steps])
    assert ends[0] == ends[1]


def test_the_buffer_is_a_whole_copy_of_the_actor_on_the_training_devices():
    cfg = load_preset("paper-7b-h200", [*SPLIT, BACKGROUND])
    assert layouts.syncs_in_background(cfg, "oppo-async-inter") and not layouts.syncs_in_background(cfg, "oppo")
    items = dict(memory.training_items(cfg, sync_buffer=True))
    assert items["weight-sync buffer"] == cfg.actor.weight_bytes
    assert "weight-sync buffer" not in dict(memory.training_items(cfg))


def test_a_host_buffer_stages_one_parameter_and_the_trainer_waits_for_the_copies_to_host():
    cfg = load_preset("paper-7b-h200", [*SPLIT, BACKGROUND, "staleness.background_sync_buffer=host"])
    items = dict(memory.training_items(cfg, sync_buffer=True))
    assert "weight-sync buffer" not in items and items["weight-sync staging"] == 2 * 3584 * 152064  # the embedding
    # one node: the gather over NVLink (15.2 GB / 315 GB/s = 0.05 s) hides under the copy to host over
    # PCIe (15.2 GB / (64 GB/s x 0.7) = 0.34 s), after a 30 ms call
    host, device = cost_model.build(cfg), cost_model.build(load_preset("paper-7b-h200", [*SPLIT, BACKGROUND]))
    assert host.sync_gather_s == pytest.approx(0.03 + cfg.actor.weight_bytes / (64e9 * 0.7))
    assert device.sync_gather_s == pytest.approx(0.03 + cfg.actor.weight_bytes / (450e9 * 0.7))
