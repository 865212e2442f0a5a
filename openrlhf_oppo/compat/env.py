"""Environment of a CPU run: what the driver sets so that every process it starts
(Ray raylet -> workers -> vLLM engine subprocesses) gets the compat layer."""

from __future__ import annotations

import ctypes
import json
import os
import platform

from openrlhf_oppo import run_env
from openrlhf_oppo.hooks import SITE_DIR, site_pythonpath

__all__ = ["CACHE_DIR", "SITE_DIR", "cuda_available", "launch_env", "request_amx_permission"]

# per-user project cache: the tiny task, and the compile caches of every run (compat.caches)
CACHE_DIR = run_env.cache_dir()

# Logical resources declared to Ray. OpenRLHF 0.11.2's train_ppo_ray calls
# `ray.init()` with no resource arguments and asks for {"GPU": 1} bundles; with no
# GPU declared the placement groups never become ready and the run hangs silently.
RAY_LOGICAL_GPUS = 8
RAY_LOGICAL_CPUS = 16


def cuda_available() -> bool:
    """The single gate of the compat layer (tests mock it through torch)."""
    import torch

    return torch.cuda.is_available()


def launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Variables to add to a launched OpenRLHF process tree; {} when CUDA is present."""
    if cuda_available():
        return {}
    base = dict(os.environ if base is None else base)
    return {
        run_env.COMPAT: "1",
        "PYTHONPATH": site_pythonpath(base.get("PYTHONPATH", "")),
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": RAY_LOGICAL_CPUS, "GPU": RAY_LOGICAL_GPUS}),
        # vLLM CPU otherwise reads gpu_memory_utilization as a share of host RAM
        # (0.5 -> 11 GB reserved, 30 s init); 1 GiB of KV cache is plenty here.
        "VLLM_CPU_KVCACHE_SPACE": base.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # 2 cores: keep each process from spawning a thread per core times many processes.
        "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": base.get("TOKENIZERS_PARALLELISM", "false"),
    }


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
