"""OPPO in the hybrid engine (`split.sleep`): carried requests stop at the batch, nothing decodes
while the engines sleep, the stopped samples decode on from their held tokens after the wake and
pay a prefill of prompt + held tokens; async admission is refused; the ledger holds."""

from __future__ import annotations

import dataclasses

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, layouts, memory
from openrlhf_oppo.sim.engine import EventLoop, Recorder, Request, Rollout
from openrlhf_oppo.sim.presets import load_preset

SMALL = ["workload.steps=8", "workload.warmup_steps=2", "workload.seeds=1", "workload.batch_groups=16",
         "delta.max=16", "lengths.std_tokens=1000", "lengths.cap_tokens=4096", "workload.gradient_checkpointing=true"]
ASLEEP = ["split.colocate=true", "split.sleep=true", "split.generate_gpus=8", "split.train_gpus=8",
          "split.tensor_parallel=2", "split.score_gpus=0"]  # streaming reward actors beside the engines
# carry-over only: OpenRLHF's reward forward, its reward model among the DeepSpeed models
INTER = ["streaming.enable=false", "split.reward_with_train=true"]


def make_driver(*sets: str) -> drivers.OppoDriver:
    cfg = load_preset("paper-7b-h200", [*SMALL, *ASLEEP, *sets])
    cfg, why = layouts.check(cfg, "oppo")
    assert why == []
    return drivers.OppoDriver(cfg, cost_model.build(cfg), 0, "oppo")


def hand_costs() -> cost_model.CostModel:
    """One engine; a decode iteration takes 1 s whatever the batch; a prefill call 0.5 s + 0.01 s a token."""
    zero = {f.name: 0.0 for f in dataclasses.fields(cost_model.CostModel) if f.type == "float"}
    return cost_model.CostModel(**{**zero, "decode_overhead_s": 1.0, "prefill_call_s": 0.5, "prefill_per_token_s": 0.01,
                                   "decode_slowdown_shared": 1.0, "train_slowdown_shared": 1.0},
                                engines=1, scorers=0, scorer_on_engines=False, seqs_per_engine=8)


def test_a_stopped_request_decodes_on_from_its_tokens_after_a_reprefill_by_hand():
    loop, rec = EventLoop(), Recorder()
    finished: list[tuple[int, float]] = []
    rollout = Rollout(loop, hand_costs(), rec, lambda e, crossed, done, now: finished.extend(
        (r.sample_id, now) for r in done))
    req = Request(7, prompt_tokens=10, target_tokens=20, cap_tokens=64)
    loop.at(0.0, rollout.admit, [[req]], 0.0)
    stopped: list[Request] = []
    loop.at(5.5, lambda: stopped.extend(rollout.stop(5.5)))
    loop.run(lambda: loop.now_s >= 5.5)
    assert stopped == [req] and req.done == 5 and not rollout.running()  # 5 whole iterations by 5.5 s
    req.reprefill = req.prompt_tokens + req.done  # what the driver sets: prompt + held tokens
    loop.at(30.0, rollout.restart, [req], 30.0)
    loop.run(lambda: bool(finished))
    # prefill of 10 + 5 tokens: 0.5 + 0.01 * 15 = 0.65 s, then the 15 tokens left at 1 s each
    assert finished == [(7, pytest.approx(30.0 + 0.65 + 15.0))]
    assert rollout.reprefilled_tokens == 15 and rollout.decoded_tokens == 20
    spans = [(r["t0"], r["t1"], r["tokens"]) for r in rec.rows if r.get("stage") == "reprefill"]
    assert spans == [(30.0, pytest.approx(30.65), 15)]


def test_each_stopped_sample_pays_a_prefill_of_prompt_plus_the_tokens_the_scheduler_holds():
    drv = make_driver()
    restart = drv.rollout.restart
    seen: list[tuple[int, int, int]] = []  # (re-prefill tokens, prompt + tokens decoded, prompt + held)

    def restart_and_check(reqs, now_s):
        seen.extend((r.reprefill, r.prompt_tokens + r.done, r.prompt_tokens + len(drv.sched.held_tokens(r.sample_id)))
                    for r in reqs)
        restart(reqs, now_s)

    drv.rollout.restart = restart_and_check
    res = drv.run()
    assert seen and all(a == b == c for a, b, c in seen)
    assert res.reprefilled_tokens == sum(a for a, _, _ in seen if a)  # every one re-entered the batch
    prefill = cost_model.engine_prefill(drv.cfg, drv.costs)
    tp, hw, actor = drv.cfg.split.tensor_parallel, drv.cfg.hardware, drv.cfg.actor
    flops = tp * hw.peak_bf16_flops * drv.cfg.efficiency.prefill_mfu
    assert prefill.prefill_per_token_s == pytest.approx(2 * actor.params / flops)  # the actor's shape over TP
    spans = [r for r in res.rows if r.get("stage") == "reprefill"]
    assert sum(r["tokens"] for r in spans) == res.reprefilled_tokens
    for r in spans[:3]:  # one call per engine: its duration is the prefill of those sequences
        assert r["t1"] - r["t0"] >= prefill.prefill_s([(0, r["tokens"])]) - 1e-9


@pytest.mark.parametrize("sets", [[], INTER], ids=["oppo", "carry-over-only"])
def test_nothing_decodes_between_the_batch_and_the_wake(sets):
    drv = make_driver(*sets)
    marks: list[int] = []
    batch_ready, synced = drv.batch_ready, drv._synced

    def at_batch(now_s, batch):
        batch_ready(now_s, batch)
        assert not drv.rollout.running()  # every carried request stopped
        marks.append(drv.rollout.decoded_tokens)

    def at_wake(now_s):
        assert drv.rollout.decoded_tokens == marks[-1] and not drv.rollout.running()
        synced(now_s)

    drv.batch_ready, drv._synced = at_batch, at_wake
    res = drv.run()
    assert res.reprefilled_tokens > 0  # there were carried samples to stop
    for step in res.steps:
        assert not any(a < step.sync_end_s and b > step.batch_ready_s for a, b in res.busy["rollout"])
    offload = [r["t1"] - r["t0"] for r in res.rows if r.get("stage") == "offload"]
    assert offload and offload == pytest.approx([memory.sleep_transfer_s(drv.cfg)] * len(offload))


@pytest.mark.parametrize("sets", [[], INTER], ids=["oppo", "carry-over-only"])
def test_every_admitted_group_is_trained_exactly_once_or_held_at_the_end_asleep(sets):
    res = make_driver(*sets).run()
    trained = res.trained_group_ids
    assert len(trained) == len(set(trained)) == 8 * 16
    assert not set(trained) & set(res.held_groups)
    assert set(trained) | set(res.held_groups) == set(range(res.admitted_groups))


def test_async_admission_is_refused_asleep_by_the_layout_rules_and_the_driver():
    cfg = load_preset("paper-7b-h200", [*SMALL, *ASLEEP])
    _, why = layouts.check(cfg, "oppo-async")
    assert any("async admission" in w and "decode nothing" in w for w in why)
    _, why = layouts.check(load_preset("paper-7b-h200", [*SMALL, *ASLEEP, "staleness.max_policy_lag=2"]), "oppo")
    assert any("async admission" in w for w in why)
    assert layouts.check(cfg, "oppo")[1] == []
    async_split = dataclasses.replace(cfg.split, reward_with_train=True)
    assert "Async RLHF is not supported" in layouts.rule("async", async_split)
    with pytest.raises(ValueError, match="split.sleep"):
        drivers.OppoDriver(cfg, cost_model.build(cfg), 0, "oppo-async")


def test_streaming_actors_beside_sleeping_engines_stay_awake_beside_both_sides():
    cfg = load_preset("paper-7b-h200", [*SMALL, *ASLEEP])
    fitted = memory.fit_engines(cfg)
    reward = sum(b for _, b in memory.scorer_items(cfg, True))
    cap = cfg.hardware.hbm_bytes
    assert fitted.workload.kv_cache_fraction == pytest.approx(min(0.9, (cap - reward - memory.RESERVE_BYTES) / cap))
    (device,) = memory.plan(fitted, streams=True)
    train = sum(b for _, b in memory.training_items(fitted))
    engines = sum(b for _, b in memory.engine_items(fitted))
    assert device.total == pytest.approx(max(train, engines) + reward + memory.RESERVE_BYTES)
    assert "streaming reward actor" in dict(device.items)
