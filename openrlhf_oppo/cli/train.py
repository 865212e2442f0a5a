"""`openrlhf-oppo train --schedule sync --config configs/tiny-cpu.yaml [-- extra OpenRLHF flags]`

The CLI over openrlhf_oppo.integrations.launch.train_run (flags, task defaults, input
checks, launching with restarts); `main` and `run` are its.
"""

from __future__ import annotations

from openrlhf_oppo.integrations.launch.train_run import main, run

__all__ = ["main", "run"]
