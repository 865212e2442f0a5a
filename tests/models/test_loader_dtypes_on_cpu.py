"""An OpenRLHF-layout reward model loads with OpenRLHF's own dtypes: parameters in the asked
dtype, buffers as transformers builds them (rotary `inv_freq` in fp32, mean/std in the asked
dtype), so on a long sequence its bf16 rewards, one-shot and streamed, are OpenRLHF's.

The ground truth is OpenRLHF 0.11.2's `get_llm_for_sequence_regression(param_dtype="bf16")`
on the saved directory. A bf16 `inv_freq` turns each rotary angle by up to 2**-9 of itself,
about 0.4 rad at position 2,000 for this model's second frequency."""

from __future__ import annotations

import pytest
import torch

from openrlhf_oppo.models import StreamingRewardScorer, load_critic_model, load_reward_model, save_openrlhf_value_model

LONG_TOKENS = 3000
BF16_EPS = torch.finfo(torch.bfloat16).eps
ULPS = 8  # as tests/models/test_streaming_gpu.py: a chunked forward rounds in another order


def _openrlhf_loader():
    from openrlhf_oppo import compat

    compat.apply()  # openrlhf's model module imports flash_attn at top level
    try:
        from openrlhf.models.model import get_llm_for_sequence_regression
    except Exception as exc:  # noqa: BLE001 - any import failure of the optional ground truth
        pytest.skip(f"openrlhf.models.model does not import here: {exc}")
    return get_llm_for_sequence_regression


def _sharp_reward_model(tiny, kind: str = "reward", seed: int = 8):
    """The tiny OpenRLHF-layout model with q/k weights of std 0.4: its attention reads positions
    sharply, as a trained model's does (at the default init a rotary error hardly shows)."""
    model = tiny.openrlhf_model(kind, seed=seed, normalize=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, 0.4)
            layer.self_attn.k_proj.weight.normal_(0.0, 0.4)
    return model


@pytest.mark.parametrize("kind", ["reward", "critic"])
def test_buffers_load_in_the_dtypes_of_openrlhfs_own_bf16_model(tiny, tmp_path, kind):
    get_llm_for_sequence_regression = _openrlhf_loader()
    save_openrlhf_value_model(tiny.openrlhf_model(kind, seed=3, normalize=True, mean=0.5, std=2.0), tmp_path)
    theirs = get_llm_for_sequence_regression(str(tmp_path), kind, param_dtype="bf16", normalize_reward=True,
                                             attn_implementation="sdpa")
    load = load_reward_model if kind == "reward" else load_critic_model
    ours = load(tmp_path, normalize_reward=True, dtype=torch.bfloat16)
    want = {name: b.dtype for name, b in theirs.named_buffers()}
    assert want["model.rotary_emb.inv_freq"] == torch.float32  # what the comparison is about
    assert {name: b.dtype for name, b in ours.named_buffers()} == want
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert float(ours.mean[0]) == 0.5 and float(ours.std[0]) == 2.0


def test_bf16_rewards_at_3k_tokens_are_openrlhfs_one_shot_and_streamed(tiny, tmp_path):
    get_llm_for_sequence_regression = _openrlhf_loader()
    save_openrlhf_value_model(_sharp_reward_model(tiny), tmp_path)
    theirs = get_llm_for_sequence_regression(str(tmp_path), "reward", param_dtype="bf16",
                                             attn_implementation="sdpa").eval()
    ours = load_reward_model(tmp_path, dtype=torch.bfloat16)
    ids = torch.randint(1, 97, (4, LONG_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(ids, attention_mask=torch.ones_like(ids)).float()
        one_shot = ours(ids).float()
    tol = ULPS * BF16_EPS * want.abs().clamp(min=1.0)
    assert ((one_shot - want).abs() <= tol).all(), (one_shot - want).abs().max()

    scorer = StreamingRewardScorer(ours, max_batch_tokens=8192)
    prompt_tokens, chunk_tokens = 16, 512
    for i in range(len(ids)):
        scorer.open(i, ids[i, :prompt_tokens].tolist())
    last = LONG_TOKENS - chunk_tokens
    for lo in range(prompt_tokens, last, chunk_tokens):
        scorer.extend_many({i: ids[i, lo:min(lo + chunk_tokens, last)].tolist() for i in range(len(ids))})
    streamed = scorer.finish_many({i: ids[i, last:].tolist() for i in range(len(ids))})
    got = torch.tensor([streamed[i] for i in range(len(ids))])
    assert ((got - want).abs() <= tol).all(), (got - want).abs().max()
