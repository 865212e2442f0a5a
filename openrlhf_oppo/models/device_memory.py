"""Device memory of a streaming scorer: refuse a model its GPU cannot hold (before loading it),
give the caching allocator's free blocks back, and tell a device out-of-memory error from every
other error.

OpenRLHF 0.11.2 empties its reward group's CUDA cache after each batched reward forward
under colocation (`experience_maker._dispatch_forward` / before the critic's forward with
`--train.colocate_critic_reward`); OPPO's streaming actors never take that branch, so they
empty it themselves when sequences finish (`integrations/runtime/scorer.py`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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


# safetensors' dtype names (the header's "dtype") and their sizes in bytes
_SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_SAFETENSORS_FLOATS = {"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"}


def _safetensors_header(file: Path) -> dict:
    """A safetensors file's header (name -> dtype, shape, offsets): its first 8 + n bytes, no weights."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _safetensors_files(path: Path) -> list[Path]:
    """The safetensors files a load reads, as `loaders._load_state_dict` and transformers pick
    them: the index's shards, else `model.safetensors`; none when the weights are not safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    return []


def checkpoint_bytes(path: str | Path, dtype: torch.dtype, *, lm_head: bool) -> int:
    """Bytes the weights of the checkpoint directory `path` take once loaded in `dtype`, read
    without loading them: from the safetensors headers (floating tensors in `dtype`, the others
    as saved), else (`pytorch_model*.bin`, or config.json alone) from config.json's shape
    (`footprint.params_of_config`; `lm_head`: a causal LM's output layer counts, a reward
    model's 1-wide head does not)."""
    path = Path(path)
    itemsize = torch.empty((), dtype=dtype).element_size()
    files = _safetensors_files(path)
    if files:
        total = 0
        for file in files:
            for info in _safetensors_header(file).values():
                dt = info["dtype"]
                total += math.prod(info["shape"]) * (itemsize if dt in _SAFETENSORS_FLOATS else _SAFETENSORS_BYTES[dt])
        return total
    from transformers import AutoConfig

    from openrlhf_oppo.footprint import params_of_config

    return params_of_config(AutoConfig.from_pretrained(path), lm_head=lm_head) * itemsize


def check_fits_device(need_bytes: int, free_bytes: int, total_bytes: int, what: str, role: str = "reward") -> None:
    """Refuse a streamed model that cannot fit its device, before it is loaded or moved there:
    each streaming actor (`role` "reward" or "reference") holds the whole model on one GPU (no
    tensor parallelism), plus its KV caches. `what` names the flag and the model."""
    if need_bytes < free_bytes:
        return
    gib = 2**30
    if role == "reward":
        model = "reward model"
        fallback = ("`--oppo.streaming.enable false` (OpenRLHF's own DeepSpeed reward model, ZeRO-3 sharded over "
                    "--reward.num_gpus_per_node, scores after generation)")
    elif role == "reference":
        model = "reference"
        fallback = ("`--oppo.streaming.reference false` (OpenRLHF's own DeepSpeed reference, ZeRO-3 sharded over "
                    "--ref.num_gpus_per_node, runs after generation)")
    else:
        raise ValueError(f"role must be 'reward' or 'reference', got {role!r}")
    raise ValueError(
        f"{what}: the streamed {model} needs {need_bytes / gib:.1f} GiB for its weights alone, and its "
        f"GPU has {free_bytes / gib:.1f} GiB free of {total_bytes / gib:.1f} GiB. A streaming {role} actor holds "
        f"the whole model on one GPU: tensor parallelism for the streamed {model} is not supported. Use a "
        f"smaller model, a GPU with more memory, or {fallback}"
    )
