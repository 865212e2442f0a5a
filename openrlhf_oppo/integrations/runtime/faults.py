"""Crash injection for the reliability tests: ``OPPO_FAULTS="reward@1,rollout@2,driver@3,abort@1"``
kills the streaming reward actor during step 1 and the rollout engine during step 2
(each after a seeded number of calls; ``reference@N``: a streaming reference actor), and the
trainer (the driver of the PPO loop) right after step 3's checkpoint is written; ``abort@1`` has
an engine abort one of its requests during step 1 (as vLLM aborts a request). Each fault fires once per run directory,
restarts included (recorded next to the ledger), in its step or, where that step makes too few calls of its
kind, in the first later one that makes enough (`due`). Unset, nothing happens; the kills are
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
    """True once per run directory when a planned fault ``kind@N`` fires now; ``calls``: the calls of
    this kind made so far in ``step``. It fires in step N at a call number seeded by N, or, where a
    step makes fewer calls than that (with async admission a step can take a batch that finished
    decoding during the previous one, with no engine reply at all), at that call of the first later
    step that makes it: a planned fault always fires once its step is reached."""
    record = (run_env.path(run_env.LEDGER_JSONL) or "oppo") + ".faults"
    for planned_step in sorted(planned(kind)):
        if planned_step > step or (calls is not None and calls != random.Random(planned_step).randint(1, 3)):
            continue
        tag = f"{kind}@{planned_step}"
        if os.path.exists(record) and tag in open(record).read().split():
            continue
        with open(record, "a") as fh:
            fh.write(tag + "\n")
        logger.warning("OPPO fault injection: %s (in step %d)", tag, step)
        return True
    return False


def kill_this_process(what: str) -> None:
    logger.warning("OPPO fault injection: killing %s (pid %d)", what, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
