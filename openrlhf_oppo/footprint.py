"""Device-memory arithmetic shared by the launch-time memory check
(`integrations.launch.memory_check`) and the simulator (`sim.memory`): one formula each.

Pure Python (the simulator imports no torch): a transformers config is read by attribute.
"""

from __future__ import annotations

GB = 1e9
RESERVE_BYTES = 4 * GB  # per device: CUDA contexts, NCCL buffers, allocator fragmentation
LIVE_PARAMETERS = 1e9  # DeepSpeed's stage3_max_live_parameters default: gathered at once, bf16
ADAM_BYTES_PER_PARAM = 16  # ZeRO-3 trainable: bf16 weight + bf16 grad + fp32 master, exp_avg, exp_avg_sq
WEIGHT_BYTES_PER_PARAM = 2  # a frozen bf16 copy (reference, reward model)
# most padded tokens in one batched forward of a streaming reward actor (PrefillEngine's
# max_batch_tokens): its padded cache copy and the new KV take 2 x this x KV bytes per token
STREAM_MAX_BATCH_TOKENS = 16384


def decoder_params(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                   lm_head: bool = True, head_dim: int | None = None) -> int:
    """Parameters of a GQA decoder with a SwiGLU MLP (Llama / Qwen2 family); norms and biases left
    out (under 0.1 %). `lm_head` False: tied, or a critic / reward model (a 1-wide head instead)."""
    head_dim = head_dim or hidden // heads
    attn = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o, k, v
    mlp = 3 * hidden * intermediate  # gate, up, down
    return layers * (attn + mlp) + vocab * hidden * (2 if lm_head else 1)


def largest_param(hidden: int, intermediate: int, vocab: int) -> int:
    """Elements of a decoder's largest parameter: the embedding (or LM head), or an MLP matrix."""
    return hidden * max(vocab, intermediate)


def params_of_config(config, lm_head: bool = True) -> int:
    """`decoder_params` of a transformers config (its text config for a multimodal one); a tied
    config never counts an LM head."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return decoder_params(config.num_hidden_layers, config.hidden_size, heads,
                          getattr(config, "num_key_value_heads", None) or heads, config.intermediate_size,
                          config.vocab_size, lm_head and not tied, getattr(config, "head_dim", None))


def zero3_bytes(params: float, trainable: bool, devices: int) -> float:
    """Per device: one model's ZeRO-3 shard over `devices` (16 B a trainable parameter, 2 B a frozen one)."""
    return (ADAM_BYTES_PER_PARAM if trainable else WEIGHT_BYTES_PER_PARAM) * params / devices


def kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder's (text) config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of K and V one token takes over all layers."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_bytes_per_token(config, dtype_bytes: int) -> int:
    """Bytes of K and V one token takes over all layers of a decoder with `config`."""
    return kv_bytes(*kv_shape(config), dtype_bytes)
