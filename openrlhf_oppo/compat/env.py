"""Environment of a CPU run: what the driver sets so that every process it starts
(Ray raylet -> workers -> vLLM engine subprocesses) gets the compat layer."""

from __future__ import annotations

import json
import os
from pathlib import Path

from openrlhf_oppo import run_env

SITE_DIR = Path(__file__).resolve().parent / "_site"
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
    pythonpath = [str(SITE_DIR)] + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {
        run_env.COMPAT: "1",
        "PYTHONPATH": os.pathsep.join(dict.fromkeys(pythonpath)),
        "RAY_OVERRIDE_RESOURCES": json.dumps({"CPU": RAY_LOGICAL_CPUS, "GPU": RAY_LOGICAL_GPUS}),
        # vLLM CPU otherwise reads gpu_memory_utilization as a share of host RAM
        # (0.5 -> 11 GB reserved, 30 s init); 1 GiB of KV cache is plenty here.
        "VLLM_CPU_KVCACHE_SPACE": base.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        # 2 cores: keep each process from spawning a thread per core times many processes.
        "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": base.get("TOKENIZERS_PARALLELISM", "false"),
    }
