"""OpenRLHF 0.11.2's synchronous PPO, end to end on CPU through `openrlhf-oppo
train --schedule sync`: vLLM CPU rollout, ZeRO-3 actor and critic, reference,
reward model, GAE, KL; weights synced into vLLM through the compat layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

SYNC_STEPS = 4  # configs/tiny-cpu.yaml: 16 prompts / rollout batch 4
TIE_GAP = 1e-2  # greedy choices closer than this are numerical ties


def _state(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_sync_train_completes_every_step_with_a_weight_sync(sync_run):
    assert [p["sync"] for p in sync_run.probes()] == list(range(1, SYNC_STEPS + 1))
    assert any((sync_run.root / "tensorboard").rglob("events.out.tfevents.*"))


def test_vllm_output_changes_after_every_weight_sync(sync_run):
    probes = sync_run.probes()
    for before, after in zip(probes, probes[1:]):
        assert before["logprobs"] != after["logprobs"], f"sync {after['sync']} did not change vLLM's output"


def test_weights_synced_into_vllm_equal_the_trained_actor(sync_run, teacher_forced, logprob_atol):
    """After the last step the engine holds the saved actor's weights: its greedy
    tokens are the HF actor's argmax (up to numerical ties) and its logprobs match
    an HF forward of the trained actor, not of the initial one."""
    last = sync_run.probes()[-1]
    vllm_logprobs = torch.tensor(last["logprobs"])
    chosen, argmax, gap = teacher_forced(sync_run.root / "model", last)
    trained_err = (chosen - vllm_logprobs).abs().max()
    assert trained_err < logprob_atol
    decided = gap > TIE_GAP
    assert decided.sum() >= len(gap) // 2
    assert torch.equal(argmax[decided], torch.tensor(last["token_ids"])[decided])
    initial, _, _ = teacher_forced(sync_run.assets / "actor", last)
    initial_err = (initial - vllm_logprobs).abs().max()
    assert initial_err > logprob_atol and initial_err > 3 * trained_err  # the check can tell the two apart


def test_one_sync_ppo_step_changes_the_actor_and_training_changes_the_critic(sync_run, teacher_forced, logprob_atol):
    first = sync_run.probes()[0]  # vLLM after step 1's sync
    initial, _, _ = teacher_forced(sync_run.assets / "actor", first)
    assert (initial - torch.tensor(first["logprobs"])).abs().max() > logprob_atol
    for trained, init in ((sync_run.root / "model", sync_run.assets / "actor"),
                          (sync_run.root / "model_critic", sync_run.assets / "reward")):
        after, before = _state(trained), _state(init)
        assert after.keys() == before.keys()
        assert any(not torch.equal(after[k], before[k]) for k in after), f"{trained.name} unchanged"
