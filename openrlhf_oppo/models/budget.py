"""The default KV budget of a streaming scorer, derived from the device's memory.

`--oppo.streaming.kv_budget_tokens 0` (the default) means: after the model is loaded,

    budget = fraction x free memory / share / KV bytes per token
    KV bytes per token = 2 (keys, values) x layers x kv_heads x head_dim x dtype bytes

On CUDA, free memory is `torch.cuda.mem_get_info()` of the scorer's GPU (its own:
`share` 1) and the fraction `CUDA_FRACTION`; the rest covers the batched forward
(the padded cache copy of one micro-batch, activations). On a CPU host, free memory
is the host's available memory, which every process of the run (vLLM, the DeepSpeed
actors, the reference, Ray) draws on, so the fraction is smaller (`CPU_FRACTION`) and
is split among the scorers on the host (`share`). Past the budget the engine evicts
the least recently advanced sequences' caches and re-prefills them from their
recorded tokens when they are next advanced (`prefill.PrefillEngine`): results do
not change, only time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openrlhf_oppo.footprint import kv_bytes_per_token, kv_shape  # one formula, shared with the launch check

__all__ = ["KVBudget", "auto_kv_budget", "budget_from_free_bytes", "host_available_bytes", "kv_bytes_per_token",
           "kv_shape"]

CUDA_FRACTION = 0.5  # of the scorer GPU's free memory after the model is loaded
CPU_FRACTION = 0.1  # of the host's available memory, shared by every process of the run


@dataclass(frozen=True)
class KVBudget:
    tokens: int
    how: str  # one line: where the number came from


def budget_from_free_bytes(free_bytes: int, config, dtype_bytes: int, fraction: float, share: int = 1) -> int:
    """KV tokens that fit in `fraction` of `free_bytes` split `share` ways (at least 1)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    if share < 1:
        raise ValueError(f"share must be >= 1, got {share}")
    per_token = kv_bytes_per_token(config, dtype_bytes)
    return max(1, int(max(free_bytes, 0) * fraction / share) // per_token)


def host_available_bytes() -> int:
    """Available host memory: psutil's, else MemAvailable from /proc/meminfo."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
        msg = "cannot read the host's available memory (no psutil, no MemAvailable in /proc/meminfo)"
        raise RuntimeError(msg) from None


def auto_kv_budget(config, dtype, device, share: int = 1, forward_reserve_tokens: int = 0) -> KVBudget:
    """The default budget of a scorer whose model (`config`, `dtype`) is loaded on `device`;
    `share`: scorers drawing on the same host memory (CPU only); `forward_reserve_tokens`: KV
    tokens the batched forward copies on top of the caches (taken off the free memory first)."""
    import torch

    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    per_token = kv_bytes_per_token(config, dtype_bytes)
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        fraction = CUDA_FRACTION
        share = 1  # a GPU's memory is its own scorer's
        where = f"free memory of {device}"
    else:
        free = host_available_bytes()
        fraction = CPU_FRACTION
        where = "available host memory"
    reserve = forward_reserve_tokens * per_token
    tokens = budget_from_free_bytes(free - reserve * share, config, dtype_bytes, fraction, share)
    layers, kv_heads, head_dim = kv_shape(config)
    split = f" / {share} scorers" if share > 1 else ""
    minus = f" - {reserve / 2**30:.1f} GiB for the batched forward's copies" if reserve else ""
    how = (f"{fraction:g} x ({free / 2**30:.1f} GiB {where}{minus}){split} / {per_token:,} B per token "
           f"(2 x {layers} layers x {kv_heads} kv heads x {head_dim} head dim x {dtype_bytes} B)")
    return KVBudget(tokens, how)
