"""`openrlhf-oppo train --schedule sync --config configs/tiny-cpu.yaml [-- extra OpenRLHF flags]`

The CLI over openrlhf_oppo.integrations.launch.train_run (flags, task defaults, input
checks, launching with restarts); `main` and `run` are its.
"""

from __future__ import annotations

from openrlhf_oppo.integrations.launch.train_run import _task_flags, main, run

__all__ = ["_task_flags", "main", "run"]  # _task_flags: tests/tasks build the task's flags through it
