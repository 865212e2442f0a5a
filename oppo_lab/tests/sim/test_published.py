"""`simulate published`: the published presets, the verdict, the stage split, and what the
simulator needed to run them (no reward model, offload, activation recompute)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers
from openrlhf_oppo.sim.world import RunResult, StepRecord
from oppo_lab.sim import PRESET_DIR, load_preset, published

PUBLISHED = ("published-verl-qwen2-7b-gsm8k", "published-verl-deepseek-7b-ppo", "published-openrlhf-llama2-7b",
             "published-verl-dapo-7b-32xh20", "published-verl-dapo-7b-16xh20", "published-verl-dapo-7b-16xh20-onestep",
             "published-verl-dapo-7b-16xh20-megatron", "published-verl-dapo-7b-16xh20-megatron-onestep")
# models.yaml qwen2.5-7b: 28 x (2 x 3584^2 + 2 x 3584 x 512 + 3 x 3584 x 18944) + 2 x 152064 x 3584
QWEN25_7B_PARAMS = 7_615_283_200


def small(*sets: str, preset: str = "paper-7b-h200"):
    cfg = load_preset(preset, ["workload.batch_groups=16", "workload.steps=3", "workload.warmup_steps=1",
                               "workload.seeds=1", "delta.max=16", *sets])
    return cfg, cost_model.build(cfg)


def make_row(ratio: float) -> published.Row:
    return published.Row("published-x", "sync", "8 x h200", "94+151/1024", 100.0 * ratio, 100.0,
                         dict.fromkeys(published.STAGES, 1.0), {"update": 2.0})


def test_every_published_run_has_a_preset_with_its_step_time_hardware_and_sources():
    assert set(PUBLISHED) <= set(published.published_presets())
    for name in PUBLISHED:
        cfg = load_preset(name)
        assert cfg.published.step_s > 0 and cfg.published.source and cfg.hardware is not None
        text = (PRESET_DIR / f"{name}.yaml").read_text()
        assert "# Source:" in text and "Assumed" in text  # sources and assumptions in the comments


def effective(e):
    """The efficiencies as charged: a sync_overhead_s of -1 is phase_overhead_s."""
    return replace(e, sync_overhead_s=e.phase_overhead_s if e.sync_overhead_s < 0 else e.sync_overhead_s)


def test_published_presets_use_the_paper_presets_efficiencies_one_set_for_every_hardware_kind():
    paper = effective(load_preset("paper-7b-h200").efficiency)
    assert effective(load_preset("paper-3b-a100").efficiency) == paper
    assert {effective(load_preset(name).efficiency) for name in PUBLISHED} == {paper}


@pytest.mark.parametrize(("ratio", "expected"), [
    (1.0, "within"), (1.3, "within"), (0.7, "within"),
    (0.69, "MISS: too fast"), (0.31, "MISS: too fast"), (1.31, "MISS: too slow"), (2.5, "MISS: too slow")])
def test_the_verdict_is_within_only_inside_thirty_percent_and_says_which_way_a_miss_goes(ratio, expected):
    assert published.verdict(ratio) == expected


def test_the_table_reports_a_miss_as_a_miss_and_counts_only_matches(capsys):
    published.print_table([make_row(0.5), make_row(1.1)])
    out = capsys.readouterr().out
    assert "MISS: too fast" in out and "within" in out
    assert "1 of 2 within ±30%" in out
    assert "1/2" in out and "1/-" in out  # published stage beside simulated; '-' where not published


def test_stage_split_is_covered_time_per_measured_step_with_parallel_servers_counted_once():
    def span(role: str, stage: str, t0: float, t1: float) -> dict:
        return {"kind": "span", "role": role, "host": "sim", "pid": 0, "stage": stage, "t0": t0, "t1": t1}

    rows = [span("driver", "generate", 0, 4), span("driver", "train", 4, 5),  # step 0 (warm-up)
            span("driver", "weight_sync", 5, 6), span("driver", "generate", 6, 9),
            span("reward", "score", 9, 11), span("reward", "score", 9.5, 10.5),  # two servers at once
            span("driver", "make_experience", 9, 11), span("driver", "train", 11, 15)]
    steps = [StepRecord(0, 0, 4, 5, 6, (0,), 10), StepRecord(1, 6, 9, 15, 16, (1,), 10)]
    result = RunResult("sync", 0, steps, rows, [], {}, {})
    split = published.stage_split(result, warmup_steps=1)  # window: from 5 s (step 0's training end) to 15 s
    assert split["generation"] == 3 and split["update"] == 4 and split["weight_sync"] == 1
    assert split["reward"] == 2  # 9-11, not 2 + 1
    assert split["experience"] == 5  # generation 6-9 and make_experience 9-11
    assert split["old_logprobs"] == 0


def test_a_run_without_a_reward_model_charges_no_reward_forward():
    for reward_model, charged in ((True, True), (False, False)):
        cfg, costs = small(f"workload.reward_model={str(reward_model).lower()}")
        result = drivers.simulate(cfg, costs, "sync", seed=0)
        assert (published.stage_split(result, 1)["reward"] > 0) is charged
    assert costs.prefill_s([(0, 1000), (500, 200)]) == 0.0


def test_a_rule_reward_needs_no_reward_shape():
    cfg = load_preset("published-verl-qwen2-7b-gsm8k", ["reward=null"])
    assert cfg.reward is None and not cfg.workload.reward_model
    with pytest.raises(ValueError, match="hardware"):
        load_preset("published-verl-qwen2-7b-gsm8k", ["reward=null", "workload.reward_model=true"])


def test_offload_adds_the_pcie_round_trips_to_each_phase_by_hand():
    _, plain = small()
    cfg, off = small("workload.offload_params=true", "workload.offload_optimizer=true")
    assert cfg.actor.params == QWEN25_7B_PARAMS and cfg.critic.params == QWEN25_7B_PARAMS
    pcie = 64e9 * 0.7  # h200's PCIe Gen5 x16 at link_efficiency 0.7; 7 training devices
    fp32 = 2 * 4 * QWEN25_7B_PARAMS / 7 / pcie  # 0.194 s: fp32 weights onloaded and offloaded
    bf16 = 2 * 2 * QWEN25_7B_PARAMS / 7 / pcie
    adam = 2 * 8 * QWEN25_7B_PARAMS / 7 / pcie
    assert fp32 == pytest.approx(0.19427, rel=1e-4)
    base, with_offload = plain.make_experience_s(1000, True, True), off.make_experience_s(1000, True, True)
    assert with_offload["old_logprobs"] - base["old_logprobs"] == pytest.approx(fp32)
    assert with_offload["ref_logprobs"] - base["ref_logprobs"] == pytest.approx(bf16)
    assert with_offload["values"] - base["values"] == pytest.approx(fp32)
    assert off.train_s(1000) - plain.train_s(1000) == pytest.approx(2 * fp32 + 2 * adam)  # actor and critic
    assert off.weight_sync_s - plain.weight_sync_s == pytest.approx(fp32)  # the actor onloaded to reshard


def test_activation_recompute_charges_a_third_more_training_flops():
    _, plain = small()
    _, recompute = small("workload.gradient_checkpointing=true")
    assert recompute.train_per_token_s == pytest.approx(plain.train_per_token_s * 8 / 6)
    assert recompute.forward_per_token_s == plain.forward_per_token_s


def test_the_published_command_simulates_a_chosen_run(capsys):
    assert published.main(["--presets", "published-verl-deepseek-7b-ppo", "--set", "workload.batch_groups=64"]) == 0
    out = capsys.readouterr().out
    assert "verl-deepseek-7b-ppo" in out and "4 x h20" in out and "of 1 within" in out


def test_the_published_command_refuses_a_preset_without_published_figures():
    with pytest.raises(ValueError, match="--presets: paper-7b-h200"):
        published.main(["--presets", "paper-7b-h200"])
