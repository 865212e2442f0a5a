"""OpenRLHF 0.11.2's async modes end to end on CPU: `--schedule async` (rollout
queue), `partial` (vLLM pause/resume across weight sync) and `oversample`. The `slow`
tier (`python -m pytest tests -m slow`): left out of CI's run for time."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

SHORT_RUN = ("--data.max_samples", "8")  # 2 steps: start-up dominates the cost anyway


@pytest.mark.slow
def test_async_train_completes_and_syncs_weights_into_vllm(train_runs):
    run = train_runs("async")
    assert run.returncode == 0, run.failure()
    probes = run.probes()
    assert len(probes) == 4
    assert probes[0]["logprobs"] != probes[-1]["logprobs"]
    assert (run.root / "model" / "model.safetensors").exists()


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["partial", "oversample"])
def test_partial_rollout_and_oversampling_complete(train_runs, schedule):
    run = train_runs(schedule, *SHORT_RUN)
    assert run.returncode == 0, run.failure()
    assert len(run.probes()) >= 1
