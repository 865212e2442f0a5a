"""Layouts each schedule's framework can run, the memory check, sleep mode and the best-layout search."""

from __future__ import annotations

import dataclasses

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import layouts, memory, presets, report
from openrlhf_oppo.sim.cli import main as simulate_main
from openrlhf_oppo.sim.drivers import simulate

SHORT = ["workload.steps=6", "workload.warmup_steps=2", "workload.seeds=1"]


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
                                                "split.generate_gpus=4", "split.train_gpus=3",
                                                "split.tensor_parallel=4"])
    over = memory.overflow(cfg)
    assert any(m.startswith("training devices:") and "actor ZeRO-3 states" in m for m in over)
    _, reasons = layouts.check(cfg, "sync")
    assert reasons == over


def test_sleep_moves_vllm_weights_and_deepspeed_states_each_way():
    cfg = presets.load_preset("paper-7b-h200", ["split.score_gpus=0", "split.generate_gpus=8", "split.train_gpus=8",
                                                "split.reward_with_train=true", *SHORT])
    states = sum(b for what, b in memory.training_items(cfg) if what not in ("activations", "ZeRO-3 live parameters"))
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


@pytest.mark.parametrize(("schedule", "split", "refused"), [
    ("async", {"colocate": True}, "own devices"),
    ("oversample", {"colocate": True}, "own devices"),
    ("oppo", {"colocate": True, "sleep": True}, "sleep mode"),
    ("oppo-async", {"colocate": False, "score_gpus": 0, "reward_with_train": True}, "streaming reward actors"),
    ("oppo-inter", {"colocate": False, "score_gpus": 0, "reward_with_train": True}, None),  # streams nothing
    ("sync", {"colocate": True, "score_gpus": 0}, "colocate_all"),
    ("oppo-inter", {"colocate": True, "score_gpus": 0}, "colocate_all"),
    ("sync", {"colocate": True, "sleep": True, "score_gpus": 0, "reward_with_train": True}, None),
    ("async", {"colocate": False, "score_gpus": 0, "reward_with_train": True}, None),
    ("oppo", {"colocate": True, "score_gpus": 0}, None),
])
def test_rules_of_openrlhf_and_oppo(schedule, split, refused):
    cfg = presets.load_preset("paper-7b-h200")
    why = layouts.rule(schedule, dataclasses.replace(presets.Split(), **split), layouts.streams_reward(cfg, schedule))
    assert (why is None) if refused is None else (refused in why)


def test_an_oppo_schedule_streams_rewards_unless_streaming_is_off():
    cfg = presets.load_preset("paper-7b-h200")
    assert layouts.streams_reward(cfg, "oppo") and not layouts.streams_reward(cfg, "oppo-inter")
    assert not layouts.streams_reward(cfg, "sync")
    assert not layouts.streams_reward(presets.load_preset("paper-7b-h200", ["streaming.enable=false"]), "oppo")


def test_run_all_refuses_what_a_framework_cannot_run_and_says_why():
    sim = report.run_all(presets.load_preset("paper-7b-h200", SHORT), ("sync", "async", "oppo"))
    assert set(sim.runs) == {"sync", "oppo"}
    assert "colocates only the DeepSpeed models" in sim.refused["async"][0]
    assert sim.layouts["sync"].workload.kv_cache_fraction < 0.9  # fitted beside the training side


def test_best_layout_runs_each_schedule_in_its_fastest_runnable_layout_that_fits():
    cfg = presets.load_preset("paper-7b-h200", SHORT)
    sim, tried, space = report.best_layouts(cfg, ("sync", "async", "oppo"))
    for s in ("sync", "async", "oppo"):
        means = [m for _, m in tried[s]]
        assert means == sorted(means) and len(means) == len(space.runnable[s])
        chosen = sim.layouts[s]
        assert layouts.describe(chosen.split) == tried[s][0][0]
        assert layouts.rule(s, chosen.split, layouts.streams_reward(cfg, s)) is None and memory.overflow(chosen) == []
    assert not sim.layouts["async"].split.colocate
    assert space.refused and all(memory.overflow(dataclasses.replace(cfg, split=sp)) for sp, _ in space.refused)
    refused = {layouts.describe(sp) for sp, _ in space.refused}
    assert not any(layouts.describe(c.split) in refused for c in space.runnable["sync"])


def test_cli_best_layout_prints_layouts_and_refuses_a_measured_preset(capsys, tmp_path):
    assert simulate_main(["--preset", "paper-7b-h200", "--best-layout", "--schedules", "sync", "oppo", "--no-plot",
                          "--output", str(tmp_path), "--set", *SHORT]) == 0
    out = capsys.readouterr().out
    assert "layouts searched:" in out and "do not fit:" in out and "over by" in out and "runner-up" in out
    with pytest.raises(ValueError, match="--best-layout"):
        simulate_main(["--preset", "cpu-longtail", "--best-layout", "--no-plot", "--output", str(tmp_path)])
