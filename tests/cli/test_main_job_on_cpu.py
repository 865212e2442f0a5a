"""The terminal of `openrlhf-oppo train` as a user runs it, and the README's main job.

The session's `oppo_run` (tests/cli/conftest.py) is started as a user starts it: a quiet
terminal (a progress line per step with the mean response length, OPPO's messages; Ray's, vLLM's
and OpenRLHF's output in train.log) and a closing summary of what the run logged.

`slow` (left out of CI's run for time, a launch of its own): the main job itself
(`openrlhf-oppo train --schedule oppo --config configs/learn-longtail-cpu.yaml`, here 8 of its 64
steps): the shipped learn-longtail build installed into an empty assets directory, and a closing
summary of what PPO learned: on the trained samples, and the final actor against the SFT policy
on held-out prompts (tests/cli/test_train.py checks the summary's lines on logged runs)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # real Ray, vLLM (CPU build), DeepSpeed and OpenRLHF processes

REPO = Path(__file__).resolve().parents[2]
STEPS = 8  # --data.max_samples 64 / 8 prompts a step: the summary compares the first 4 steps with the last 4


def test_the_terminal_shows_a_progress_line_a_step_and_a_closing_summary(oppo_run):
    lines = oppo_run.output.splitlines()
    progress = [line for line in lines if line.startswith("OPPO:") and "len=" in line]
    assert len(progress) >= 4  # one line a step (the terminal redraws one line in place)
    assert len(lines) - len(progress) <= 30, "\n".join(lines)  # Ray's, vLLM's and OpenRLHF's output is in train.log
    summary = [line for line in lines if line.startswith("openrlhf-oppo train: ")]
    closing = (r"openrlhf-oppo train: 4 steps; reward [-+]\d+\.\d{3} -> [-+]\d+\.\d{3} \(train/reward, mean of the "
               r"first 2 steps -> the last 2\); \d+\.\d s a step after the first")
    assert any(re.fullmatch(closing, line) for line in summary), "\n".join(summary)
    assert f"openrlhf-oppo train: outputs in {oppo_run.root}: train.log, tensorboard/, timeline/" in oppo_run.output
    # the bar knows the run's steps (OpenRLHF's global steps: 16 prompts, 4 a step) and so shows the ETA
    assert re.search(r"OPPO: 100%\|.*\| 4/4 \[\d\d:\d\d<00:00", oppo_run.output), "\n".join(progress)
    # what the terminal closed with is kept: the figures in summary.json, the lines at the end of train.log
    record = json.loads((oppo_run.root / "summary.json").read_text())
    assert record["steps"] == 4 and record["exit_code"] == 0 and record["schedule"] == "oppo"
    assert f"{record['reward']['first']:+.3f} -> {record['reward']['last']:+.3f}" in "\n".join(summary)
    log = (oppo_run.root / "train.log").read_text().splitlines()
    assert log[-len(summary[-4:]):] == summary[-4:]
    assert summary[-2] == (f"openrlhf-oppo train: the whole run's timeline: {oppo_run.root / 'timeline.trace.json'} "
                           "(open it at https://ui.perfetto.dev)")
    trace = json.loads((oppo_run.root / "timeline.trace.json").read_text())
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("step ")) == 4


@pytest.mark.slow
def test_the_main_job_installs_the_shipped_task_and_sums_up_what_ppo_learned(train_runs, tmp_path_factory):
    assets = tmp_path_factory.mktemp("learn-longtail") / "assets"  # empty: the shipped build is installed there
    run = train_runs("oppo", "--data.max_samples", str(8 * STEPS), config=REPO / "configs" / "learn-longtail-cpu.yaml",
                     assets=assets)
    lines = run.output.splitlines()
    assert run.returncode == 0, run.failure()
    assert (assets / "BUILD_OK").exists() and (assets / "actor" / "model.safetensors").exists()
    progress = [line for line in lines if line.startswith("OPPO:") and "len=" in line]
    assert len(progress) >= STEPS  # one line a step (the terminal redraws one line in place)
    assert len(lines) - len(progress) <= 30, "\n".join(lines)  # Ray's, vLLM's and OpenRLHF's output is in train.log
    summary = [line for line in lines if line.startswith("openrlhf-oppo train: ")]
    assert any(re.search(rf"{STEPS} steps; reward [-+]\d\.\d+ -> [-+]\d\.\d+ \(train/reward, mean of the first 4 "
                         r"steps -> the last 4\)", line) for line in summary), "\n".join(summary)
    heldout = [line for line in summary if "held out" in line]
    figures = json.loads((run.root / "summary.json").read_text())["heldout"]
    assert figures["prompts"] == 256 and f"{figures['final_actor']['exact_match']:.3f};" in heldout[0]
    assert len(heldout) == 1 and re.search(
        r"held out \(256 prompts no step trained on\), the SFT policy -> this run's final actor: exact match "
        r"0\.\d{3} -> 0\.\d{3}; learned reward [-+]\d\.\d{3} -> [-+]\d\.\d{3}; at the 512-token cap",
        heldout[0]), heldout
    learned = [line for line in summary if "exact match" in line and "held out" not in line]
    assert len(learned) == 1 and re.search(
        r"exact match \d\.\d\d -> \d\.\d\d \(the SFT policy on the same prompts: \d\.\d\d -> \d\.\d\d\); mean response "
        r"\d+ -> \d+ tokens; at the 512-token cap \d+% -> \d+%", learned[0]), learned
