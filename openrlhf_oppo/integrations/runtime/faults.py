"""Crash injection for the reliability tests: ``OPPO_FAULTS="reward@1,rollout@2,driver@3,abort@1"``
kills the streaming reward actor during step 1 and the rollout engine during step 2
(each after a seeded number of calls; ``reference@N``: a streaming reference actor), and the
trainer (the driver of the PPO loop) right after step 3's checkpoint is written; ``abort@1`` has
an engine abort one of its requests during step 1 (as vLLM aborts a request). Each fault fires once per run directory,
restarts included (recorded next to the ledger). Unset, nothing happens; the kills are
real (`ray.kill`, SIGKILL), the recoveries too."""

from __future__ import annotations

import os
import random
import signal

from openrlhf_oppo import run_env
from openrlhf_oppo.integrations.runtime.log import get_logger

logger = get_logger(__name__)

KINDS = ("reward", "reference", "rollout", "driver", "abort")


def planned(kind: str) -> set[int]:
    """Steps at which a fault of ``kind`` is planned."""
    steps = set()
    for item in run_env.faults():
        name, _, step = item.partition("@")
        if name not in KINDS or not step.isdigit():
            raise ValueError(f"{run_env.FAULTS}: expected KIND@STEP with KIND in {KINDS}, got {item!r}")
        if name == kind:
            steps.add(int(step))
    return steps


def due(kind: str, step: int, calls: int | None = None) -> bool:
    """True once per run directory when the fault ``kind@step`` fires now; ``calls``:
    the calls of this kind made so far in the step (fires at a number seeded by the step)."""
    if step not in planned(kind) or (calls is not None and calls != random.Random(step).randint(1, 3)):
        return False
    record = (run_env.path(run_env.LEDGER_JSONL) or "oppo") + ".faults"
    tag = f"{kind}@{step}"
    if os.path.exists(record) and tag in open(record).read().split():
        return False
    with open(record, "a") as fh:
        fh.write(tag + "\n")
    logger.warning("OPPO fault injection: %s", tag)
    return True


def kill_this_process(what: str) -> None:
    logger.warning("OPPO fault injection: killing %s (pid %d)", what, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
