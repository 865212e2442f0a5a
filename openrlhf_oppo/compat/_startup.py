"""Process start-up part of the compat layer (called from `_site/sitecustomize`)."""

from __future__ import annotations

import ctypes
import platform

from openrlhf_oppo import run_env
from openrlhf_oppo.compat.hooks import install_hooks
from openrlhf_oppo.compat.patches import CACHE_PATCHES, PATCHES

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile-data permission. vLLM 0.29 CPU's bf16 attention uses
    AMX; without the permission the first AMX instruction kills the process with
    SIGILL. Harmless where AMX is absent (the syscall just fails)."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0


def run() -> None:
    install_hooks(CACHE_PATCHES)
    if run_env.compat_enabled():
        request_amx_permission()
        # The patches gate themselves on torch.cuda.is_available() when they fire
        # (torch is imported by then); here we only register them.
        install_hooks(PATCHES)
    if run_env.path(run_env.TIMELINE_DIR):
        from openrlhf_oppo.integrations.runtime.timeline_hooks import PATCHES as TIMELINE_PATCHES

        install_hooks(TIMELINE_PATCHES)
