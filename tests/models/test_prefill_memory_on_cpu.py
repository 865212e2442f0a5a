"""What a streaming scorer keeps alive, and what it does when the device runs out of memory:
the last hidden state is a copy (not a view pinning the chunk's hidden states), and a device
out-of-memory in a forward evicts the other caches and runs again, with the same results."""

from __future__ import annotations

import pytest
import torch

from openrlhf_oppo.models import StreamingRewardScorer
from openrlhf_oppo.models.device_memory import OutOfMemoryError

PROMPTS = {0: [5, 6, 7], 1: [1, 2], 2: [40, 41, 42, 43], 3: [30, 31]}
CHUNKS = {0: [8, 9, 10], 1: [3, 4, 5, 6], 2: [44], 3: [32, 33, 34]}
LAST = {0: [11, 12], 1: [7], 2: [45, 46, 47]}  # 3 finishes later: its cache is the one evicted


@torch.no_grad()
def one_shot(model, ids: list[int]) -> float:
    out = model(torch.tensor([ids]))
    return float(out.logits[0, 0] if hasattr(out, "logits") else out[0])


def fail_forwards(backbone, monkeypatch, when):
    """The backbone's forward raises a device out-of-memory while `when(batch_size)` holds."""
    real = backbone.forward
    failures = []

    def forward(*args, **kwargs):
        batch = kwargs["input_ids"].shape[0]
        if when(batch):
            failures.append(batch)
            raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(backbone, "forward", forward)
    return failures


def test_the_last_hidden_state_is_a_copy_not_a_view_of_the_chunk(hf_reward_model):
    scorer = StreamingRewardScorer(hf_reward_model)
    scorer.open(0, [5, 6, 7])
    scorer.extend(0, list(range(10, 40)))
    last = scorer._engine._seqs[0].last_hidden
    hidden_size = hf_reward_model.config.hidden_size
    assert last.shape == (hidden_size,)
    assert last.untyped_storage().nbytes() == hidden_size * last.element_size()  # not the (33, H) chunk


def test_an_out_of_memory_in_a_forward_evicts_and_retries_with_the_same_rewards(hf_reward_model, monkeypatch):
    want = {seq_id: one_shot(hf_reward_model, prompt + CHUNKS[seq_id] + LAST.get(seq_id, [35]))
            for seq_id, prompt in PROMPTS.items()}
    scorer = StreamingRewardScorer(hf_reward_model)
    for seq_id, prompt in PROMPTS.items():
        scorer.open(seq_id, prompt)
    scorer.extend_many(CHUNKS)
    failures = fail_forwards(scorer.parts.backbone, monkeypatch, lambda batch: batch > 1)
    got = scorer.finish_many(LAST)
    assert failures == [3, 2]  # the whole batch, then its first half; halves of one sequence fit
    stats = scorer.stats()
    assert stats.oom_retries == 2 and stats.evictions == 1 and stats.cached_tokens == 0
    got |= scorer.finish_many({3: [35]})  # re-prefilled from its recorded tokens
    assert scorer.stats().reprefilled_tokens == len(PROMPTS[3] + CHUNKS[3])
    assert max(abs(got[s] - want[s]) for s in PROMPTS) <= 1e-4


def test_a_lone_sequence_that_never_fits_re_raises_the_out_of_memory(hf_reward_model, monkeypatch):
    scorer = StreamingRewardScorer(hf_reward_model)
    scorer.open(0, [5, 6, 7])
    fail_forwards(scorer.parts.backbone, monkeypatch, lambda batch: True)
    with pytest.raises(OutOfMemoryError):
        scorer.extend(0, [8, 9])
