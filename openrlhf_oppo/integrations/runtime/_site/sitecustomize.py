"""Loaded by every Python process started under a run of `openrlhf-oppo train` (the
launcher puts this directory, `openrlhf_oppo.hooks.SITE_DIR`, first on PYTHONPATH).
Cheap: it does not import torch; the patches run only when their target modules are
imported. Which patches a process gets is `integrations.runtime.startup`'s decision:

    OPPO_COMPAT=1          the CPU compat layer (openrlhf_oppo.compat), where CUDA is absent
    OPPO_TIMELINE_DIR=...  timeline spans of OpenRLHF's stages (integrations.runtime.timeline_hooks)
    OPPO_CONFIG_JSON=...   an OPPO run: its length-bucketed micro-batches (integrations.runtime.micro_batches)
    any of them            also the build-lock stamps (compat.caches) and seeded rollouts
                           (integrations.runtime.seeding), on any hardware
"""

import os

# run_env.COMPAT, run_env.TIMELINE_DIR, run_env.CONFIG_JSON
if os.environ.get("OPPO_COMPAT") == "1" or os.environ.get("OPPO_TIMELINE_DIR") or os.environ.get("OPPO_CONFIG_JSON"):
    try:
        from openrlhf_oppo.integrations.runtime import startup

        startup.run()
    except Exception as exc:  # never break an unrelated Python process
        import sys

        print(f"openrlhf_oppo.compat: sitecustomize failed: {exc!r}", file=sys.stderr)
