"""The tiny model and PPO batch the Megatron backend's tests share (one factory for them all).

The batch exercises what a PPO batch holds: left-padded prompts, a response padded on the right
(action mask 0), two micro-batches of different lengths (gradient accumulation; the pipeline
left-pads them to one length), old and reference log-probs off the current ones, advantages of
both signs, every tensor on the CPU as OpenRLHF hands them over. The model: grouped-query
attention (4 heads, 2 key/value heads) with Qwen2's q/k/v bias, untied embeddings, fp32.
"""

from __future__ import annotations

import pytest
import torch


def make_case():
    from openrlhf_oppo import compat
    from openrlhf_oppo.compat import flash_attn_standin

    compat.apply()
    flash_attn_standin.install()  # OpenRLHF's models import flash_attn; a GPU host may lack it (compat is CPU-only)
    from openrlhf.models import Actor
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_oppo.megatron import equivalence
    from openrlhf_oppo.megatron.engine import MicroBatch, Settings

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(cfg).float()
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    actor = Actor(hf)
    actor.packing_samples = False
    batches = []
    for length, actions in ((12, 5), (9, 4)):
        seq = torch.randint(1, 64, (2, length))
        mask = torch.ones(2, length, dtype=torch.long)
        mask[0, :2], seq[0, :2] = 0, 0  # a left-padded prompt
        mask[1, -1], seq[1, -1] = 0, 0  # a response that ended early
        action_mask = torch.ones(2, actions, dtype=torch.bool)
        action_mask[1, -1] = False
        mb = MicroBatch(seq, mask, action_mask)
        with torch.no_grad():
            lp = actor(seq, action_mask, attention_mask=mask)
        mb.old_log_probs = (lp + 0.1 * torch.randn_like(lp)) * action_mask
        mb.base_log_probs = (lp + 0.1 * torch.randn_like(lp)) * action_mask
        mb.advantages = torch.randn_like(lp) * action_mask
        batches.append(mb)
    return equivalence.Case(cfg, state, batches, Settings(lr=1e-2, kl_coef=0.01))


@pytest.fixture(scope="session")
def megatron_case():
    """The shared case (`make_case`); tests derive variants with `dataclasses.replace`, never mutate it."""
    return make_case()
