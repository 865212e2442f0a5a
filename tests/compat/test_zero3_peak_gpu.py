"""One ZeRO-3 training step of a real-size layer stack on one GPU: its peak memory against what
the launch-time memory check counts for that shape (`footprint`).

Four Qwen2.5-7B decoder layers (hidden 3584, MLP 18944, 28 query / 4 KV heads) over a small
vocabulary: 0.93 B parameters, the layer shape the 7B presets train. DeepSpeed's ZeRO-3 in bf16
as OpenRLHF's actor runs it (`get_train_ds_config`, no offload) with torch's AdamW (DeepSpeed's
FusedAdam is a CUDA extension built at run time; the memory is the same: fp32 master weights
and two moments). The check counts 16 B a parameter (bf16 weight and gradient, fp32 master,
exp_avg, exp_avg_sq); activations are left out of it, so the measured peak must lie above that
count, and below it plus the step's activations as the check counts them for a training
micro-batch (`footprint.training_activation_bytes`) and the fp32 gradients the optimizer step
makes for one sub-group.

Needs DeepSpeed (carried as wheels by `scripts/gpu_checks.sh`); the figures go to
$OPPO_GPU_OUT/zero3-peak.json when that is set.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.gpu

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 4, 3584, 18944, 28, 4, 1024
BATCH, SEQ = 2, 2048
SUB_GROUP = 1e9  # DeepSpeed's sub_group_size: the optimizer steps this many parameters at a time


def _train_ds_config() -> dict:
    """OpenRLHF 0.11.2's `get_train_ds_config(offload=False, adam_offload=False, stage=3,
    param_dtype="bf16")` with its "auto" sizes as DeepSpeed's defaults resolve them (OpenRLHF's
    module is not imported: it imports flash-attn, which the device check does not carry)."""
    zero = {"stage": 3, "offload_param": {"device": "none"}, "offload_optimizer": {"device": "none"},
            "sub_group_size": SUB_GROUP, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
            "stage3_param_persistence_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
            "reduce_bucket_size": 5e8, "reduce_scatter": True}
    return {"zero_optimization": zero, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
            "prescale_gradients": False, "train_micro_batch_size_per_gpu": BATCH, "train_batch_size": BATCH,
            "zero_allow_untested_optimizer": True}


def test_a_zero3_step_of_real_size_layers_peaks_where_the_memory_check_says():
    import deepspeed
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from openrlhf_oppo import footprint

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl")
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, tie_word_embeddings=False)
    ds_config = _train_ds_config()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    params = footprint.decoder_params(LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), device=torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    counted = footprint.zero3_bytes(params, trainable=True, devices=1)
    activations = footprint.training_activation_bytes(BATCH * SEQ, LAYERS, HIDDEN, FFN, VOCAB, checkpointing=False)
    figures = {"params": params, "peak_gb": peak / footprint.GB, "counted_gb": counted / footprint.GB,
               "activations_gb": activations / footprint.GB,
               "peak_over_counted": peak / counted, "device": torch.cuda.get_device_name()}
    print(json.dumps(figures, indent=1))
    if os.environ.get("OPPO_GPU_OUT"):
        with open(os.path.join(os.environ["OPPO_GPU_OUT"], "zero3-peak.json"), "w") as f:
            json.dump(figures, f, indent=1)
    assert counted <= peak, "the memory check counts more than a ZeRO-3 step takes: its ZeRO-3 formula is wrong"
    step_grads = 4 * min(params, SUB_GROUP)  # the optimizer step's fp32 gradients of one sub-group
    assert peak <= counted + activations + step_grads, (
        "a ZeRO-3 step peaks above the check's count plus the step's activations and the optimizer step's fp32 "
        "gradients: the check's lower bound misses a term")
