"""Crash injection with real Ray (`openrlhf_oppo.integrations.faults`), end to end on CPU.

One OPPO run checkpoints every step; its streaming reward actor is killed in the middle
of step 1 (Ray restarts it; the driver re-prefills its held samples from their
recorded tokens) and its trainer is killed right after step 2's checkpoint. A second
run resumes from that checkpoint into the same run directory. The ledger check then
proves every prompt group was trained exactly once or is still held."""

from __future__ import annotations

import json

from openrlhf_oppo.core import ledger


def test_killed_reward_actor_and_driver_resume_and_the_ledger_holds(train_runs, tmp_path_factory, monkeypatch):
    root = tmp_path_factory.mktemp("faults")
    flags = ("--ckpt.save_steps", "1", "--data.max_samples", "16")
    monkeypatch.setenv("OPPO_FAULTS", "reward@1,driver@2")
    killed = train_runs("oppo", *flags, output=root)
    assert killed.returncode != 0, "the trainer was to be killed after step 2"
    metrics = [json.loads(line) for line in (root / "oppo_metrics.jsonl").read_text().splitlines()]
    assert [m["oppo/scorer_restarts"] for m in metrics] == [0.0, 1.0, 0.0], "the reward actor kill did not happen"
    monkeypatch.delenv("OPPO_FAULTS")

    resumed = train_runs("oppo", *flags, "--ckpt.load_enable", output=root)
    assert resumed.returncode == 0, f"see {root}"
    report = ledger.check_run(root)
    assert report.ok, report.summary()
    assert report.restarts == 1 and report.checkpoints[:3] == [0, 1, 2]
    assert report.last_step >= 3 and report.trained == 4 * (report.last_step + 1)  # B = 4 groups a step
