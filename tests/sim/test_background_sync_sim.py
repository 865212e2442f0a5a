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
# 1 vLLM / 7 DeepSpeed devices with the reward model among them (async admission without streaming: its best
# layout at 7B)
SPLIT = ["split.colocate=false", "split.generate_gpus=1", "split.train_gpus=7", "split.score_gpus=0",
         "split.reward_with_train=true"]
BACKGROUND = "staleness.background_sync=true"
NO_STREAMING = "streaming.enable=false"  # OpenRLHF's reward forward: the reward model among the DeepSpeed models


def run(*sets: str) -> tuple[drivers.RunResult, cost_model.CostModel]:
    """`oppo-async` without streaming in SPLIT, with `sets`."""
    cfg, why = layouts.check(load_preset("paper-7b-h200", [*SMALL, *SPLIT, NO_STREAMING, *sets]), "oppo-async")
    assert why == []
    costs = cost_model.build(cfg)
    return drivers.simulate(cfg, costs, "oppo-async", 0), costs


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
        cfg = load_preset("paper-7b-h200", [*SMALL, NO_STREAMING, *sets])  # the paper's colocated layout
        ends.append([s.sync_end_s for s in drivers.simulate(cfg, cost_model.build(cfg), "oppo", 0).steps])
    assert ends[0] == ends[1]


def test_the_buffer_is_a_whole_copy_of_the_actor_on_the_training_devices():
    cfg = load_preset("paper-7b-h200", [*SPLIT, BACKGROUND])
    assert layouts.syncs_in_background(cfg, "oppo-async") and not layouts.syncs_in_background(cfg, "oppo")
    plain = load_preset("paper-7b-h200", SPLIT)
    assert layouts.syncs_in_background(plain, "oppo-async-bg") and not layouts.syncs_in_background(plain, "oppo-async")
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


SPLIT_72B = ["split.nodes=8", "split.engine_nodes=1", "split.colocate=false", "split.generate_gpus=0",
             "split.tensor_parallel=2", "split.train_gpus=8", "split.score_gpus=0", "split.reward_with_train=true",
             "actor=qwen2.5-72b", "critic=qwen2.5-72b", "reward=qwen2.5-72b", BACKGROUND]


def test_shards_leave_each_device_its_partition_and_the_trainer_only_the_copy_of_it():
    # 72B on 8 nodes: vLLM on one node (4 engines x TP 2 = 8 devices), 7 x 8 DeepSpeed devices (56 ranks)
    cfg = load_preset("paper-7b-h200", [*SPLIT_72B, "staleness.background_sync_buffer=shards"])
    items = dict(memory.training_items(cfg, sync_buffer=True))
    assert items["weight-sync partitions"] == pytest.approx(145.4e9 / 56, rel=1e-3)  # 2.6 GB a device
    c = cost_model.build(cfg)
    gathered = cost_model.build(load_preset("paper-7b-h200", [*SPLIT_72B, "staleness.background_sync_buffer=host"]))
    # the trainer: a 30 ms call and each rank's copy of its 2.6 GB at 4.8 TB/s x 0.7: 0.8 ms
    assert c.sync_gather_s == pytest.approx(0.03 + 145.4e9 / 56 / (4.8e12 * 0.7), rel=1e-3)
    # the engines: each of the 8 engine devices takes the whole 145 GB through its 50 GB/s NIC (4.2 s), and
    # each of the 56 senders sends 8 x 2.6 GB (under that): 0.5 + 4.2 s, against the gathered sync's 0.5 + 2 x 4.2
    one_way = 145.4e9 / (50e9 * 0.7)
    assert c.sharded_sync_s == pytest.approx(0.5 + one_way, rel=1e-3)
    assert c.weight_sync_s == pytest.approx(0.5 + 2 * one_way, rel=1e-3)  # a foreground sync still gathers
    assert gathered.sharded_sync_s == 0 and gathered.sync_gather_s == pytest.approx(0.03 + one_way, rel=1e-3)


def test_a_sharded_background_sync_holds_the_engines_for_its_own_broadcast_only():
    res, costs = run(BACKGROUND, "staleness.background_sync_buffer=shards")
    assert 0 < costs.sharded_sync_s < costs.weight_sync_s
    for (s0, s1), step in zip(spans(res, "driver", "weight_sync"), res.steps):
        assert s1 - s0 == pytest.approx(costs.sharded_sync_s + costs.sync_overhead_s)
        assert step.sync_end_s == pytest.approx(s0 + costs.sync_gather_s)
