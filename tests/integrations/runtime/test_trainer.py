"""What OPPO's trainer (`integrations.runtime.trainer`) says at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from openrlhf_oppo.integrations.runtime.trainer import admission_warnings


@pytest.mark.parametrize("lag, colocate_all, async_enable, said", [
    (0, True, False, []),
    (2, False, True, []),
    (2, True, True, []),  # OpenRLHF's async layout: vLLM on its own GPUs
    (1, True, False, ["share the training GPUs"]),
    (3, False, True, ["a bound of 3 leaned below sync"]),
    (4, True, False, ["share the training GPUs", "a bound of 3 leaned below sync"]),
])
def test_start_up_warns_of_shared_gpus_and_of_a_lag_bound_beyond_what_learned_as_sync(lag, colocate_all,
                                                                                       async_enable, said):
    args = SimpleNamespace(train=SimpleNamespace(colocate_all=colocate_all, async_enable=async_enable))
    messages = admission_warnings(lag, args)
    assert len(messages) == len(said)
    for message, part in zip(messages, said, strict=True):
        assert message.startswith(f"OPPO: --oppo.staleness.max_policy_lag {lag}") and part in message
