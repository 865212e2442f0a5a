"""CPU compatibility layer: what makes OpenRLHF 0.11.2's Ray PPO pipeline run
without CUDA (vLLM's CPU build, DeepSpeed on gloo, Ray with logical GPUs).

Applied only when CUDA is absent, in every process of a run: the launcher puts
`SITE_DIR` (a `sitecustomize`, see openrlhf_oppo.hooks) on PYTHONPATH, which Ray
workers, Ray actors and vLLM's spawned engine processes all inherit; with
OPPO_COMPAT=1 it installs import hooks that patch the named OpenRLHF / torch
attributes when their modules are first imported. Every patch is one function in
`patches.py`, listed in `PATCHES`; each is a CPU workaround and gated on CUDA absence.

    from openrlhf_oppo import compat
    env = compat.launch_env()   # {} when CUDA is present
"""

from __future__ import annotations

from openrlhf_oppo.compat.env import SITE_DIR, cuda_available, launch_env
from openrlhf_oppo.compat.patches import PATCHES
from openrlhf_oppo.hooks import Patch, install_hooks

__all__ = ["PATCHES", "Patch", "SITE_DIR", "cuda_available", "install_hooks", "launch_env", "apply"]


def apply() -> bool:
    """Install every patch in this process if CUDA is absent; returns whether it did.
    Idempotent. Patches for modules already imported are applied at once."""
    if cuda_available():
        return False
    install_hooks(PATCHES)
    return True
