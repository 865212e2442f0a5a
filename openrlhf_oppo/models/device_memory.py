"""Device memory of a streaming scorer: give the caching allocator's free blocks back, and
tell a device out-of-memory error from every other error.

OpenRLHF 0.11.2 empties its reward group's CUDA cache after each batched reward forward
under colocation (`experience_maker._dispatch_forward` / before the critic's forward with
`--train.colocate_critic_reward`); OPPO's streaming actors never take that branch, so they
empty it themselves when sequences finish (`integrations/runtime/scorer.py`).
"""

from __future__ import annotations

import torch

# torch >= 2.5 names it at the top level; torch.cuda's is the same class
OutOfMemoryError = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def release_device_memory() -> None:
    """Return the CUDA caching allocator's unused blocks to the device (a no-op without CUDA),
    so the models colocated with a scorer can use them."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers as they are now (dtype included)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def check_fits_device(need_bytes: int, free_bytes: int, total_bytes: int, what: str) -> None:
    """Refuse, before `.to(device)`, a streamed model that cannot fit its device: each streaming
    reward actor holds the whole model on one GPU (no tensor parallelism), plus its KV caches."""
    if need_bytes < free_bytes:
        return
    gib = 2**30
    raise ValueError(
        f"{what}: the streamed reward model needs {need_bytes / gib:.1f} GiB for its weights alone, and its "
        f"GPU has {free_bytes / gib:.1f} GiB free of {total_bytes / gib:.1f} GiB. A streaming reward actor holds "
        "the whole model on one GPU: tensor parallelism for the streamed reward model is not supported. Use a "
        "smaller reward model, a GPU with more memory, or `--oppo.streaming.enable false` (OpenRLHF's own "
        "DeepSpeed reward model, ZeRO-3 sharded over --reward.num_gpus_per_node, scores after generation)"
    )
