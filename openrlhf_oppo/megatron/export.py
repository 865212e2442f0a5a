"""The Megatron backend's weights back under Hugging Face names: for the weight sync into vLLM
(OpenRLHF's broadcast path takes `(name, tensor)` pairs) and for saving the trained actor as a
Hugging Face checkpoint.

`hf_weights` is a collective: every rank of the training group iterates it, in the same order.
A weight is gathered from its tensor-parallel shards (`all_gather` in the TP group) on the
pipeline stage that holds it, then broadcast from that stage to the other stages of the
pipeline group, so every rank sees every full tensor, one at a time (peak memory: one weight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from openrlhf_oppo.megatron import model as mmodel


def _hf_shapes(shape: mmodel.Shape, layer: int) -> dict[str, tuple[int, ...]]:
    h = shape.hidden
    q = shape.heads * shape.head_dim  # query projection width
    kv = shape.kv_heads * shape.head_dim  # key / value projection width
    f = shape.ffn
    p = f"model.layers.{layer}."
    out = {p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
           p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h)}
    if shape.qkv_bias:
        out.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)})
    out.update({p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                p + "mlp.down_proj.weight": (h, f)})
    return out


def _tp_cat(t: torch.Tensor, dim: int) -> torch.Tensor:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    if tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _layer_from_shards(own: dict[str, torch.Tensor], j: int, i: int, shape: mmodel.Shape) -> dict[str, torch.Tensor]:
    """Layer i (local index j) under Hugging Face names, from this stage's shards."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    src, dst = f"decoder.layers.{j}.", f"model.layers.{i}."
    out = {dst + "input_layernorm.weight": own[src + "input_layernorm.weight"]}
    for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
        fused = _tp_cat(own[src + f"self_attention.linear_qkv.{kind}"], 0)
        q, k, v = mmodel._split_qkv(fused, shape, tp)
        out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                    dst + f"self_attn.v_proj.{kind}": v})
    out[dst + "self_attn.o_proj.weight"] = _tp_cat(own[src + "self_attention.linear_proj.weight"], 1)
    out[dst + "post_attention_layernorm.weight"] = own[src + "pre_mlp_layernorm.weight"]
    gate_up = own[src + "mlp.linear_fc1.weight"]
    gate, up = gate_up.chunk(2, dim=0)  # this rank's [gate shard, up shard]
    out[dst + "mlp.gate_proj.weight"] = _tp_cat(gate, 0)
    out[dst + "mlp.up_proj.weight"] = _tp_cat(up, 0)
    out[dst + "mlp.down_proj.weight"] = _tp_cat(own[src + "mlp.linear_fc2.weight"], 1)
    return out


def weight_count(shape: mmodel.Shape) -> int:
    """How many tensors `hf_weights` yields."""
    return 2 + sum(len(_hf_shapes(shape, i)) for i in range(shape.layers)) + (0 if shape.tied else 1)


def hf_weights(module, shape: mmodel.Shape) -> Iterator[tuple[str, torch.Tensor]]:
    """Every Hugging Face weight of the model, full size, on every rank (see the module doc)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    own = {k: v.detach() for k, v in module.state_dict().items() if not k.endswith("._extra_state")}
    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if pp > 1:
        pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    else:
        pp_ranks = [dist.get_rank()]
    dtype = next(iter(own.values())).dtype
    device = next(iter(own.values())).device  # NCCL sends and receives CUDA tensors only
    per_stage = shape.layers // pp

    def from_stage(owner: int, shapes: dict[str, tuple[int, ...]], build: Callable[[], dict[str, torch.Tensor]]):
        if owner == stage:
            tensors = build()
        else:  # filled by the owner's broadcast, on the device the owner's tensors are on
            tensors = {n: torch.empty(s, dtype=dtype, device=device) for n, s in shapes.items()}
        for name in shapes:
            t = tensors[name].contiguous()
            if pp > 1:
                dist.broadcast(t, src=pp_ranks[owner], group=ps.get_pipeline_model_parallel_group())
            yield name, t

    yield from from_stage(0, {"model.embed_tokens.weight": (shape.vocab, shape.hidden)},
                          lambda: {"model.embed_tokens.weight": _tp_cat(own["embedding.word_embeddings.weight"], 0)})
    for i in range(shape.layers):
        owner = i // per_stage
        yield from from_stage(owner, _hf_shapes(shape, i),
                              lambda i=i, owner=owner: _layer_from_shards(own, i - owner * per_stage, i, shape))
    last = pp - 1
    yield from from_stage(last, {"model.norm.weight": (shape.hidden,)},
                          lambda: {"model.norm.weight": own["decoder.final_layernorm.weight"]})
    if not shape.tied:
        yield from from_stage(last, {"lm_head.weight": (shape.vocab, shape.hidden)},
                              lambda: {"lm_head.weight": _tp_cat(own["output_layer.weight"], 0)})


def save_hf(module, shape: mmodel.Shape, hf_config, out_dir: str) -> None:
    """The model as a Hugging Face checkpoint (safetensors and config), written by global rank 0;
    a collective like `hf_weights`. Rank 0 copies each weight to the CPU, where it builds the
    Hugging Face model; the other ranks keep none (a whole model on each GPU would not fit)."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    state = {}
    for name, t in hf_weights(module, shape):  # every rank iterates: each weight is a collective
        if rank0:
            state[name] = t.to("cpu", copy=True)
    if rank0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(hf_config, dtype=next(iter(state.values())).dtype)
        model.load_state_dict(state, strict=True)
        model.save_pretrained(out_dir)
    dist.barrier()
