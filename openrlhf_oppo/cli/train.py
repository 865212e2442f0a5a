"""`openrlhf-oppo train --schedule sync --config configs/tiny-cpu.yaml [-- extra OpenRLHF flags]`

The CLI over openrlhf_oppo.integrations.launch.train_run (flags, task defaults, input
checks, launching with restarts); `run` is its. `main` runs it and closes with a summary of
what the run logged: steps, the reward from the first step to the last, the mean time a step,
and where the outputs are.
"""

from __future__ import annotations

from pathlib import Path

from openrlhf_oppo.integrations.launch.train_run import run

__all__ = ["main", "run", "summary"]

REWARD_TAG = "train/reward"  # OpenRLHF's mean reward of the trained batch, one value a step


def main(argv: list[str]) -> int:
    result = run(argv)
    for line in summary(result.paths.root):
        print(f"openrlhf-oppo train: {line}", flush=True)
    return result.returncode


def summary(root: Path) -> list[str]:
    """The closing lines of a run directory (none when it logged no step)."""
    from openrlhf_oppo.bench.schedules import summarize_run, tensorboard_scalars

    scalars = tensorboard_scalars(root / "tensorboard") if (root / "tensorboard").is_dir() else {}
    rewards = [v for _, _, v in scalars.get(REWARD_TAG, [])]
    if not rewards:
        return []
    mean_s = summarize_run(root, warmup_steps=1, scalars=scalars)["mean_step_s"]
    pace = f"; {mean_s:.1f} s a step after the first" if mean_s else ""
    return [f"{len(rewards)} steps; reward {rewards[0]:+.3f} at the first, {rewards[-1]:+.3f} at the last "
            f"({REWARD_TAG}){pace}",
            f"outputs in {root}: train.log, tensorboard/, timeline/ (openrlhf-oppo plot timeline {root})"]
