"""On a CUDA GPU in bf16, at 4K tokens: the reward-model loader's rewards for an OpenRLHF-layout
checkpoint, one-shot and streamed, are OpenRLHF's own reward model's, within a few bf16 steps.

The model is built in code (random weights, a Qwen2 shape of 8 layers x 1,024 hidden, ~95M
parameters) with q/k weights large enough that attention reads positions sharply, as a trained
model's does: a rotary error (a bf16 `inv_freq`, tenths of a radian by position 2,000) then moves
the reward by more than the tolerance (`test_loader_dtypes_on_cpu.py` shows it on a tiny model).

The ground truth is OpenRLHF 0.11.2's `get_llm_for_sequence_regression(param_dtype="bf16")` where
`openrlhf.models.model` imports (it imports deepspeed, peft and flash_attn at top level). On a
machine with torch, transformers and OpenRLHF's wheel alone it does not, and the truth is the
transformers model OpenRLHF's reward model wraps, loaded as its `from_pretrained` loads it (the
base decoder by transformers in bf16, which keeps `inv_freq` in fp32), with OpenRLHF's head
applied as its forward applies it (the last token's hidden state, no padding). The test prints
which one it compared against. Needs accelerate (the loader builds on the meta device).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config

from openrlhf_oppo.models import (
    OpenRLHFRewardModel,
    StreamingRewardScorer,
    load_reward_model,
    save_openrlhf_value_model,
)

pytestmark = pytest.mark.gpu
LONG_TOKENS = 4096
SEQUENCES = 2
BF16_EPS = torch.finfo(torch.bfloat16).eps
ULPS = 8  # as test_streaming_gpu.py: a chunked forward rounds in another order than a one-shot one


def _checkpoint(path) -> None:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                         tie_word_embeddings=False)
    config.mean, config.std = 0.0, 1.0
    model = OpenRLHFRewardModel(config, value_head_prefix="score", attn_implementation="sdpa")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.normal_(0.0, 0.08)
            layer.self_attn.k_proj.weight.normal_(0.0, 0.08)
        model.score.weight.normal_(0.0, 0.25)
    save_openrlhf_value_model(model.to(torch.bfloat16), path)  # bf16 on disk, as OpenRLHF saves it


def _openrlhf_rewards(path, ids: torch.Tensor) -> tuple[torch.Tensor, str]:
    """(rewards (B,) as float32 on the CPU, which ground truth gave them): see the module doc."""
    try:
        from openrlhf.models.model import get_llm_for_sequence_regression
    except ImportError as exc:
        truth = f"the transformers model OpenRLHF's reward model wraps (openrlhf.models.model: {exc})"
        return _wrapped_transformers_rewards(path, ids), truth
    model = get_llm_for_sequence_regression(str(path), "reward", param_dtype="bf16", attn_implementation="sdpa")
    model = model.to("cuda").eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        rewards = model(ids, attention_mask=torch.ones_like(ids))
    return rewards.float().cpu(), "openrlhf.models.model.get_llm_for_sequence_regression"


def _wrapped_transformers_rewards(path, ids: torch.Tensor) -> torch.Tensor:
    from safetensors.torch import load_file
    from transformers import AutoModel

    base = AutoModel.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa").to("cuda").eval()
    assert base.rotary_emb.inv_freq.dtype == torch.float32
    head = load_file(str(path / "model.safetensors"))["score.weight"].to("cuda", torch.bfloat16)
    with torch.no_grad():
        hidden = base(ids).last_hidden_state  # (B, T, H); position ids 0..T-1, as OpenRLHF's from a full mask
        return torch.nn.functional.linear(hidden[:, -1], head).squeeze(-1).float().cpu()


def test_the_loaders_bf16_rewards_at_4k_tokens_are_openrlhfs_on_cuda(tmp_path):
    _checkpoint(tmp_path)
    ids = torch.randint(1, 8192, (SEQUENCES, LONG_TOKENS), generator=torch.Generator().manual_seed(1)).to("cuda")
    want, truth = _openrlhf_rewards(tmp_path, ids)
    print(f"ground truth: {truth}")
    ours = load_reward_model(tmp_path, dtype=torch.bfloat16).to("cuda")
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    tol = ULPS * BF16_EPS * want.abs().clamp(min=1.0)
    with torch.no_grad():
        one_shot = ours(ids).float().cpu()
    assert ((one_shot - want).abs() <= tol).all(), (one_shot, want)

    scorer = StreamingRewardScorer(ours, max_batch_tokens=16384)
    prompt_tokens, chunk_tokens = 128, 512
    rows = ids.cpu().tolist()
    for i, row in enumerate(rows):
        scorer.open(i, row[:prompt_tokens])
    last = LONG_TOKENS - chunk_tokens
    for lo in range(prompt_tokens, last, chunk_tokens):
        scorer.extend_many({i: row[lo:min(lo + chunk_tokens, last)] for i, row in enumerate(rows)})
    streamed = scorer.finish_many({i: row[last:] for i, row in enumerate(rows)})
    got = torch.tensor([streamed[i] for i in range(SEQUENCES)])
    assert ((got - want).abs() <= tol).all(), (got, want)
