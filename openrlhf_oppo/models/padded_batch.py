"""One batched forward across sequences of different cached lengths: padded inputs
and the stacked KV cache (`prefill.PrefillEngine`'s micro-batch).

Batched forward across sequences of different cached lengths (one micro-batch):

    kv index:    0 .. L-1 (past, right-aligned)  | L .. L+N-1 (new, left-aligned)
    seq a (L=5): k k k k k                       | n n n . .
    seq b (L=3): . . k k k                       | n n n n n
    seq c (L=0): . . . . .                       | n n . . .

Each sequence's past is right-aligned at index L and its new tokens start at
index L, so past + new is one contiguous slice `[L - past, L + new)` that we
clone back out after the forward, every layer at once: a sequence's cache is one tensor
(layers, keys/values, kv_heads, tokens, head_dim), so stacking and copying out cost one
copy a sequence, not one a sequence and layer (at 7B on a GPU, thousands of small copies
a forward). The 2-D attention mask zeroes the holes and transformers' causal rule
(query j at kv index L + j) keeps every real query away from the right padding of the
new block. Position ids are given per sequence (`past + j`), so rotary embeddings are
exactly the one-shot ones.

Written against transformers 5.15.0 (`transformers.cache_utils.Cache`, `DynamicLayer`).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class PaddedPastLayer(DynamicLayer):
    """A cache layer over one preallocated `(B, kv_heads, L + N, head_dim)` buffer (a view of
    `stacked_cache`'s buffer of every layer).

    The padded past is already in `[:L]`; `update` writes the new keys/values
    into `[L:L+N]` instead of `torch.cat` (which would copy the whole batch's
    cache once more per layer and forward).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, past_len_tokens: int):
        super().__init__()
        self.dtype = keys.dtype
        self.device = keys.device
        self.keys = keys
        self.values = values
        self.is_initialized = True
        self.filled_len_tokens = past_len_tokens

    def update(self, key_states, value_states, *args, **kwargs):
        start, end = self.filled_len_tokens, self.filled_len_tokens + key_states.shape[-2]
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        self.filled_len_tokens = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.filled_len_tokens


def padded_inputs(past: list[int], new: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(input_ids, position_ids, attention_mask)` of one micro-batch: shapes (B, N), (B, N)
    and (B, L + N), for sequences with `past[i]` cached tokens and `new[i]` tokens to run."""
    batch = len(new)
    max_past, max_new = max(past), max(len(n) for n in new)
    input_ids = torch.zeros(batch, max_new, dtype=torch.long)
    position_ids = torch.zeros(batch, max_new, dtype=torch.long)
    attention_mask = torch.zeros(batch, max_past + max_new, dtype=torch.long)
    steps = torch.arange(max_new)
    for i, (p, toks) in enumerate(zip(past, new, strict=True)):
        input_ids[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        # Padded query slots repeat the last real position: never beyond the sequence.
        position_ids[i] = p + steps.clamp(max=len(toks) - 1)
        attention_mask[i, max_past - p : max_past + len(toks)] = 1
    return input_ids, position_ids, attention_mask


def stacked_cache(kvs: list[torch.Tensor | None], past: list[int], max_new: int, like: torch.Tensor,
                  shape: tuple[int, int, int]) -> tuple[Cache, torch.Tensor]:
    """The sequences' caches right-aligned at `L = max(past)` in one buffer with room for
    `max_new` new tokens: `(layers, 2, B, kv_heads, L + max_new, head_dim)`, of `like`'s dtype
    and device. `kvs[i]` holds sequence i's keys and values of every layer,
    `(layers, 2, kv_heads, past[i], head_dim)` (None when `past[i]` is 0): one copy a sequence,
    whatever the depth. Returns the cache (a layer per depth, over views of the buffer) and the
    buffer, from which `[:, :, i, :, L - past[i] : L + new[i]]` is sequence i's cache after the forward."""
    layers, kv_heads, head_dim = shape
    max_past = max(past)
    # zeros, not empty: a masked slot's value still meets a zero weight (0 * NaN would be NaN)
    buf = like.new_zeros(layers, 2, len(kvs), kv_heads, max_past + max_new, head_dim)
    for i, (kv, p) in enumerate(zip(kvs, past, strict=True)):
        if p:
            buf[:, :, i, :, max_past - p : max_past] = kv
    return Cache(layers=[PaddedPastLayer(buf[d, 0], buf[d, 1], max_past) for d in range(layers)]), buf
