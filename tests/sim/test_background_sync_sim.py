"""The weight sync off the trainer's path (`staleness.background_sync`, a projection): the trainer
goes on once the actor's weights are gathered, paying the sync's fixed cost as a foreground sync's
trainer does; the engines stay paused for the whole broadcast and take the new version at its end, a
sync waits for the one before; the lag bound and the ledger hold; the buffer is charged to the
training devices' memory; runs refuse the flag. The seconds are worked out by hand on the hand-sized
setup (tests/sim/hand-sized.yaml) or from the 7B preset's datasheet figures."""

from __future__ import annotations

from pathlib import Path

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
HAND = str(Path(__file__).with_name("hand-sized.yaml"))  # 4 vLLM / 4 DeepSpeed devices, streaming off

# The hand-sized sync: 2e9 bytes of weights through NVLink at 100 GB/s x 0.5, once gathered (ZeRO-3) and
# once broadcast to the engines, each 0.04 s; the sync's base 0.25 s; its fixed cost to the trainer 0.75 s
# (efficiency.sync_overhead_s, apart from the phase's 2.0 s)
TRANSFER_S = 2e9 / (100e9 * 0.5)
FIXED_S = 0.75
FOREGROUND_S = 0.25 + 2 * TRANSFER_S + FIXED_S  # 1.08 s: the trainer and the engines wait for all of it
BACKGROUND_TRAINER_S = FIXED_S + TRANSFER_S  # 0.79 s: the call and the gather
# a step the trainer bounds: make_experience and train (a 2.0 s phase each), then the trainer's share of the
# sync; per trained token (prompt 100 + response), 4 forwards of 2 N flops and the actor's and critic's
# 6 N flops each, N = 1e9, on 4 devices of 1e15 flop/s at 0.5
PER_TOKEN_S = (4 * 2 * 1e9 + 6 * 2 * 1e9) / (4 * 1e15 * 0.5)


def run(*sets: str) -> tuple[drivers.RunResult, cost_model.CostModel]:
    """`oppo-async` without streaming in SPLIT, with `sets`."""
    cfg, why = layouts.check(load_preset("paper-7b-h200", [*SMALL, *SPLIT, NO_STREAMING, *sets]), "oppo-async")
    assert why == []
    costs = cost_model.build(cfg)
    return drivers.simulate(cfg, costs, "oppo-async", 0), costs


def run_hand(schedule: str, *sets: str) -> drivers.RunResult:
    cfg, why = layouts.check(load_preset(HAND, list(sets)), schedule)
    assert why == []
    return drivers.simulate(cfg, cost_model.build(cfg), schedule, 0)


def spans(res: drivers.RunResult, role: str, stage: str) -> list[tuple[float, float]]:
    return sorted((r["t0"], r["t1"]) for r in res.rows if r["kind"] == "span" and r["role"] == role
                  and r["stage"] == stage)


@pytest.mark.parametrize(("schedule", "sets", "engines_s", "trainer_s"), [
    ("async", [], FOREGROUND_S, FOREGROUND_S),  # OpenRLHF's sync: the trainer waits for all of it
    ("oppo-async", [], FOREGROUND_S, FOREGROUND_S),
    ("oppo-async", [BACKGROUND], FOREGROUND_S, BACKGROUND_TRAINER_S),
    ("oppo-async-bg", [], FOREGROUND_S, BACKGROUND_TRAINER_S),
    # into host memory: the gather hides under the copies over PCIe, 2e9 B / (20 GB/s x 0.5) = 0.2 s
    ("oppo-async", [BACKGROUND, "staleness.background_sync_buffer=host"], FOREGROUND_S, FIXED_S + 2e9 / 10e9),
    # in shards: no gather, each of the 4 ranks copies its 0.5e9 B at 1 TB/s x 0.5 (1 ms); the engines wait
    # for the base, the fixed cost and one pass of the weights through the links (4 senders, 4 engine devices)
    ("oppo-async", [BACKGROUND, "staleness.background_sync_buffer=shards"], 0.25 + TRANSFER_S + FIXED_S,
     FIXED_S + 2e9 / 4 / (1e12 * 0.5)),
], ids=["openrlhf-async", "oppo-foreground", "oppo-background", "oppo-async-bg", "host-buffer", "shards"])
def test_every_schedules_trainer_pays_the_syncs_fixed_cost_by_hand(schedule, sets, engines_s, trainer_s):
    res = run_hand(schedule, *sets)
    syncs = spans(res, "driver", "weight_sync")
    assert len(res.steps) == 6
    for (s0, s1), step in zip(syncs, res.steps):
        assert s1 - s0 == pytest.approx(engines_s)  # the engines are paused for the whole sync
        assert step.sync_end_s - s0 == pytest.approx(trainer_s)  # the trainer goes on after its share
    # the trainer bounds every step: its phases, its tokens' forwards and updates, and its share of the sync
    for before, step in zip(res.steps, res.steps[1:]):
        work_s = 2 * 2.0 + PER_TOKEN_S * (step.tokens + 8 * 100)
        assert step.sync_end_s - before.sync_end_s == pytest.approx(work_s + trainer_s)


@pytest.mark.parametrize("sync", [[], ["efficiency.weight_sync_base_s=20"]], ids=["preset", "sync-longer-than-a-step"])
def test_the_trainer_goes_on_after_the_gather_while_the_engines_wait_for_the_broadcast(sync):
    res, _ = run(BACKGROUND, *sync)
    syncs, experience = spans(res, "driver", "weight_sync"), spans(res, "driver", "make_experience")
    # 15.2 GB gathered and broadcast over NVLink at 450 GB/s x 0.7 (0.048 s each); the base and 1.0 s fixed
    gather_s = 2 * 7_615_283_200 / (450e9 * 0.7)
    base_s = 20.0 if sync else 0.5
    for (s0, s1), step in zip(syncs, res.steps):
        assert s1 - s0 == pytest.approx(base_s + 2 * gather_s + 1.0)  # the engines wait for the whole broadcast
        assert step.sync_end_s - s0 == pytest.approx(1.0 + gather_s)  # the trainer for the call and the gather
        assert step.train_end_s <= s0 + 1e-9  # a sync that waited for the last one starts after its train
    # the next step's experience making starts inside the broadcast, not after it
    assert any(s0 < e0 < s1 for s0, s1 in syncs for e0, _ in experience)
    # the engines decode nothing while weights are loaded: no decoding interval crosses into a sync
    assert all(d1 <= s0 + 1e-9 or d0 >= s1 - 1e-9 for d0, d1 in res.busy["rollout"] for s0, s1 in syncs)
    # and one sync never starts before the last one ended
    assert all(b0 >= a1 - 1e-9 for (_, a1), (b0, _) in zip(syncs, syncs[1:]))


def test_lag_bound_and_ledger_hold():
    res, _ = run(BACKGROUND)
    assert all(r.lag_tokens["3+"] == 0 for r in res.reports)
    trained = res.trained_group_ids
    assert len(trained) == len(set(trained)) == 8 * 112
    assert set(trained) | set(res.held_groups) == set(range(res.admitted_groups))


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
    # PCIe (15.2 GB / (64 GB/s x 0.7) = 0.34 s), after the sync's fixed cost (1.0 s)
    host, device = cost_model.build(cfg), cost_model.build(load_preset("paper-7b-h200", [*SPLIT, BACKGROUND]))
    assert host.sync_gather_s == pytest.approx(1.0 + cfg.actor.weight_bytes / (64e9 * 0.7))
    assert device.sync_gather_s == pytest.approx(1.0 + cfg.actor.weight_bytes / (450e9 * 0.7))


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
    # the trainer: the sync's fixed cost (1.0 s) and each rank's copy of its 2.6 GB at 4.8 TB/s x 0.7: 0.8 ms
    assert c.sync_gather_s == pytest.approx(1.0 + 145.4e9 / 56 / (4.8e12 * 0.7), rel=1e-3)
    # the engines: each of the 8 engine devices takes the whole 145 GB through its 50 GB/s NIC (4.2 s), and
    # each of the 56 senders sends 8 x 2.6 GB (under that): 0.5 + 4.2 s, against the gathered sync's 0.5 + 2 x 4.2
    one_way = 145.4e9 / (50e9 * 0.7)
    assert c.sharded_sync_s == pytest.approx(0.5 + one_way, rel=1e-3)
    assert c.weight_sync_s == pytest.approx(0.5 + 2 * one_way, rel=1e-3)  # a foreground sync still gathers
    assert gathered.sharded_sync_s == 0 and gathered.sync_gather_s == pytest.approx(1.0 + one_way, rel=1e-3)
