"""Device-memory arithmetic shared by the launch-time memory check
(`integrations.launch.memory_check`) and the simulator (`sim.memory`): one formula each.

Pure Python (the simulator imports no torch): a transformers config is read by attribute.
"""

from __future__ import annotations

GB = 1e9
RESERVE_BYTES = 4 * GB  # per device: CUDA contexts, NCCL buffers, allocator fragmentation
# each process beyond the first with a CUDA context on the same device (torch's context and
# kernels, about 0.5 GB on an H100); the launch-time check adds it for colocated models
CUDA_CONTEXT_BYTES = 0.5 * GB
# a device of vLLM's own: vLLM's gpu_memory_utilization covers its weights, activations, KV
# cache and its own CUDA context; beyond it, the weight sync's NCCL communicator and allocator
# slack (an estimate)
VLLM_BEYOND_SHARE_BYTES = 1 * GB
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


def layer_forward_bytes(tokens: int, hidden: int, intermediate: int) -> float:
    """One decoder layer's working set in a forward without gradients over `tokens` (padded) bf16
    tokens, freed layer by layer: the MLP's gate, up and their product (3 x intermediate) and about
    four hidden-wide tensors (residual, norm output, attention output, query), 2 B each. At 16,384
    tokens of Qwen2.5-7B's shape: 2.3 GB."""
    return 2 * tokens * (3 * intermediate + 4 * hidden)


def logits_forward_bytes(tokens: int, vocab: int) -> float:
    """A log-prob forward's logits: bf16 from the LM head and the fp32 copy OpenRLHF 0.11.2's
    `Actor.forward` makes of them, 6 B a token and vocabulary entry."""
    return 6 * tokens * vocab


def training_activation_bytes(tokens: int, layers: int, hidden: int, intermediate: int, vocab: int,
                              checkpointing: bool, lm_head: bool = True) -> float:
    """Activations of one training micro-batch of `tokens` (padded) bf16 tokens, as the simulator
    counts them (`sim.memory`): a layer keeps 2 x (10 x hidden + 4 x intermediate) B a token; with
    gradient checkpointing each layer keeps only its input (2 x hidden B) and one layer is
    recomputed at a time; an LM head adds fp32 logits and their gradient (8 B a token and vocabulary
    entry), a critic's one-wide head nothing."""
    layer = 2 * tokens * (10 * hidden + 4 * intermediate)
    if checkpointing:
        kept = 2 * layers * tokens * hidden + layer
    else:
        kept = layers * layer
    return kept + (8 * tokens * vocab if lm_head else 0)


def megatron_layer_activation_bytes(micro_batch: int, seq: int, hidden: int, heads: int, intermediate: int,
                                    tp: int) -> float:
    """What one decoder layer of the Megatron actor keeps for its backward, on one tensor-parallel
    rank (Megatron-Core's local layer spec: no sequence parallelism, no recompute, attention scores
    materialised with the softmax in fp32), in bytes:

        8 s b h          the two RMSNorms' inputs and outputs (bf16, full width on every rank)
        8 s b h / tp     query, key and value expanded to every head, attention's output
        6 b (a / tp) s^2 the softmax's fp32 output and its bf16 copy for the product with V
        6 s b f / tp     the MLP's gate and up projections and their SwiGLU product

    (s tokens, b samples, h hidden, a heads, f MLP width); within 5 % of Korthikanti et al.,
    "Reducing Activation Recomputation in Large Transformer Models" (2022), s b h (10 + 24 / t +
    5 a s / (h t)) at Qwen2.5-72B's shape."""
    s, b = seq, micro_batch
    return (8 * s * b * hidden + 8 * s * b * hidden / tp + 6 * b * (heads / tp) * s * s
            + 6 * s * b * intermediate / tp)


# what one node writes to the checkpoint's storage, all its ranks together: the rate the cluster
# presets' save intervals are sized by (an NFS-class shared file system; a parallel file system or
# local NVMe writes faster, which makes a save cheaper than counted)
CHECKPOINT_WRITE_BYTES_PER_S_PER_NODE = 2 * GB


def checkpoint_bytes(trained_params: float) -> float:
    """One checkpoint of the trained models (DeepSpeed ZeRO-3 or Megatron, all ranks together): bf16
    weights (2 B a parameter) and Adam's fp32 master weights and two moments (12 B)."""
    return 14 * trained_params
