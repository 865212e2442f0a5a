"""`openrlhf-oppo train` input errors: one line naming the flag or file, exit 2,
before anything heavy starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_oppo.cli.main import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--schedule", "fast", "--config", CONFIG], "--schedule: unknown schedule 'fast'; allowed: sync, async"),
        (["--schedule", "oppo", "--config", CONFIG, "--", "--train.async_enable"],
         "--train.async_enable cannot be combined with OPPO"),
        (["--schedule", "oppo", "--config", CONFIG, "--", "--vllm.enable_prefix_caching"],
         "--vllm.enable_prefix_caching cannot be combined with --oppo.staleness.keep_kv_cache true"),
        (["--schedule", "sync", "--config", "missing.yaml"], "--config: file not found: missing.yaml"),
    ],
)
def test_bad_input_is_one_line_naming_what_is_wrong(capsys, argv, expected):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err


def test_unknown_yaml_key_names_file_and_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: {batchsize: 4}\n")
    assert main(["train", "--schedule", "sync", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad.yaml: unknown key 'rollout.batchsize'" in err


def test_the_closing_summary_reads_the_runs_tensorboard(tmp_path):
    """Steps, the reward at the first and the last step, the mean step time after the first
    (from the steps' wall times: 10 s, then 4 s and 6 s), and where the outputs are."""
    from torch.utils.tensorboard import SummaryWriter

    from openrlhf_oppo.bench.schedules import STEP_TAG
    from openrlhf_oppo.cli.train import REWARD_TAG, summary

    assert summary(tmp_path) == []  # nothing logged: nothing to sum up
    writer = SummaryWriter(str(tmp_path / "tensorboard"))
    for step, (wall, reward) in enumerate([(100.0, -0.25), (110.0, 0.5), (114.0, 0.75), (120.0, 1.0)], start=1):
        writer.add_scalar(STEP_TAG, 0.0, step, walltime=wall)
        writer.add_scalar(REWARD_TAG, reward, step, walltime=wall)
    writer.close()
    assert summary(tmp_path) == [
        "4 steps; reward -0.250 at the first, +1.000 at the last (train/reward); 6.7 s a step after the first",
        f"outputs in {tmp_path}: train.log, tensorboard/, timeline/ (openrlhf-oppo plot timeline {tmp_path})",
    ]
