"""A Hugging Face causal LM (the Qwen2 and Llama families) as a Megatron-Core `GPTModel`
sharded for this rank's tensor- and pipeline-parallel position, and back.

Built with Megatron-Core's local layer spec (pure torch: no Transformer Engine, no apex) so
the same code runs on a GPU and, under `compat.megatron_cpu.on_cpu()`, on a CPU. Weights
map by name (our own mapping, no bridge library):

| Hugging Face | Megatron-Core | split across TP ranks |
|---|---|---|
| `model.embed_tokens.weight` | `embedding.word_embeddings.weight` | vocabulary rows |
| `layers.i.input_layernorm.weight` | `decoder.layers.j.input_layernorm.weight` | copied |
| `layers.i.self_attn.{q,k,v}_proj.*` | `decoder.layers.j.self_attention.linear_qkv.*` | query groups: [q, k, v] each |
| `layers.i.self_attn.o_proj.weight` | `decoder.layers.j.self_attention.linear_proj.weight` | input columns |
| `layers.i.post_attention_layernorm.weight` | `decoder.layers.j.pre_mlp_layernorm.weight` | copied |
| `layers.i.mlp.{gate,up}_proj.weight` | `decoder.layers.j.mlp.linear_fc1.weight` | [gate shard, up shard] per rank |
| `layers.i.mlp.down_proj.weight` | `decoder.layers.j.mlp.linear_fc2.weight` | input columns |
| `model.norm.weight` | `decoder.final_layernorm.weight` | copied |
| `lm_head.weight` | `output_layer.weight` | vocabulary rows |

`i` is the global layer, `j` its index on this pipeline stage; the first stage holds the
embedding, the last the final norm and the output layer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")


@dataclass(frozen=True)
class Shape:
    """What the mapping needs of a Hugging Face config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    qkv_bias: bool
    tied: bool
    rope_theta: float
    eps: float
    max_positions: int

    @classmethod
    def of(cls, hf_config) -> Shape:
        kind = getattr(hf_config, "model_type", None)
        if kind not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the Megatron backend maps model_type {', '.join(SUPPORTED_MODEL_TYPES)}; "
                             f"this checkpoint is {kind!r}")
        heads = hf_config.num_attention_heads
        rope = getattr(hf_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return cls(layers=hf_config.num_hidden_layers, hidden=hf_config.hidden_size, heads=heads,
                   kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                   ffn=hf_config.intermediate_size, vocab=hf_config.vocab_size,
                   qkv_bias=kind == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
                   tied=bool(getattr(hf_config, "tie_word_embeddings", False)), rope_theta=float(theta),
                   eps=hf_config.rms_norm_eps, max_positions=hf_config.max_position_embeddings)

    def check_parallel(self, tp: int, pp: int) -> None:
        for what, n in (("attention heads", self.heads), ("key/value heads", self.kv_heads),
                        ("the vocabulary", self.vocab), ("the MLP width", self.ffn)):
            if n % tp:
                raise ValueError(f"tensor-parallel size {tp} must divide {what} ({n})")
        if self.layers % pp:
            raise ValueError(f"pipeline-parallel size {pp} must divide the layers ({self.layers})")


def transformer_config(shape: Shape, dtype: torch.dtype, tp: int, pp: int):
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim, ffn_hidden_size=shape.ffn,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
        normalization="RMSNorm", layernorm_epsilon=shape.eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, sequence_parallel=False,
    )


def build(shape: Shape, dtype: torch.dtype = torch.float32):
    """This rank's `GPTModel` (its pipeline stage, its tensor-parallel shards), weights uninitialised
    until `load_hf`. Model parallel groups must be initialised."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    shape.check_parallel(tp, pp)
    return GPTModel(
        config=transformer_config(shape, dtype, tp, pp),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=shape.vocab, max_sequence_length=shape.max_positions,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=shape.tied, position_embedding_type="rope",
        rotary_base=int(shape.rope_theta), parallel_output=True,
    ).to(dtype)


def _rows(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=0)[rank]


def _cols(t: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    return t.chunk(tp, dim=1)[rank]


def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: Shape, rank: int, tp: int) -> torch.Tensor:
    """[q heads of group g, k of g, v of g] for each query group of this rank (Megatron's layout)."""
    per_group = shape.heads // shape.kv_heads
    rest = q.shape[1:]
    q = q.reshape(shape.kv_heads, per_group * shape.head_dim, *rest)
    k = k.reshape(shape.kv_heads, shape.head_dim, *rest)
    v = v.reshape(shape.kv_heads, shape.head_dim, *rest)
    fused = torch.cat([q, k, v], dim=1)  # (groups, (per_group + 2) * head_dim, ...)
    return _rows(fused, rank, tp).reshape(-1, *rest)


def _split_qkv(fused: torch.Tensor, shape: Shape, tp: int) -> tuple[torch.Tensor, ...]:
    """The inverse of `_qkv` over all ranks' shards concatenated along rows."""
    per_group = shape.heads // shape.kv_heads
    rest = fused.shape[1:]
    g = fused.reshape(shape.kv_heads, (per_group + 2) * shape.head_dim, *rest)
    q, k, v = g.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _stage_layers(shape: Shape) -> range:
    from megatron.core import parallel_state as ps

    pp, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    per = shape.layers // pp
    return range(stage * per, (stage + 1) * per)


def megatron_state(hf: Mapping[str, torch.Tensor], shape: Shape) -> dict[str, torch.Tensor]:
    """This rank's Megatron state dict from a full Hugging Face state dict."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    out: dict[str, torch.Tensor] = {}
    if ps.is_pipeline_first_stage():
        out["embedding.word_embeddings.weight"] = _rows(hf["model.embed_tokens.weight"], rank, tp)
    for j, i in enumerate(_stage_layers(shape)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{j}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            out[dst + f"self_attention.linear_qkv.{kind}"] = _qkv(
                hf[attn + f"q_proj.{kind}"], hf[attn + f"k_proj.{kind}"], hf[attn + f"v_proj.{kind}"], shape, rank, tp)
        out[dst + "self_attention.linear_proj.weight"] = _cols(hf[attn + "o_proj.weight"], rank, tp)
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        gate, up = hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([_rows(gate, rank, tp), _rows(up, rank, tp)])
        out[dst + "mlp.linear_fc2.weight"] = _cols(hf[src + "mlp.down_proj.weight"], rank, tp)
    if ps.is_pipeline_last_stage():
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        if not shape.tied:
            out["output_layer.weight"] = _rows(hf["lm_head.weight"], rank, tp)
        elif not ps.is_pipeline_first_stage():  # a later stage's own copy of the tied embedding
            out["output_layer.weight"] = _rows(hf["model.embed_tokens.weight"], rank, tp)
    return out


class SafetensorsWeights(Mapping):
    """A Hugging Face checkpoint directory's weights, each read from its safetensors file when
    asked for: a rank reads only its pipeline stage's layers, one tensor at a time, instead of
    loading the whole model (145 GB for a 72B model in bf16) on every rank."""

    def __init__(self, checkpoint: str | Path):
        """`checkpoint`: a local directory, or a hub id (`models.loaders.resolve_model_path`)."""
        from openrlhf_oppo.models.loaders import resolve_model_path

        directory = resolve_model_path(checkpoint)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            names = json.loads(index.read_text())["weight_map"]
            self._files = {name: directory / file for name, file in names.items()}
        elif (directory / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(directory / "model.safetensors", "pt") as f:
                self._files = dict.fromkeys(f.keys(), directory / "model.safetensors")
        else:
            raise FileNotFoundError(f"{directory} holds no safetensors weights (model.safetensors or "
                                    "model.safetensors.index.json): the Megatron backend reads those")

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._files[name], "pt") as f:
            return f.get_tensor(name)

    def __iter__(self):
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)


def load_hf(model, hf: Mapping[str, torch.Tensor], shape: Shape) -> None:
    """Copy a full Hugging Face state dict into this rank's shards; every Megatron weight must be set."""
    state = megatron_state(hf, shape)
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    missing = sorted(set(own) - set(state))
    if missing:
        raise KeyError(f"no Hugging Face weight maps to {missing[:4]}{'...' if len(missing) > 4 else ''}")
    with torch.no_grad():
        for name, value in state.items():
            if name not in own:
                raise KeyError(f"{name} is not a weight of this Megatron model stage")
            own[name].copy_(value.to(own[name].dtype))
