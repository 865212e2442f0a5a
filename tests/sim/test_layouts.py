"""Layouts each schedule's framework can run, the memory check, sleep mode and the best-layout search."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import layouts, memory, presets, report
from openrlhf_oppo.sim.cli import main as simulate_main
from openrlhf_oppo.sim.drivers import simulate

SHORT = ["workload.steps=6", "workload.warmup_steps=2", "workload.seeds=1"]
HAND = str(Path(__file__).with_name("hand-sized.yaml"))  # round numbers (see the file)


def _split(cfg, **kw):
    return dataclasses.replace(cfg, split=dataclasses.replace(cfg.split, **kw))


def test_training_devices_hold_zero3_states_by_hand():
    cfg = presets.load_preset("paper-7b-h200")  # 7 training devices, actor = critic = reference = Qwen2.5-7B
    items = dict(memory.training_items(cfg))
    p = cfg.actor.params
    assert items["actor ZeRO-3 states"] == pytest.approx(16 * p / 7)
    assert items["critic ZeRO-3 states"] == pytest.approx(16 * p / 7)
    assert items["reference"] == pytest.approx(2 * p / 7)
    assert "reward model" not in items  # the preset's reward model has its own device
    t = cfg.workload.micro_batch_size * (256 + 1024)
    layer = 2 * t * (10 * 3584 + 4 * 18944)
    assert items["activations"] == pytest.approx(28 * layer + 8 * t * 152064)  # no recompute: every layer's
    ckpt = dict(memory.training_items(presets.load_preset("paper-7b-h200", ["workload.gradient_checkpointing=true"])))
    assert ckpt["activations"] == pytest.approx(2 * 28 * t * 3584 + layer + 8 * t * 152064)


def test_colocated_awake_overflows_at_vllms_default_share_and_fit_gives_it_the_rest():
    cfg = presets.load_preset("paper-7b-h200")
    over = memory.overflow(cfg)  # vLLM claims 0.9 of 141 GB beside the ZeRO-3 states
    assert len(over) == 1 and over[0].startswith("colocated devices:") and "over by" in over[0]
    fitted = memory.fit_engines(cfg)
    share = fitted.workload.kv_cache_fraction
    train = sum(b for _, b in memory.training_items(cfg))
    assert share * 141e9 + train + memory.RESERVE_BYTES == pytest.approx(141e9)
    assert memory.overflow(fitted) == []
    assert memory.fit_engines(_split(cfg, colocate=False, train_gpus=1, generate_gpus=6)) is not None


def test_a_72b_actor_and_critic_do_not_fit_one_node_of_training_devices():
    cfg = presets.load_preset("paper-7b-h200", ["actor=qwen2.5-72b", "critic=qwen2.5-72b", "split.colocate=false",
                                                "split.generate_gpus=4", "split.train_gpus=2", "split.critic_gpus=1",
                                                "split.tensor_parallel=4"])
    over = memory.overflow(cfg)
    assert any(m.startswith("training devices:") and "actor ZeRO-3 states" in m for m in over)
    assert any(m.startswith("critic devices:") and "critic ZeRO-3 states" in m for m in over)
    _, reasons = layouts.check(cfg, "sync")
    assert reasons == over


def test_a_streaming_reward_actor_holds_the_whole_model_but_openrlhfs_reward_model_a_shard():
    cfg = presets.load_preset("paper-7b-h200", ["reward=qwen2.5-72b", "split.score_tensor_parallel=2",
                                                "split.score_gpus=2", "split.generate_gpus=6", "split.train_gpus=6"])
    _, oppo = layouts.check(cfg, "oppo")  # 145 GB of weights on one 141 GB device, whatever the TP
    assert any(m.startswith("reward devices:") and "streaming reward actor 145.4" in m for m in oppo)
    assert not any(m.startswith("reward devices:") for m in memory.overflow(cfg, streams=False))


def test_sleep_moves_vllm_weights_and_deepspeed_states_each_way():
    cfg = presets.load_preset("paper-7b-h200", ["split.score_gpus=0", "split.generate_gpus=8", "split.train_gpus=8",
                                                "split.reward_with_train=true", *SHORT])
    states = sum(b for what, b in memory.training_items(cfg) if what in ("actor ZeRO-3 states", "critic ZeRO-3 states"))
    asleep = _split(cfg, sleep=True)
    pcie = cfg.hardware.pcie_bytes_per_s
    assert memory.sleep_transfer_s(asleep) == pytest.approx((cfg.actor.weight_bytes + states) / pcie)
    assert memory.sleep_transfer_s(cfg) == 0.0
    assert memory.overflow(asleep) == []  # one side at a time: vLLM keeps its 0.9

    def step_s(c):
        r = simulate(c, cost_model.build(c), "sync", 0)
        return [b.train_end_s - a.train_end_s for a, b in zip(r.steps, r.steps[1:])][-1], r

    awake_s, _ = step_s(memory.fit_engines(cfg))
    sleep_s, run = step_s(asleep)
    assert sleep_s - awake_s == pytest.approx(2 * memory.sleep_transfer_s(asleep), rel=0.02)
    assert any(r["stage"] == "offload" for r in run.rows if r.get("role") == "driver")


def test_reward_with_train_is_a_make_experience_stage_not_a_reward_server_call():
    cfg = presets.load_preset("paper-7b-h200", ["split.score_gpus=0", "split.colocate=false", "split.generate_gpus=2",
                                                "split.train_gpus=6", "split.reward_with_train=true", *SHORT])
    run = simulate(cfg, cost_model.build(cfg), "sync", 0)
    stages = {(r["role"], r["stage"]) for r in run.rows if r["kind"] == "span"}
    assert ("reward", "rewards") in stages and ("reward", "score") not in stages


INTER = ("streaming.enable=false",)  # carry-over only: OpenRLHF's reward forward


@pytest.mark.parametrize(("schedule", "sets", "split", "refused"), [
    ("async", (), {"colocate": True}, "own devices"),
    ("oversample", (), {"colocate": True}, "own devices"),
    ("oppo", (), {"colocate": True, "sleep": True, "score_gpus": 0}, None),  # the hybrid engine, reward actors beside
    ("oppo", INTER, {"colocate": True, "sleep": True, "score_gpus": 0, "reward_with_train": True}, None),
    ("async", (), {"colocate": True, "sleep": True, "score_gpus": 0, "reward_with_train": True}, "Async RLHF"),
    ("partial", (), {"colocate": True, "sleep": True, "score_gpus": 0, "reward_with_train": True}, "Async RLHF"),
    ("oppo-async", (), {"colocate": False, "score_gpus": 0, "reward_with_train": True}, "streaming reward actors"),
    ("oppo", INTER, {"colocate": False, "score_gpus": 0, "reward_with_train": True, "critic_gpus": 1}, None),
    ("oppo", INTER, {"colocate": False, "score_gpus": 0, "reward_with_train": True}, "devices of their own"),
    # async admission in OpenRLHF's async layout (--train.colocate_all --train.async_enable)
    ("oppo-async", INTER, {"colocate": False, "score_gpus": 0, "reward_with_train": True}, None),
    ("oppo-async", INTER, {"colocate": False, "score_gpus": 1}, "devices of their own"),
    ("oppo-async-bg", (), {"colocate": False, "score_gpus": 0, "reward_with_train": True}, None),
    ("oppo-async-bg", (), {"colocate": True, "sleep": True, "score_gpus": 0, "reward_with_train": True},
     "async admission"),
    ("sync", (), {"colocate": False, "score_gpus": 1}, "devices of their own"),  # the critic beside the actor
    ("partial", (), {"colocate": False, "score_gpus": 1}, "devices of their own"),
    ("oppo", (), {"colocate": False, "score_gpus": 1, "critic_gpus": 2}, None),
    ("sync", (), {"colocate": True, "score_gpus": 0}, "colocate_all"),
    ("oppo", INTER, {"colocate": True, "score_gpus": 0}, "colocate_all"),
    ("sync", (), {"colocate": True, "sleep": True, "score_gpus": 0, "reward_with_train": True}, None),
    ("async", (), {"colocate": False, "score_gpus": 0, "reward_with_train": True}, None),
    ("oppo", (), {"colocate": True, "score_gpus": 0}, None),
])
def test_rules_of_openrlhf_and_oppo(schedule, sets, split, refused):
    cfg = presets.load_preset("paper-7b-h200", sets)
    why = layouts.rule(schedule, dataclasses.replace(presets.Split(), **split), layouts.streams_reward(cfg, schedule),
                       async_admission=layouts.admits_async(cfg, schedule))
    assert (why is None) if refused is None else (refused in why)


def test_an_oppo_schedule_streams_rewards_unless_streaming_is_off():
    cfg = presets.load_preset("paper-7b-h200")
    assert layouts.streams_reward(cfg, "oppo") and not layouts.streams_reward(cfg, "oppo-async-bg")
    assert not layouts.streams_reward(cfg, "sync")
    assert not layouts.streams_reward(presets.load_preset("paper-7b-h200", ["streaming.enable=false"]), "oppo")


def test_run_all_refuses_what_a_framework_cannot_run_and_says_why():
    sim = report.run_all(presets.load_preset("paper-7b-h200", SHORT), ("sync", "async", "oppo"))
    assert set(sim.runs) == {"sync", "oppo"}
    assert "colocates only the DeepSpeed models" in sim.refused["async"][0]
    assert sim.layouts["sync"].workload.kv_cache_fraction < 0.9  # fitted beside the training side


def _fits_by_hand(split) -> bool:
    """Whether the hand-sized setup's DeepSpeed devices hold their ZeRO-3 states (tests/sim/hand-sized.yaml:
    actor = critic = reward = 1e9 parameters, 20 GB devices). Each training device holds 16 B a parameter
    of each model it trains and 2 B of each frozen one (the reference; the reward model among them),
    sharded over its group, and beside that 2 GB of live parameters, one micro-batch's activations (200
    tokens: 100 layers x 2 x 200 x (10 x 1000 + 4 x 1000) B, fp32 logits 8 x 200 x 300,000 B) and a 4 GB
    reserve. The engine devices (vLLM's 0.5 of 20 GB + 4 GB), the reward devices (a 2 GB shard at most)
    and colocated devices (vLLM gets what the 8-way training side, 7.5 GB, leaves) always fit."""
    beside = 2e9 + (100 * 2 * 200 * 14_000 + 8 * 200 * 300_000) + 4e9
    reward = 2e9 if split.reward_with_train else 0.0
    if split.colocate:
        return True
    if not split.critic_gpus:  # actor, critic, reference (and reward model) on the same devices
        return (16e9 + 16e9 + 2e9 + reward) / split.train_gpus + beside <= 20e9
    actor = (16e9 + 2e9) / split.train_gpus + beside
    critic = (16e9 + reward) / split.critic_gpus + beside
    return actor <= 20e9 and critic <= 20e9


def test_best_layout_runs_each_schedule_in_its_fastest_layout_of_those_that_fit_by_hand():
    cfg = presets.load_preset(HAND)
    schedules = ("sync", "async", "oppo")  # OPPO without streaming: OpenRLHF's reward model
    sim, tried, space = report.best_layouts(cfg, schedules)
    for s in schedules:
        means = [m for _, m in tried[s]]
        assert means == sorted(means) and len(means) == len(space.runnable[s])
        assert layouts.describe(sim.layouts[s].split) == tried[s][0][0]
        assert all(_fits_by_hand(c.split) for c in space.runnable[s])
    assert not sim.layouts["async"].split.colocate
    # the refusals are the layouts that do not fit by hand: 1 or 2 pooled devices (34 or 36 GB of states over
    # them, beside 7 GB), a group of 1 (18 GB of the actor's, or 16 GB of the critic's, beside 7 GB)
    refused = {(split.train_gpus, split.critic_gpus) for split, _, _ in space.refused}
    assert refused == {(1, 0), (2, 0), (1, 1), (2, 1), (1, 2)}
    assert not any(_fits_by_hand(split) for split, _, _ in space.refused)


def test_cli_best_layout_prints_layouts_and_refuses_a_measured_preset(capsys, tmp_path):
    assert simulate_main(["--preset", "paper-7b-h200", "--best-layout", "--schedules", "sync", "oppo", "--no-plot",
                          "--output", str(tmp_path), "--set", *SHORT]) == 0
    out = capsys.readouterr().out
    assert "layouts searched:" in out and "do not fit:" in out and "over by" in out and "runner-up" in out
    with pytest.raises(ValueError, match="--best-layout"):
        simulate_main(["--preset", "cpu-longtail", "--best-layout", "--no-plot", "--output", str(tmp_path)])


def test_a_critic_on_devices_of_its_own_runs_beside_the_actor_at_its_share_of_the_devices():
    cfg = presets.load_preset("paper-7b-h200", ["split.colocate=false", "split.generate_gpus=2", "split.train_gpus=3",
                                                "split.critic_gpus=2", "split.score_gpus=1", *SHORT])
    c = cost_model.build(cfg)
    assert (c.actor_group_scale, c.critic_group_scale, c.critic_train_share) == pytest.approx((5 / 3, 5 / 2, 0.5))
    run = simulate(cfg, c, "sync", 0)
    spans = {}
    for r in run.rows:
        if r["kind"] == "span" and r["role"] in ("actor", "critic"):
            spans.setdefault((r["role"], r["stage"]), []).append((r["t0"], r["t1"]))
    for (a0, a1), (v0, v1) in zip(spans[("actor", "old_logprobs")], spans[("critic", "values")]):
        assert a0 == v0 and (v1 - v0) / (a1 - a0) == pytest.approx(1.5)  # the same 7B forward on 2 devices, not 3
    for (a0, a1), (b0, b1) in zip(spans[("actor", "train")], spans[("critic", "train")]):
        assert a0 == b0 and (a1 - a0) / (b1 - b0) == pytest.approx(2 / 3)


def test_engine_nodes_hold_only_engines_and_the_pattern_repeats_on_the_others():
    # 4 nodes: one of vLLM only (4 engines of TP 2), three of 6 DeepSpeed + 2 reward devices, no engines
    cfg = presets.load_preset("paper-7b-h200", ["split.nodes=4", "split.engine_nodes=1", "split.colocate=false",
                                                "split.generate_gpus=0", "split.tensor_parallel=2",
                                                "split.train_gpus=6", "split.score_gpus=2", *SHORT])
    s = cfg.split
    assert (s.pattern_nodes, s.engines, s.devices) == (3, 4, 8 + 3 * 8)
    c = cost_model.build(cfg)
    assert (c.engines, c.scorers) == (4, 6)
    assert memory.training_items(cfg)[0] == ("actor ZeRO-3 states", pytest.approx(16 * cfg.actor.params / 18))
    one_pattern = cost_model.build(_split(cfg, nodes=3, engine_nodes=0, generate_gpus=2, train_gpus=4))
    assert c.train_per_token_s == pytest.approx(one_pattern.train_per_token_s * 12 / 18)  # 18 training devices, not 12
    assert "1 vLLM node + 3 x (6 train / 2 reward) (TP 2)" == layouts.describe(s)


@pytest.mark.parametrize("edit, key", [
    (["split.nodes=2", "split.engine_nodes=2", "split.colocate=false"], "split.engine_nodes"),
    (["split.nodes=2", "split.engine_nodes=1"], "split.engine_nodes"),  # colocated
    (["split.nodes=2", "split.engine_nodes=1", "split.colocate=false", "split.generate_gpus=0",
      "split.tensor_parallel=3"], "split.tensor_parallel"),
    (["split.generate_gpus=0", "split.colocate=false"], "split.generate_gpus"),
])
def test_engine_nodes_that_cannot_be_placed_are_refused_by_name(edit, key):
    with pytest.raises(ValueError, match=key):
        presets.load_preset("paper-7b-h200", edit)


def test_the_search_places_vllm_on_nodes_of_its_own_as_openrlhf_does_across_nodes():
    one = presets.load_preset("paper-7b-h200", SHORT)
    assert not any(s.engine_nodes for s in layouts.candidates(one))  # one node: nothing to give vLLM whole
    cfg = presets.load_preset("paper-7b-h200", ["split.nodes=4", *SHORT])
    whole = [s for s in layouts.candidates(cfg) if s.engine_nodes]
    assert {s.engine_nodes for s in whole} == {1, 2, 3} and all(s.generate_gpus == 0 for s in whole)
    assert all(layouts.rule("async", s) is None for s in whole if s.reward_with_train and not s.critic_gpus)
    assert all(layouts.rule("sync", s) for s in whole if not s.critic_gpus)  # the critic beside the actor


def test_the_search_tries_every_tensor_parallel_size_whose_weight_share_leaves_room_for_kv():
    """Not only the two smallest: at reasoning lengths over-sampling's best engines are TP 4, and a
    search without them flattered OPPO by comparing against a slower OpenRLHF layout."""
    seven = presets.load_preset("paper-7b-h200", SHORT)
    assert {s.tensor_parallel for s in layouts.candidates(seven)} == {1, 2, 4}  # 28 heads: vLLM refuses TP 8
    big = presets.load_preset("paper-7b-h200", [*SHORT, "actor=qwen2.5-72b"])  # 145 GB: over 3/4 of one device
    assert {s.tensor_parallel for s in layouts.candidates(big)} == {2, 4, 8}
    with pytest.raises(ValueError, match=r"split.tensor_parallel.*28 heads, 4 KV heads"):
        presets.load_preset("paper-7b-h200", ["split.generate_gpus=8", "split.train_gpus=8", "split.score_gpus=0",
                                              "split.tensor_parallel=8"])
