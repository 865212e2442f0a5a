"""The colocated-layout memory check: 7B-like checkpoints (a config.json, no
weights) on a fake 80 GB GPU, through `preflight.check_config` as both entry points run it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_oppo import footprint, run_env
from openrlhf_oppo.integrations.launch import memory_check, preflight, yaml_config

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "tiny-cpu.yaml"
QWEN_7B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
           "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}


def make_layout(tmp_path: Path, gpus: int = 8) -> dict:
    """The tiny task's flags with 7B actor and reward checkpoints, every group and vLLM (4 x TP 2)
    on the same `gpus` GPUs, and batch sizes that DeepSpeed takes at that data-parallel size."""
    for name in ("actor", "reward"):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text(json.dumps(QWEN_7B))
    flags = dict(yaml_config.load(CONFIG).flags)
    flags.update({"actor.model_name_or_path": str(tmp_path / "actor"),
                  "reward.model_name_or_path": str(tmp_path / "reward"),
                  "train.colocate_all": True, "vllm.num_engines": gpus // 2, "vllm.tensor_parallel_size": 2,
                  "rollout.batch_size": 16, "train.batch_size": 32})
    for group in ("actor", "critic", "ref", "reward"):
        flags[f"{group}.num_gpus_per_node"] = gpus
    return flags


def check(flags: dict, util: float, budget: int) -> None:
    preflight.check_config({**flags, "vllm.gpu_memory_utilization": util},
                           ["--oppo.streaming.kv_budget_tokens", str(budget)], oppo=True)


@pytest.fixture
def gpu_80gb(monkeypatch):
    monkeypatch.setenv(run_env.DEVICE_MEMORY_GB, "80")


def test_qwen_7b_params_from_its_config_match_the_published_count():
    from transformers import AutoConfig

    # Qwen2.5-7B: 7.61 B parameters (biases and norms, left out here, are under 0.1 %)
    assert footprint.params_of_config(AutoConfig.for_model(**QWEN_7B)) / 1e9 == pytest.approx(7.61, abs=0.01)


def test_a_colocated_7b_layout_at_vllms_default_share_is_refused_naming_the_flags_and_what_fits(tmp_path, gpu_80gb):
    with pytest.raises(ValueError) as err:
        check(make_layout(tmp_path), util=0.95, budget=65536)
    message = str(err.value)
    for flag in ("--train.colocate_all", "--vllm.gpu_memory_utilization", "--oppo.streaming.kv_budget_tokens"):
        assert flag in message
    # hand-computed, per GPU: actor 16 B x 7.62e9 / 8 = 15.2 GB, critic and reward 7.07e9 params (no LM head),
    # reference 1.9, streamed reward 14.1 + 65,536 x 57,344 B = 3.8 + forward 1.9, live 2, reserve 4: 57.0 GB
    assert "--vllm.gpu_memory_utilization 0.28 or lower" in message
    assert "80.0 GB, OPPO_DEVICE_MEMORY_GB" in message


def test_the_same_layout_fits_with_the_share_the_message_offered(tmp_path, gpu_80gb, capsys):
    check(make_layout(tmp_path), util=0.28, budget=65536)
    assert "of 80.0 GB per GPU" in capsys.readouterr().out


def test_with_async_enable_vllm_has_gpus_of_its_own_and_the_refused_layout_fits(tmp_path, gpu_80gb, capsys):
    # OPPO's async admission in OpenRLHF's async layout: the DeepSpeed models and the streaming reward
    # actors share the 8 GPUs, vLLM is not on them: the items hand-computed above, unrounded
    # 15.24 + 14.14 + 1.91 + 14.14 + 3.76 + 1.88 + 2 + 4 = 57.06 GB, without vLLM's 0.95 x 80
    check({**make_layout(tmp_path), "train.async_enable": True}, util=0.95, budget=65536)
    assert "57.1 of 80.0 GB per GPU" in capsys.readouterr().out


def test_a_background_sync_buffer_is_counted_as_the_actors_whole_bf16_weights(tmp_path, gpu_80gb, capsys):
    # the async layout above plus 2 B x 7.62e9 parameters = 15.24 GB: 57.06 + 15.24 = 72.30 GB
    flags = {**make_layout(tmp_path), "train.async_enable": True, "vllm.gpu_memory_utilization": 0.95}
    preflight.check_config(flags, ["--oppo.streaming.kv_budget_tokens", "65536", "--oppo.staleness.max_policy_lag",
                                   "2", "--oppo.staleness.background_sync", "true"], oppo=True)
    assert "72.3 of 80.0 GB per GPU" in capsys.readouterr().out


@pytest.mark.parametrize(("buffer", "total"), [
    # the async layout above plus the embedding, 2 B x 3,584 x 152,064 = 1.09 GB: 57.06 + 1.09 = 58.15 GB
    ("host", "58.1"),
    # plus 1/8 of 2 B x 7.62e9 parameters, 1.90 GB: 57.06 + 1.90 = 58.96 GB
    ("shards", "59.0"),
])
def test_a_host_or_sharded_buffer_leaves_the_gpu_a_parameter_or_its_partition(tmp_path, gpu_80gb, capsys, buffer,
                                                                             total):
    flags = {**make_layout(tmp_path), "train.async_enable": True, "vllm.gpu_memory_utilization": 0.95}
    preflight.check_config(flags, ["--oppo.streaming.kv_budget_tokens", "65536", "--oppo.staleness.max_policy_lag",
                                   "2", "--oppo.staleness.background_sync", "true",
                                   "--oppo.staleness.background_sync_buffer", buffer], oppo=True)
    assert f"{total} of 80.0 GB per GPU" in capsys.readouterr().out


def test_a_budget_too_large_for_what_vllm_leaves_is_refused_with_the_budget_that_fits(tmp_path, gpu_80gb):
    with pytest.raises(ValueError, match=r"--oppo.streaming.kv_budget_tokens [\d,]+ or lower"):
        check(make_layout(tmp_path), util=0.28, budget=200_000)


def test_a_colocated_streaming_reward_needs_an_explicit_kv_budget(tmp_path, gpu_80gb):
    with pytest.raises(ValueError, match=r"needs an explicit --oppo.streaming.kv_budget_tokens"):
        check(make_layout(tmp_path), util=0.28, budget=0)


def test_on_cpu_there_is_no_device_memory_and_nothing_is_refused(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.delenv(run_env.DEVICE_MEMORY_GB, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check(make_layout(tmp_path), util=0.95, budget=0)
    assert "no device memory to check" in capsys.readouterr().out


def test_layouts_that_are_not_colocated_are_not_checked(tmp_path, gpu_80gb, capsys):
    check({**make_layout(tmp_path), "train.colocate_all": False}, util=0.95, budget=0)
    assert memory_check.NOTE not in capsys.readouterr().out


def test_a_device_memory_that_is_not_a_number_names_the_variable():
    with pytest.raises(ValueError, match=run_env.DEVICE_MEMORY_GB):
        memory_check.device_memory({run_env.DEVICE_MEMORY_GB: "80GB"})


def test_the_hybrid_engine_fits_what_vllm_awake_beside_the_training_does_not(tmp_path, gpu_80gb, capsys):
    """Half the GPU for vLLM: 40 GB beside the 57 GB the training side needs is refused, naming
    the hybrid engine's flags; with them vLLM (40) meets only the actor's and critic's bf16
    weights (1.9 + 1.8), the reference (1.9), the streaming reward actor (19.8) and the reserve
    (4): 69.4 GB while generating, and the training phase needs the 57.0 GB without vLLM."""
    with pytest.raises(ValueError, match=r"--vllm\.enable_sleep --ds\.enable_sleep \(OpenRLHF's hybrid engine"):
        check(make_layout(tmp_path), util=0.5, budget=65536)
    hybrid = {**make_layout(tmp_path), "vllm.enable_sleep": True, "ds.enable_sleep": True}
    check(hybrid, util=0.5, budget=65536)
    assert "69.4 of 80.0 GB per GPU at most (while vLLM generates" in capsys.readouterr().out


def test_asleep_vllm_is_no_remedy_when_the_training_phase_overflows(tmp_path, gpu_80gb):
    hybrid = {**make_layout(tmp_path, gpus=2), "vllm.num_engines": 1, "vllm.enable_sleep": True,
              "ds.enable_sleep": True}  # 7B ZeRO-3 states over 2 GPUs: 61 GB for the actor alone
    with pytest.raises(ValueError, match=r"at least [\d.]+ GB while the models train") as err:
        check(hybrid, util=0.3, budget=65536)
    assert "--vllm.gpu_memory_utilization" not in str(err.value).split("What would fit")[1]


def test_the_hybrid_engine_preset_fits_80_gb_gpus_and_would_not_awake(tmp_path, gpu_80gb, capsys):
    """configs/cluster/qwen2.5-7b-hybrid-8gpu.yaml with its hub models replaced by 7B configs
    (Qwen2.5-7B's shape for the actor and the reward model): 77.4 GB while vLLM generates, as
    its comment says; without the sleep flags the same layout is refused."""
    preset = dict(yaml_config.load(CONFIG.parent / "cluster" / "qwen2.5-7b-hybrid-8gpu.yaml").flags)
    layout = make_layout(tmp_path)
    preset.update({k: layout[k] for k in ("actor.model_name_or_path", "reward.model_name_or_path")})
    argv = ["--oppo.streaming.kv_budget_tokens", "65536"]
    preflight.check_config(preset, argv, oppo=True)
    assert "77.4 of 80.0 GB per GPU at most (while vLLM generates" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"--vllm\.enable_sleep --ds\.enable_sleep \(OpenRLHF's hybrid engine"):
        preflight.check_config({**preset, "vllm.enable_sleep": False, "ds.enable_sleep": False}, argv, oppo=True)


def test_a_streamed_reference_is_counted_whole_on_each_gpu_not_as_a_zero3_shard(tmp_path, gpu_80gb):
    """With --oppo.streaming.reference the 1.9 GB ZeRO-3 shard of the reference becomes a streaming
    reference actor on each GPU: 7.62e9 params x 2 B = 15.2 GB, its KV budget 65,536 x 57,344 B =
    3.8 GB and forward 1.9 GB: 57.0 - 1.9 + 20.9 = 76.0 GB (76.04 unrounded) beside vLLM, so the
    share that fitted without it (0.28) is refused and at most floor((80 - 76.04) / 80, 2) = 0.04
    is offered."""
    argv = ["--oppo.streaming.kv_budget_tokens", "65536", "--oppo.streaming.reference", "true"]
    with pytest.raises(ValueError) as err:
        preflight.check_config({**make_layout(tmp_path), "vllm.gpu_memory_utilization": 0.28}, argv, oppo=True)
    message = str(err.value)
    assert "streaming reference weights x 1 15.2" in message and "reference 1.9" not in message
    assert "would need at least 98.4 GB" in message  # + vLLM's 0.28 x 80 = 22.4
    assert "--vllm.gpu_memory_utilization 0.04 or lower" in message
