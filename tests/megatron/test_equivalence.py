"""One PPO step by the Megatron backend (TP = 1, TP = 2, PP = 2 on gloo processes) against the
same step as OpenRLHF's actor computes it (`openrlhf.models.Actor`, `PolicyLoss`, the KL loss,
gradient clipping, AdamW), from the same weights and batch: action log-probs before the step,
the loss, the gradient norm, the log-probs after the step, and the weights after it gathered
back under Hugging Face names (what the weight sync into vLLM and the export send).

The model and batch: `conftest.make_case` (a tiny Qwen2, a PPO batch of two micro-batches).
"""

from __future__ import annotations

import socket

import pytest
import torch

TOL_LOGPROBS = 1e-5  # fp32, a 2-layer model: the two backends sum in different orders
TOL_AFTER = 1e-5  # after one Adam step of lr 1e-2 (which moves the log-probs by ~0.5)
TOL_WEIGHTS = 1e-4  # 1 % of the step: Adam's first step is lr * g / (|g| + eps), near lr * sign(g),
# so a weight whose gradient is near eps moves by a share of lr that rounding decides
TOL_REL = 1e-5  # loss and gradient norm, relative (fp32 sums of ~100 terms)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def case_and_reference(megatron_case):
    from openrlhf_oppo.megatron import equivalence

    return megatron_case, equivalence.reference_step(megatron_case)


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


# TP = 1 and DP = 2 are `slow` (left out of CI's run for time, ~30 s; `-m slow` runs them): TP = 2
# and PP = 2 exercise the same mapping, and the distributed optimizer, sharded
SLOW = pytest.mark.slow


@pytest.mark.parametrize(("tp", "pp", "dp"), [pytest.param(1, 1, 1, marks=SLOW), (2, 1, 1), (1, 2, 1),
                                              pytest.param(1, 1, 2, marks=SLOW)],
                         ids=["tp1", "tp2", "pp2", "dp2"])
def test_one_ppo_step_equals_openrlhfs_actor(case_and_reference, tp, pp, dp):
    from openrlhf_oppo.megatron import equivalence, export
    from openrlhf_oppo.megatron.model import Shape

    case, ref = case_and_reference
    got = equivalence.megatron_step(case, tp, pp, port=_free_port(), dp=dp)
    assert _max_diff(ref["before"], ref["after"]) > 100 * TOL_AFTER  # the step moved the policy
    assert _max_diff(got["before"], ref["before"]) < TOL_LOGPROBS
    assert got["loss"] == pytest.approx(ref["loss"], rel=TOL_REL)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL_REL)
    assert ref["grad_norm"] > case.settings.clip_grad  # clipping was applied on both sides
    assert _max_diff(got["after"], ref["after"]) < TOL_AFTER
    # the weights under Hugging Face names, gathered from the shards (what the vLLM sync and the
    # export send): the loaded ones exactly, and the updated ones as OpenRLHF's step left them
    assert got["loaded"].keys() == case.hf_state.keys() == got["weights"].keys()
    assert len(got["loaded"]) == export.weight_count(Shape.of(case.hf_config))  # the GPU sync's count
    assert all(torch.equal(got["loaded"][k], case.hf_state[k]) for k in case.hf_state)
    assert max((got["weights"][k] - ref["weights"][k]).abs().max().item() for k in case.hf_state) < TOL_WEIGHTS
    assert min((ref["weights"][k] - case.hf_state[k]).abs().max().item() for k in case.hf_state) > 10 * TOL_WEIGHTS


def test_a_resumed_run_takes_the_step_an_unbroken_one_takes(case_and_reference, tmp_path):
    """TP = 2: one step, a checkpoint, new processes that load it, a second step: the same
    log-probs as two steps in one run (the Adam moments and step count came back; without
    them the second step would differ)."""
    from openrlhf_oppo.megatron import equivalence

    case, _ = case_and_reference
    out = equivalence.resumed_vs_straight(case, 2, 1, str(tmp_path / "ckpt"), port=_free_port())
    assert _max_diff(out["resumed"], out["straight"]) < 1e-6
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir())[:3] == ["layout.json", "model_tp0_pp0.pt",
                                                                         "model_tp1_pp0.pt"]


def test_the_importance_sampling_correction_is_openrlhfs(case_and_reference):
    """TP = 2 with OpenRLHF's token-level TIS (what `--oppo.staleness.correction tis` sets):
    the rollout log-probs (vLLM's) reach the loss, whose value the correction changes."""
    import dataclasses

    from openrlhf_oppo.megatron import equivalence

    case, plain = case_and_reference
    tis = dict(is_correction_level="token", is_correction_mode="clip", is_correction_threshold=[0.5, 1.05])
    batches = [dataclasses.replace(mb, rollout_log_probs=mb.old_log_probs - 0.3 * mb.action_mask)
               for mb in case.batches]
    corrected = equivalence.Case(case.hf_config, case.hf_state, batches,
                                 dataclasses.replace(case.settings, loss_kwargs=tis))
    ref = equivalence.reference_step(corrected)
    got = equivalence.megatron_step(corrected, 2, 1, port=_free_port())
    assert abs(ref["loss"] - plain["loss"]) > 100 * TOL_REL * abs(plain["loss"])  # the correction acted
    assert got["loss"] == pytest.approx(ref["loss"], rel=TOL_REL)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=TOL_REL)
    assert _max_diff(got["after"], ref["after"]) < TOL_AFTER


def test_in_bf16_the_step_stays_within_bf16s_own_rounding(case_and_reference):
    """TP = 2 in bf16 (Megatron's bf16 path: bf16 weights, fp32 main weights and gradient
    reduction in the distributed optimizer) against the fp32 step. The floor is how far the
    same step in plain-torch bf16 lands from fp32; the Megatron step must stay within twice it."""
    import dataclasses

    from openrlhf_oppo.megatron import equivalence

    case, ref = case_and_reference
    bf16 = equivalence.Case(case.hf_config, case.hf_state, case.batches,
                            dataclasses.replace(case.settings, dtype=torch.bfloat16))
    floor = equivalence.reference_step(bf16)
    got = equivalence.megatron_step(bf16, 2, 1, port=_free_port())
    assert 0 < _max_diff(got["before"], ref["before"]) <= 2 * _max_diff(floor["before"], ref["before"])
    assert _max_diff(got["after"], ref["after"]) <= 2 * _max_diff(floor["after"], ref["after"])
    assert got["loss"] == pytest.approx(ref["loss"], rel=2 * abs(floor["loss"] / ref["loss"] - 1))
    assert all(t.dtype == torch.bfloat16 for t in got["weights"].values())
