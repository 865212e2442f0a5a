"""A rule reward (`workload.reward_model: false`): no reward forward anywhere, and no reward model to
place, so a colocated layout needs no `split.reward_with_train` and holds no reward model. The
expectations are worked out by hand on the hand-sized setup (tests/sim/hand-sized.yaml)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from openrlhf_oppo.sim import costs as cost_model
from openrlhf_oppo.sim import drivers, layouts, memory
from openrlhf_oppo.sim.presets import Split, load_preset

HAND = str(Path(__file__).with_name("hand-sized.yaml"))
RULE = "workload.reward_model=false"
COLOCATED = ["split.colocate=true", "split.generate_gpus=8", "split.train_gpus=8"]
PHASE_S = 2.0  # the preset's efficiency.phase_overhead_s
PROMPT = 100  # lengths.prompt_tokens; 8 samples a step
# one forward of the 1e9-parameter model, 2 N flops a token, on D devices of 1e15 flop/s at forward_mfu 0.5
FORWARD_S = {4: 2 * 1e9 / (4 * 1e15 * 0.5), 8: 2 * 1e9 / (8 * 1e15 * 0.5)}


def make_experience(schedule: str, *sets: str) -> tuple[list[float], list[int], set[str]]:
    """Each step's make_experience seconds, its trained tokens (prompt + response, packed) and the
    stages the training devices ran."""
    cfg, why = layouts.check(load_preset(HAND, list(sets)), schedule)
    assert why == []
    res = drivers.simulate(cfg, cost_model.build(cfg), schedule, 0)
    spans = sorted((r["t0"], r["t1"]) for r in res.rows
                   if r["kind"] == "span" and r["role"] == "driver" and r["stage"] == "make_experience")
    stages = {r["stage"] for r in res.rows if r["kind"] == "span" and r["role"] in ("actor", "ref", "critic", "reward")}
    return [t1 - t0 for t0, t1 in spans], [s.tokens + 8 * PROMPT for s in res.steps], stages


@pytest.mark.parametrize(("schedule", "sets", "devices"), [
    ("async", [], 4),  # 4 vLLM / 4 DeepSpeed devices, the reward model among them
    ("sync", COLOCATED, 8),  # every model on the 8 devices
], ids=["split", "colocated"])
def test_a_rule_reward_charges_no_reward_forward_where_the_reward_model_would_sit_with_training(schedule, sets,
                                                                                                 devices):
    # with a reward model: old log-probs, reference, values and rewards, 4 forwards a token; a rule: 3
    for reward_model, forwards in ((True, 4), (False, 3)):
        seconds, tokens, stages = make_experience(schedule, *sets, f"workload.reward_model={str(reward_model).lower()}")
        assert ("rewards" in stages) is reward_model
        assert len(seconds) >= len(tokens) == 6  # (an async trainer may have begun the next step)
        for s, n in zip(seconds, tokens):
            assert s == pytest.approx(PHASE_S + forwards * FORWARD_S[devices] * n)


def test_a_rule_reward_runs_colocated_without_reward_with_train_and_holds_no_reward_model():
    rule_cfg = load_preset(HAND, [*COLOCATED, "split.reward_with_train=false", RULE])
    assert layouts.check(rule_cfg, "sync")[1] == []
    refused = layouts.check(load_preset(HAND, [*COLOCATED, "split.reward_with_train=false"]), "sync")[1]
    assert any("colocate_all puts OpenRLHF's reward model" in why for why in refused)  # a reward model needs a place
    # the training side by hand over 8 devices: actor and critic 16 B a parameter, the reference 2 B, no
    # reward model; 2 GB of live parameters; one micro-batch of 200 tokens: 100 layers x 2 x 200 x
    # (10 x 1000 + 4 x 1000) B and fp32 logits 8 x 200 x 300,000 B
    activations = 100 * 2 * 200 * 14_000 + 8 * 200 * 300_000
    train = (16 + 16 + 2) * 1e9 / 8 + 2e9 + activations
    for cfg in (rule_cfg, load_preset(HAND, [*COLOCATED, RULE])):  # reward_with_train or not: nothing to hold
        assert sum(b for _, b in memory.training_items(cfg)) == pytest.approx(train)
        # vLLM gets what the training side and the 4 GB reserve leave (no streaming reward actor beside it)
        fitted = memory.fit_engines(cfg)
        assert fitted.workload.kv_cache_fraction == pytest.approx((20e9 - 4e9 - train) / 20e9)


def test_apart_from_vllm_a_run_without_critic_or_reward_model_trains_on_its_devices_alone():
    # a rule reward without a critic (GRPO): nothing to place beside the actor, any framework's layout
    pooled = dataclasses.replace(Split(), colocate=False, generate_gpus=4, train_gpus=4, score_gpus=0,
                                 reward_with_train=True)
    assert layouts.rule("sync", pooled, critic=False, reward_model=False) is None
    assert "devices of their own" in layouts.rule("sync", pooled, critic=False, reward_model=True)
