"""The streaming reward actor's memory: it refuses a model its GPU cannot hold before loading
it (from the checkpoint's headers or config.json: a load would first hold the whole model in host
memory, in every actor), gives freed cache blocks back to the colocated models when samples
finish, and goes through the restart path when a chunk does not fit even alone."""

from __future__ import annotations

import json

import pytest
import torch

from openrlhf_oppo.footprint import params_of_config
from openrlhf_oppo.models.device_memory import OutOfMemoryError, check_fits_device, checkpoint_bytes

GIB = 2**30
# Llama-3-70B's shape: a model no 80 GB GPU holds whole in bf16 (~130 GiB of weights)
LLAMA_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False)


def _actor_module():
    from openrlhf_oppo import compat

    compat.apply()  # the scorer module imports openrlhf, whose model module imports flash_attn
    from openrlhf_oppo.integrations.runtime import scorer

    return scorer


@pytest.fixture
def saved_reward(tiny, tmp_path):
    tiny.reward_model("qwen2").save_pretrained(tmp_path)
    return tmp_path


def test_a_model_larger_than_its_gpu_is_refused_naming_the_flag_and_tensor_parallelism():
    with pytest.raises(ValueError) as exc:
        check_fits_device(140 * GIB, 79 * GIB, 80 * GIB, "--reward.model_name_or_path meta-llama/Llama-3-70B-rm")
    msg = str(exc.value)
    assert "--reward.model_name_or_path meta-llama/Llama-3-70B-rm" in msg and "140.0 GiB" in msg
    assert "79.0 GiB free of 80.0 GiB" in msg
    assert "tensor parallelism for the streamed reward model is not supported" in msg
    assert "--oppo.streaming.enable false" in msg
    check_fits_device(16 * GIB, 79 * GIB, 80 * GIB, "fits")


def test_the_actor_checks_the_size_before_moving_the_model_to_the_gpu(saved_reward, monkeypatch):
    scorer = _actor_module()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (1024, 2048))  # a 2 KiB "GPU"
    moved = []
    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: moved.append(a) or self)
    with pytest.raises(ValueError, match=f"--reward.model_name_or_path {saved_reward}: .* 0.0 GiB free"):
        scorer.StreamingRewardActor(str(saved_reward), 0, False, "score")
    assert moved == []


def test_checkpoint_bytes_come_from_the_headers_and_equal_the_loaded_weights(tiny, tmp_path):
    model = tiny.reward_model("qwen2")
    model.save_pretrained(tmp_path / "one")  # fp32 on disk, loaded in bf16: counted in bf16
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    loaded = sum(p.numel() * 2 for p in model.parameters())
    assert checkpoint_bytes(tmp_path / "one", torch.bfloat16, lm_head=False) == loaded
    assert checkpoint_bytes(tmp_path / "sharded", torch.bfloat16, lm_head=False) == loaded
    assert checkpoint_bytes(tmp_path / "one", torch.float32, lm_head=False) == 2 * loaded
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text((tmp_path / "one" / "config.json").read_text())
    from_config = checkpoint_bytes(tmp_path / "config", torch.bfloat16, lm_head=False)
    assert abs(from_config - loaded) <= 0.02 * loaded  # norms and biases left out


def _config_only(path, architectures: list[str], **extra) -> str:
    """A checkpoint directory with config.json and no weights: a load would fail, a refusal must not need one."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**LLAMA_70B, "architectures": architectures, **extra}))
    return str(path)


def _a_gpu_of(monkeypatch, free_gib: float, total_gib: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free_gib * GIB), int(total_gib * GIB)))


@pytest.mark.parametrize("layout", ["transformers", "openrlhf"])
def test_a_reward_model_too_large_for_its_gpu_is_refused_before_any_weight_is_loaded(tmp_path, monkeypatch, layout):
    scorer = _actor_module()
    from openrlhf_oppo.models import loaders

    if layout == "transformers":
        path = _config_only(tmp_path / "rm", ["LlamaForSequenceClassification"], num_labels=1)
    else:
        path = _config_only(tmp_path / "rm", ["RewardModel"], value_head_prefix="score", mean=0.0, std=1.0)
    loads = []
    monkeypatch.setattr(loaders, "_load_state_dict", lambda *a, **k: loads.append(a))
    monkeypatch.setattr(loaders.AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: loads.append(a))
    _a_gpu_of(monkeypatch, 79, 80)
    with pytest.raises(ValueError) as exc:
        scorer.StreamingRewardActor(path, 0, False, "score", param_dtype="bf16")
    need = params_of_config(type("C", (), LLAMA_70B)(), lm_head=False) * 2
    msg = str(exc.value)
    assert msg.startswith(f"--reward.model_name_or_path {path}: the streamed reward model needs {need / GIB:.1f} GiB")
    assert "79.0 GiB free of 80.0 GiB" in msg and "--oppo.streaming.enable false" in msg
    assert loads == []


def test_a_reference_too_large_for_its_gpu_is_refused_before_any_weight_is_loaded(tmp_path, monkeypatch):
    scorer = _actor_module()
    import transformers

    path = _config_only(tmp_path / "actor", ["LlamaForCausalLM"])
    loads = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: loads.append(a))
    _a_gpu_of(monkeypatch, 79, 80)
    with pytest.raises(ValueError) as exc:
        scorer.StreamingReferenceActor(path, 0, 1.0, param_dtype="bf16")
    need = params_of_config(type("C", (), LLAMA_70B)(), lm_head=True) * 2
    msg = str(exc.value)
    assert msg.startswith(f"--actor.model_name_or_path {path} (the streamed reference): the streamed reference "
                          f"needs {need / GIB:.1f} GiB")
    assert "--oppo.streaming.reference false" in msg and "--ref.num_gpus_per_node" in msg
    assert loads == []


def test_finishing_samples_empties_the_cuda_cache(saved_reward, monkeypatch):
    scorer = _actor_module()
    actor = scorer.StreamingRewardActor(str(saved_reward), 64, False, "score")
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    actor.open_many({1: [5, 6, 7], 2: [8, 9]})
    actor.process({1: [10], 2: [11]}, {})
    assert emptied == []  # nothing freed: no allocator call on the hot path
    reply = actor.process({}, {1: [12]})
    assert set(reply.scores) == {1} and emptied == [1]


def test_an_out_of_memory_that_survives_eviction_exits_for_rays_restart(saved_reward, monkeypatch):
    scorer = _actor_module()
    actor = scorer.StreamingRewardModelActor.__new__(scorer.StreamingRewardModelActor)
    actor.streaming = scorer.StreamingRewardActor(str(saved_reward), 64, False, "score")
    actor.streaming.open_many({1: [5, 6, 7]})

    def out_of_memory(*args, **kwargs):
        raise OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(actor.streaming.scorer.parts.backbone, "forward", out_of_memory)

    class Exited(Exception):
        pass

    def exit_(code):
        raise Exited(code)

    monkeypatch.setattr(scorer.os, "_exit", exit_)
    with pytest.raises(Exited) as exc:
        actor.process({1: [10, 11]}, {})
    assert exc.value.args == (1,)
