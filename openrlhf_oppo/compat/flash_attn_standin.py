"""Pure-torch stand-in for the two `flash_attn` modules OpenRLHF 0.11.2 imports at
module top (`openrlhf/models/ring_attn_utils.py`):

    from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input
    from flash_attn.utils.distributed import all_gather

flash-attn 2.8.3 is a CUDA-only source build. These helpers are only *called* with
`--ds.packing_samples` / ring attention, which the CPU path leaves off, but they are
implemented with flash-attn 2.8.3's semantics so a packed run would still be right.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch
import torch.nn.functional as F
from einops import rearrange  # noqa: F401  (re-exported as flash_attn.bert_padding.rearrange)


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` of `input` along dim 0 (flash_attn.bert_padding.index_first_axis)."""
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int) -> torch.Tensor:
    output = torch.zeros((first_axis_dim, *values.shape[1:]), device=values.device, dtype=values.dtype)
    output[indices] = values
    return output


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """(batch, seqlen, ...) -> (total_nnz, ...), indices, cu_seqlens, max_seqlen, seqused."""
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """(total_nnz, ...) -> (batch, seqlen, ...), zeros where padded."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])


def all_gather(input_: torch.Tensor, process_group) -> torch.Tensor:
    """Concatenate `input_` from every rank along dim 0, differentiably."""
    import torch.distributed.nn.functional as dist_fn

    return torch.cat(dist_fn.all_gather(input_.contiguous(), group=process_group), dim=0)


def install() -> None:
    """Register the stand-in modules unless a real flash_attn is importable."""
    if "flash_attn" in sys.modules or importlib.util.find_spec("flash_attn") is not None:
        return
    this = sys.modules[__name__]
    names = {
        "flash_attn": {},
        "flash_attn.bert_padding": {
            n: getattr(this, n)
            for n in ("index_first_axis", "index_put_first_axis", "pad_input", "rearrange", "unpad_input")
        },
        "flash_attn.utils": {},
        "flash_attn.utils.distributed": {"all_gather": all_gather},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name, "openrlhf_oppo CPU stand-in (see openrlhf_oppo.compat.flash_attn_standin)")
        is_package = name in ("flash_attn", "flash_attn.utils")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
        module.__dict__.update(attrs)
        sys.modules[name] = module
    sys.modules["flash_attn"].bert_padding = sys.modules["flash_attn.bert_padding"]
    sys.modules["flash_attn"].utils = sys.modules["flash_attn.utils"]
    sys.modules["flash_attn.utils"].distributed = sys.modules["flash_attn.utils.distributed"]

