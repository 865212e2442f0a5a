"""The stacked KV cache of one micro-batch (`models.padded_batch.stacked_cache`)."""

from __future__ import annotations

import torch

from openrlhf_oppo.models.padded_batch import padded_inputs, stacked_cache

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 4


def _kv(past: int, seed: int) -> torch.Tensor:
    return torch.randn(LAYERS, 2, KV_HEADS, past, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def test_each_sequence_lands_right_aligned_in_every_layer_with_zeros_in_the_holes():
    past, max_new = [5, 0, 2], 3
    kvs = [_kv(5, 0), None, _kv(2, 1)]
    cache, buf = stacked_cache(kvs, past, max_new, torch.empty(0, dtype=torch.float32), (LAYERS, KV_HEADS, HEAD_DIM))
    assert buf.shape == (LAYERS, 2, 3, KV_HEADS, 5 + max_new, HEAD_DIM)
    assert torch.equal(buf[:, :, 0, :, 0:5], kvs[0]) and torch.equal(buf[:, :, 2, :, 3:5], kvs[2])
    assert not buf[:, :, 1].any() and not buf[:, :, 2, :, :3].any() and not buf[:, :, :, :, 5:].any()
    # the cache's layers are views of the one buffer: what a forward writes there is what is copied out
    assert len(cache.layers) == LAYERS
    for d, layer in enumerate(cache.layers):
        assert layer.get_seq_length() == 5
        assert layer.keys.data_ptr() == buf[d, 0].data_ptr() and layer.values.data_ptr() == buf[d, 1].data_ptr()
    new_k = torch.ones(3, KV_HEADS, max_new, HEAD_DIM)
    cache.layers[1].update(new_k, 2 * new_k)
    assert torch.equal(buf[1, 0, :, :, 5:], new_k) and torch.equal(buf[1, 1, :, :, 5:], 2 * new_k)


def test_a_batch_with_nothing_cached_starts_empty_and_fills_from_zero():
    cache, buf = stacked_cache([None, None], [0, 0], 4, torch.empty(0, dtype=torch.bfloat16),
                               (LAYERS, KV_HEADS, HEAD_DIM))
    assert buf.dtype == torch.bfloat16 and buf.shape[-2] == 4 and not buf.any()
    assert all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_padded_inputs_mask_the_holes_and_give_each_sequence_its_own_positions():
    ids, pos, mask = padded_inputs([5, 0, 2], [[7, 8], [9, 10, 11], [12]])
    assert ids.tolist() == [[7, 8, 0], [9, 10, 11], [12, 0, 0]]
    assert pos.tolist() == [[5, 6, 6], [0, 1, 2], [2, 2, 2]]  # padded slots repeat the last real position
    assert mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 0, 0]]
