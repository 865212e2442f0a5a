"""Crash injection for the reliability tests: ``OPPO_FAULTS="reward@1,driver@2"`` kills
the streaming reward actor during step 1 (after a seeded number of reward calls) and
the trainer (the driver of the PPO loop) right after step 2's checkpoint is written.
Unset, nothing happens; the kills are real (`ray.kill`, SIGKILL), the recoveries too."""

from __future__ import annotations

import os
import random
import signal

FAULTS_ENV = "OPPO_FAULTS"
KINDS = ("reward", "driver")


def planned(kind: str) -> set[int]:
    """Steps at which a fault of ``kind`` is injected."""
    steps = set()
    for item in filter(None, os.environ.get(FAULTS_ENV, "").split(",")):
        name, _, step = item.partition("@")
        if name not in KINDS or not step.isdigit():
            raise ValueError(f"{FAULTS_ENV}: expected KIND@STEP with KIND in {KINDS}, got {item!r}")
        if name == kind:
            steps.add(int(step))
    return steps


def reward_kill_point(step: int) -> int:
    """Kill the reward actor once this many reward calls of the step were sent (seeded by the step)."""
    return random.Random(step).randint(1, 3)


def kill_this_process(what: str) -> None:
    print(f"OPPO fault injection: killing {what} (pid {os.getpid()})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
