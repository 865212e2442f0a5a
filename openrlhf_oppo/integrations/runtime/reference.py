"""Streamed reference log-probs in place of OpenRLHF's reference forward.

With `--oppo.streaming.reference true` the streaming reference actors (`scorer.
StreamingReferenceModelActor`, in OpenRLHF's reference group) prefill each sample's chunks
while it decodes and return, when it finishes, the log-probability of every response token
(the first from the prompt's last position). A sample is complete, and can be trained, only
once they have, so every trained sample has them. The generator keeps them by the sample's
tokens (`key`, `action_logprobs`); `streamed_reference_forward` hands them to OpenRLHF 0.11.2's
`make_experience`, in the rows its reference group's `forward` would return, in place of that
forward: the KL, the KL loss and `logprobs_diff` are then OpenRLHF's own arithmetic on them.

Rows are found by the sample's tokens (prompt and response, as the experience holds them):
the reference is frozen, so equal tokens have equal log-probs, and OpenRLHF may batch,
split or reorder the samples between the generator and `make_experience` as it likes.
"""

from __future__ import annotations

import ray
import torch

__all__ = ["action_logprobs", "keep", "key", "rows_for", "streamed_reference_forward"]


def key(sequence: torch.Tensor, attention_mask: torch.Tensor) -> tuple[int, ...]:
    """A sample's tokens, prompt and response, as its experience holds them."""
    return tuple(sequence[attention_mask.bool()].tolist())


def action_logprobs(action_mask: torch.Tensor, logprobs: list[float]) -> torch.Tensor:
    """The streamed log-probs of a sample's action tokens (its response, truncated as OpenRLHF
    truncated it to `--rollout.max_len`: the first ones)."""
    n = int(action_mask.sum())
    if n > len(logprobs):
        raise ValueError(f"the streamed reference has {len(logprobs)} log-probs for a sample with {n} action tokens")
    return torch.tensor(logprobs[:n], dtype=torch.float32)


def keep(streamed: dict[tuple[int, ...], torch.Tensor], experience, logprobs: list[float]) -> None:
    """Keep one sample's streamed log-probs (`logprobs`, every response token's) for its
    single-sample OpenRLHF `experience`."""
    streamed[key(experience.sequences[0], experience.attention_mask[0])] = \
        action_logprobs(experience.action_mask[0], logprobs)


def rows_for(streamed: dict[tuple[int, ...], torch.Tensor], sequences: torch.Tensor, attention_mask: torch.Tensor,
             action_mask: torch.Tensor) -> torch.Tensor:
    """The reference log-probs of one of OpenRLHF's micro-batches (`sequences` [b, T],
    `action_mask` [b, A]) as its reference `Actor.forward` returns them (`log_probs[:, -A:] *
    action_mask`): each sample's streamed log-probs where its action mask is set, 0 elsewhere."""
    out = torch.zeros(action_mask.shape, dtype=torch.float32)
    for i in range(sequences.shape[0]):
        values = streamed.get(key(sequences[i], attention_mask[i]))
        where = action_mask[i].bool()
        if values is None or values.numel() != int(where.sum()):
            raise RuntimeError(f"OPPO: row {i} of a micro-batch ({int(attention_mask[i].sum())} tokens, "
                               f"{int(where.sum())} action tokens) has no streamed reference log-probs; "
                               f"every trained sample should")
        out[i, where] = values
    return out


def streamed_reference_forward(maker, streamed: dict[tuple[int, ...], torch.Tensor]) -> None:
    """Make OpenRLHF's experience `maker` take the reference log-probs from `streamed` (key ->
    action log-probs, refilled by the generator for each batch) instead of dispatching its
    reference group's `forward`; every other group's forward is OpenRLHF's own."""
    dispatch = maker._dispatch_forward

    def dispatch_forward(group, sync_condition, **kwargs):
        if group is None or group is not maker.initial_model_group:
            return dispatch(group, sync_condition, **kwargs)
        rows = [rows_for(streamed, s, a, m)
                for s, a, m in zip(kwargs["sequences"], kwargs["attention_mask"], kwargs["action_mask"])]
        args = maker.strategy.args
        # `_flatten_results` keeps every `duplicate_factor`-th result (ring-attention / TP copies)
        return [ray.put(rows)] * (args.ds.ring_attn_size * args.ds.tensor_parallel_size)

    maker._dispatch_forward = dispatch_forward
