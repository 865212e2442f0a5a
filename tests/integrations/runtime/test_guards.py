"""The step guard between OpenRLHF's experience making and its PPO update: NaN/inf
values, rewards, log-probs and losses, and responses without tokens, fail the step
with its number and the samples, instead of being trained on."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from openrlhf_oppo.integrations.runtime.guards import NonFiniteError, check_experiences, check_losses


def experience(values, mask, rewards, index=None):
    """`index`: OpenRLHF's, each row's position in the batch's rollout order."""
    mask = torch.tensor(mask, dtype=torch.bool)
    return SimpleNamespace(action_mask=mask, values=torch.tensor(values), rewards=torch.tensor(rewards),
                           action_log_probs=torch.zeros(mask.shape), advantages=None, index=index)


def test_a_clean_batch_passes_and_nan_behind_the_mask_is_ignored():
    exp = experience([[0.1, math.nan], [0.2, 0.3]], [[1, 0], [1, 1]], [0.5, -0.5])
    check_experiences([exp], step=3, sample_ids=[10, 11])


def test_nan_values_rewards_and_empty_responses_name_the_step_and_samples():
    """Rows are named by OpenRLHF's `index` (micro-batches cut by length hold samples out of rollout order)."""
    first = experience([[0.1, 0.2], [math.nan, 0.3]], [[1, 1], [1, 1]], [0.5, 0.5], index=[3, 1])
    second = experience([[0.1, 0.2], [0.1, 0.2]], [[0, 0], [1, 1]], [math.inf, 0.0], index=[2, 0])
    with pytest.raises(NonFiniteError) as err:
        check_experiences([first, second], step=7, sample_ids=[20, 21, 22, 23])
    text = str(err.value)
    assert text.startswith("OPPO step 7: the batch is not trained")
    assert "values of sample 21 is not finite" in text
    assert "sample 22 has no response token" in text and "rewards of sample 22 is not finite" in text
    with pytest.raises(NonFiniteError, match="values of micro-batch 0 row 1"):  # no index: rows by position
        check_experiences([experience([[0.1], [math.nan]], [[1], [1]], [0.5, 0.5])], step=7, sample_ids=[20, 21])


def test_non_finite_losses_fail_the_step():
    check_losses({"policy_loss": 0.1, "critic_loss": 0.2, "kl": math.nan}, step=1)
    with pytest.raises(NonFiniteError, match=r"OPPO step 4: .*critic_loss"):
        check_losses({"policy_loss": 0.1, "critic_loss": math.nan}, step=4)
