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
