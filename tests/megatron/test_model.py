"""The Hugging Face <-> Megatron weight layout of `megatron.model`, without processes."""

from __future__ import annotations

import pytest
import torch

from openrlhf_oppo.megatron import model


def _shape(**kw) -> model.Shape:
    base = dict(layers=4, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64, vocab=64, qkv_bias=True, tied=False,
                rope_theta=1e6, eps=1e-6, max_positions=128)
    return model.Shape(**{**base, **kw})


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_qkv_shards_put_each_query_group_with_its_key_and_value(tp):
    shape = _shape()
    q = torch.arange(32 * 3).reshape(32, 3).float()  # 4 heads x head_dim 8 rows
    k, v = -torch.arange(16 * 3).reshape(16, 3).float() - 1, 1000 + torch.arange(16 * 3).reshape(16, 3).float()
    shards = [model._qkv(q, k, v, shape, rank, tp) for rank in range(tp)]
    group0 = shards[0][: 2 * 8 + 8 + 8]  # heads 0-1, then key 0, then value 0
    assert torch.equal(group0, torch.cat([q[:16], k[:8], v[:8]]))
    back = model._split_qkv(torch.cat(shards), shape, tp)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_a_config_the_mapping_does_not_know_is_refused_by_name():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="maps model_type qwen2, llama; this checkpoint is 'gpt2'"):
        model.Shape.of(GPT2Config())


def test_qwen2_and_llama_configs_read_their_bias_and_tying():
    from transformers import LlamaConfig, Qwen2Config

    qwen = model.Shape.of(Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=64))
    llama = model.Shape.of(LlamaConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                       num_hidden_layers=2, vocab_size=64, tie_word_embeddings=True))
    assert (qwen.qkv_bias, qwen.kv_heads, qwen.head_dim) == (True, 2, 8)
    assert (llama.qkv_bias, llama.kv_heads, llama.tied) == (False, 4, True)


@pytest.mark.parametrize(("tp", "pp", "message"), [
    (3, 1, "tensor-parallel size 3 must divide attention heads"),
    (4, 1, "tensor-parallel size 4 must divide key/value heads"),
    (1, 3, "pipeline-parallel size 3 must divide the layers"),
])
def test_a_parallel_layout_that_does_not_divide_the_model_is_refused(tp, pp, message):
    with pytest.raises(ValueError, match=message):
        _shape().check_parallel(tp, pp)


def test_a_checkpoint_of_another_layout_is_refused_naming_both(tmp_path):
    import json
    import types

    from openrlhf_oppo.megatron.engine import MegatronActor

    (tmp_path / "layout.json").write_text(json.dumps({"tp": 2, "pp": 1, "layers": 2, "hidden": 32, "vocab": 64}))
    now = types.SimpleNamespace(_layout=lambda: {"tp": 1, "pp": 2, "layers": 2, "hidden": 32, "vocab": 64})
    with pytest.raises(ValueError, match=r"saved with \{'tp': 2, 'pp': 1.*this run has \{'tp': 1, 'pp': 2"):
        MegatronActor.load(now, tmp_path)
    with pytest.raises(FileNotFoundError, match="no layout.json"):
        MegatronActor.load(now, tmp_path / "missing")


@pytest.mark.parametrize("shard_size", [None, "20KB"], ids=["one-file", "sharded"])
def test_a_checkpoints_weights_are_read_one_at_a_time_from_its_safetensors(tmp_path, shard_size):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(cfg)
    hf.save_pretrained(tmp_path, **({"max_shard_size": shard_size} if shard_size else {}))
    assert len(list(tmp_path.glob("*.safetensors"))) == (1 if shard_size is None else 6)
    weights, state = model.SafetensorsWeights(tmp_path), hf.state_dict()
    assert set(weights) == set(state) and len(weights) == len(state)
    assert all(torch.equal(weights[name], state[name]) for name in state)


def test_a_checkpoint_without_safetensors_is_refused_by_name(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"holds no safetensors weights"):
        model.SafetensorsWeights(tmp_path)
