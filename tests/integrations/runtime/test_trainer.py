"""What OPPO's trainer (`integrations.runtime.trainer`) says at start-up."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from openrlhf_oppo.config import ASYNC_POLICY_LAG
from openrlhf_oppo.integrations.runtime.trainer import admission_warnings


@pytest.mark.parametrize("lag, colocate_all, async_enable, said", [
    (0, True, False, []),
    (2, False, True, []),
    (2, True, True, []),  # OpenRLHF's async layout: vLLM on its own GPUs
    (1, True, False, ["share the training GPUs"]),
    (3, False, True, [f"use --oppo.staleness.max_policy_lag {ASYNC_POLICY_LAG}"]),
    (4, True, False, ["share the training GPUs", f"use --oppo.staleness.max_policy_lag {ASYNC_POLICY_LAG}"]),
])
def test_start_up_warns_of_shared_gpus_and_of_a_lag_bound_above_the_async_schedules(lag, colocate_all,
                                                                                     async_enable, said):
    args = SimpleNamespace(train=SimpleNamespace(colocate_all=colocate_all, async_enable=async_enable))
    messages = admission_warnings(lag, args)
    assert len(messages) == len(said)
    for message, part in zip(messages, said, strict=True):
        assert message.startswith(f"OPPO: --oppo.staleness.max_policy_lag {lag}") and part in message
    if lag > ASYNC_POLICY_LAG:  # the figures behind the advice live on the evidence page
        assert messages[-1].endswith("(docs/evidence.md#policy-lag)")
