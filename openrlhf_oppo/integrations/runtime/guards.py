"""Fail a step loudly instead of training on broken numbers.

OpenRLHF trains on whatever its forwards return: a NaN value, reward or log-prob
becomes a NaN loss and, when a micro-batch holds no response token, a
``ZeroDivisionError`` deep in ``ppo_train``. These checks run on the driver between
OpenRLHF's experience making and its PPO update (and on the losses after it), and
name the step and the samples.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# per-token fields, checked where the action mask is set; per-sample fields, checked whole
TOKEN_FIELDS = (
    "action_log_probs", "base_action_log_probs", "rollout_log_probs", "values", "returns", "advantages", "kl",
)
SAMPLE_FIELDS = ("rewards",)


class NonFiniteError(FloatingPointError):
    """A step's batch or losses hold NaN/inf, or a sample has no response token."""


def check_experiences(experiences: Sequence, step: int, sample_ids: Sequence[int] | None) -> None:
    """Raise `NonFiniteError` naming every bad sample of the step's experiences.

    ``sample_ids``: the batch's sample ids in rollout order; row r of an experience is sample
    ``sample_ids[exp.index[r]]`` (OpenRLHF's `index`: each row's position in the rollout order,
    whatever micro-batch it was put in), otherwise rows are named by position."""
    problems: list[str] = []
    for k, exp in enumerate(experiences):
        mask = exp.action_mask.bool() if exp.action_mask is not None else None

        def who(row: int, k: int = k, index: Sequence[int] | None = getattr(exp, "index", None)) -> str:
            if sample_ids is not None and index is not None and row < len(index) and index[row] < len(sample_ids):
                return f"sample {sample_ids[index[row]]}"
            return f"micro-batch {k} row {row}"

        if mask is not None:
            for row in (mask.reshape(mask.shape[0], -1).sum(-1) == 0).nonzero().flatten().tolist():
                problems.append(f"{who(row)} has no response token")
        for name in TOKEN_FIELDS + SAMPLE_FIELDS:
            t = getattr(exp, name, None)
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                continue
            bad = ~torch.isfinite(t.float())
            if name in TOKEN_FIELDS and mask is not None and bad.shape == mask.shape:
                bad &= mask
            for row in bad.reshape(bad.shape[0], -1).any(-1).nonzero().flatten().tolist():
                problems.append(f"{name} of {who(row)} is not finite")
    if problems:
        shown = "; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise NonFiniteError(f"OPPO step {step}: the batch is not trained: {shown}")


def check_losses(status: dict, step: int) -> None:
    bad = {k: v for k, v in status.items() if "loss" in k and isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise NonFiniteError(f"OPPO step {step}: PPO update produced non-finite losses {bad}; "
                             "the last checkpoint is intact (nothing was saved after this update)")
