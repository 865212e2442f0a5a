"""OPPO's drop-in for OpenRLHF's entry point: every OpenRLHF flag plus `--oppo.*`.

    python -m openrlhf_oppo.cli.train_ppo_ray [--config preset.yaml] <OpenRLHF 0.11.2 flags> \\
        --oppo.delta.init 8 --oppo.chunk.size_tokens 512

Launch it as OpenRLHF users launch `openrlhf.cli.train_ppo_ray` (e.g. `ray job submit ...
-- python -m openrlhf_oppo.cli.train_ppo_ray ...`). The driver's logic (config
resolution, flag checks, Ray start-up, class swaps) is openrlhf_oppo.integrations.launch.driver;
the input checks before Ray starts are cluster_entry's (the same as `openrlhf-oppo train`'s).
"""

from __future__ import annotations

import sys

from openrlhf_oppo.integrations.launch.cluster_entry import main
from openrlhf_oppo.integrations.launch.driver import (
    CORRECTIONS,
    FORWARDED_ENV,
    INCOMPATIBLE_FLAGS,
    JOB_CONFIG_ENV,
    MEGATRON_INCOMPATIBLE,
    OPENRLHF_MODULE,
    STREAMING_REFERENCE_INCOMPATIBLE,
    STREAMING_REWARD_INCOMPATIBLE,
    check_flags,
    driver_env_vars,
    openrlhf_argv,
    parse,
    streams_rewards,
)

__all__ = ["CORRECTIONS", "FORWARDED_ENV", "INCOMPATIBLE_FLAGS", "JOB_CONFIG_ENV", "MEGATRON_INCOMPATIBLE",
           "OPENRLHF_MODULE", "STREAMING_REFERENCE_INCOMPATIBLE", "STREAMING_REWARD_INCOMPATIBLE", "check_flags",
           "driver_env_vars", "main", "openrlhf_argv", "parse", "streams_rewards"]

if __name__ == "__main__":
    sys.exit(main())
