"""The launch-time memory check: every GPU kind of a layout, per phase, every model counted from
its config.json or the shipped shape table; hand-computed figures on the shipped presets and on
7B-like checkpoints (a config.json, no weights) on an 80 GB GPU, through `preflight.check_config`
as both entry points run it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openrlhf_oppo import footprint, run_env
from openrlhf_oppo.integrations.launch import memory_check, model_shapes, preflight, yaml_config
from openrlhf_oppo.integrations.launch.memory_check import (
    EXPERIENCE,
    GB,
    GENERATING,
    TRAINING,
    TRAINING_ACTOR,
    TRAINING_CRITIC,
    Device,
)

REPO = Path(__file__).resolve().parents[3]
CONFIG = REPO / "configs" / "tiny-cpu.yaml"
CLUSTER = REPO / "configs" / "cluster"
GPU_80 = Device(80 * GB, "a test's 80 GB GPU")
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


def check(flags: dict, util: float, budget: int, *extra: str) -> None:
    preflight.check_config({**flags, "vllm.gpu_memory_utilization": util},
                           ["--oppo.streaming.kv_budget_tokens", str(budget), *extra], oppo=True)


def preset_count(name: str, *extra: str, device: Device = GPU_80) -> memory_check.Count:
    """The check's count of a shipped preset (its hub ids resolved from the shape table)."""
    v, cfg = preflight.resolve({}, ["--config", str(CLUSTER / name), *extra], oppo=True)
    return memory_check.count(v, cfg, device)


def kind_with(result: memory_check.Count, part: str) -> memory_check.GpuKind:
    (kind,) = [k for k in result.kinds if k.name.startswith(part)]
    return kind


def item(kind: memory_check.GpuKind, starts: str) -> memory_check.Item:
    (found,) = [i for i in kind.items if i.what.startswith(starts)]
    return found


@pytest.fixture
def gpu_80gb(monkeypatch):
    monkeypatch.setenv(run_env.DEVICE_MEMORY_GB, "80")


@pytest.fixture
def no_gpu(monkeypatch):
    """No OPPO_DEVICE_MEMORY_GB and no CUDA device: only a preset's `device:` says."""
    import torch

    monkeypatch.delenv(run_env.DEVICE_MEMORY_GB, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ------------------------------------------------------------------------------ shapes


@pytest.mark.parametrize(("name", "billions"), [
    # the parameter counts the models' cards publish (biases and norms, left out here, are under 0.1 %)
    ("Qwen/Qwen2.5-1.5B-Instruct", 1.54), ("Qwen/Qwen2.5-3B-Instruct", 3.09), ("Qwen/Qwen2.5-7B-Instruct", 7.61),
    ("Qwen/Qwen2.5-72B-Instruct", 72.7), ("OpenRLHF/Llama-3-8b-sft-mixture", 8.03), ("nvidia/AceMath-7B-RM", 7.61),
])
def test_the_shape_table_gives_each_models_published_parameter_count(name, billions):
    assert model_shapes.SHAPES[name].params() / 1e9 == pytest.approx(billions, abs=0.01)


def test_the_shape_table_agrees_with_the_simulators_catalog():
    import yaml

    catalog = yaml.safe_load((REPO / "openrlhf_oppo" / "sim" / "presets" / "models.yaml").read_text())
    for hub, name in (("Qwen/Qwen2.5-3B-Instruct", "qwen2.5-3b"), ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
                      ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"), ("nvidia/AceMath-7B-RM", "qwen2.5-math-7b")):
        shape, sim = model_shapes.SHAPES[hub], catalog[name]
        assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab,
                shape.tied) == (sim["layers"], sim["hidden"], sim["heads"], sim["kv_heads"], sim["intermediate"],
                                sim["vocab"], sim["tied_embeddings"])


def test_qwen_7b_params_from_its_config_match_the_published_count():
    from transformers import AutoConfig

    # Qwen2.5-7B: 7.61 B parameters (biases and norms, left out here, are under 0.1 %)
    assert footprint.params_of_config(AutoConfig.for_model(**QWEN_7B)) / 1e9 == pytest.approx(7.61, abs=0.01)


def test_a_local_config_json_wins_over_the_table_and_an_unknown_hub_id_is_not_found(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN_7B, "num_hidden_layers": 2}))
    shape, where = model_shapes.find(str(tmp_path))
    assert shape.layers == 2 and where == str(tmp_path / "config.json")
    assert model_shapes.find("Qwen/Qwen2.5-7B-Instruct") == (model_shapes.SHAPES["Qwen/Qwen2.5-7B-Instruct"],
                                                             model_shapes.TABLE)
    shape, why = model_shapes.find("someone/Unknown-13B")
    assert shape is None and "not in the shipped table" in why


# ---------------------------------------------------------------- the shipped presets


def test_the_hybrid_preset_counts_every_model_while_generating_by_hand():
    """configs/cluster/qwen2.5-7b-hybrid-8gpu.yaml names hub ids only; the check used to count
    vLLM and the reserve alone. Per GPU while vLLM generates: vLLM 0.45 x 80 = 36.0; the actor's
    and reference's bf16 ZeRO-3 shards 2 B x 7.615e9 / 8 = 1.904 each, the critic's 2 B x 7.070e9
    / 8 = 1.768 (its optimizer states on the host: --ds.enable_sleep); the streaming reward actor
    2 B x 7.070e9 = 14.141, its KV budget 65,536 x 57,344 B = 3.758, its forward 2 x 16,384 x
    57,344 B = 1.879 of KV copies + 2 x 16,384 x (3 x 18,944 + 4 x 3,584) B = 2.332 of one layer;
    reserve 4 + 3 x 0.5 (actor, reference, critic, reward actor: four processes) = 5.5:
    69.186 GB, 10.8 GB (13.5 %) left."""
    result = preset_count("qwen2.5-7b-hybrid-8gpu.yaml")
    assert result.counted and result.phases == (GENERATING, EXPERIENCE, TRAINING_CRITIC, TRAINING_ACTOR)
    (kind,) = result.kinds
    assert kind.gpus == 8
    assert kind.need(GENERATING) / GB == pytest.approx(69.186, abs=0.002)
    assert result.tightest()[1] == GENERATING and result.margin() == pytest.approx(0.135, abs=0.001)


def test_the_hybrid_preset_while_the_actor_trains_by_hand():
    """vLLM asleep; the actor's gradients and Adam states back, 14 B x 7.615e9 / 8 = 13.327; its
    activations at 4 x 2,048 = 8,192 tokens with checkpointing: layer inputs 2 x 28 x 8,192 x
    3,584 = 1.644, one layer 2 x 8,192 x (10 x 3,584 + 4 x 18,944) = 1.829, fp32 logits and their
    gradient 8 x 8,192 x 152,064 = 9.966; live parameters 2; the rest as while generating without
    vLLM: 1.904 x 2 + 1.768 + 14.141 + 3.758 + 4.211 + 5.5 = 33.186. 61.952 GB."""
    (kind,) = preset_count("qwen2.5-7b-hybrid-8gpu.yaml").kinds
    assert kind.need(TRAINING_ACTOR) / GB == pytest.approx(61.952, abs=0.002)
    assert item(kind, "critic grads + Adam").phases == frozenset({TRAINING_CRITIC})


def test_experience_making_counts_the_largest_forward_not_their_sum():
    """Colocated forwards take turns (OpenRLHF empties each model's cache after it): the actor's
    log-prob forward at 8 x 2,048 tokens, 6 B x 16,384 x 152,064 of logits = 14.948 + one layer
    2.332 + live parameters 2 = 19.280, counts; the reference's equal one and the critic's do not."""
    (kind,) = preset_count("qwen2.5-7b-hybrid-8gpu.yaml").kinds
    forwards = [i for i in kind.items if i.in_turn]
    assert {i.what.split(" forward")[0] for i in forwards} == {"actor", "reference", "critic"}
    assert item(kind, "actor forward").bytes / GB == pytest.approx(19.280, abs=0.002)
    steady = sum(i.bytes for i in kind.items if not i.in_turn and kind.present(i, EXPERIENCE))
    assert kind.need(EXPERIENCE) - steady == item(kind, "actor forward").bytes


def test_the_megatron_preset_shards_the_actor_over_tp_and_pp_by_hand():
    """Qwen2.5-72B at TP 8 x PP 4 over 32 ranks (DP 1): the first stage holds 20 layers of
    877,658,112 parameters and the embedding, 152,064 x 8,192 = 1,245,708,288: 18.799e9 / 8 ranks =
    2.350e9, at 2 + 4 + 12 B = 42.297 GB. Its activations at --data.max_len 1,536, micro-batch 1:
    8 s h + 8 s h / 8 + 6 x 8 heads x s^2 + 6 s x 29,568 / 8 = 260.55 MB a layer, x 20 layers x
    4 micro-batches in flight = 20.844 GB."""
    kind = kind_with(preset_count("qwen2.5-72b-megatron-64gpu.yaml"), "actor (Megatron)")
    assert kind.gpus == 32
    assert item(kind, "actor states (Megatron TP 8 PP 4 DP 1)").bytes / GB == pytest.approx(42.297, abs=0.001)
    assert item(kind, "actor activations").bytes / GB == pytest.approx(20.844, abs=0.001)
    assert item(kind, "actor activations").phases == frozenset({TRAINING})


def test_megatrons_layer_activations_are_within_5_percent_of_korthikanti_et_al():
    s, b, h, a, t = 2048, 1, 8192, 64, 8
    published = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert footprint.megatron_layer_activation_bytes(b, s, h, a, 29568, t) == pytest.approx(published, rel=0.05)


def test_a_split_layout_counts_each_kind_of_gpu_apart():
    """configs/cluster/qwen2.5-7b-8gpu.yaml: vLLM on 3 GPUs, actor + reference on 4, the reward
    actor alone on the eighth with its automatic KV budget: half of what its weights (14.141) and
    reserve (4) leave of 80 GB, 30.930 GB."""
    result = preset_count("qwen2.5-7b-8gpu.yaml")
    assert [k.gpus for k in result.kinds] == [3, 4, 1]
    vllm, training, reward = result.kinds
    assert vllm.need(GENERATING) / GB == pytest.approx(0.9 * 80 + 1)
    assert item(training, "reference (ZeRO-3, 1/4)").bytes / GB == pytest.approx(2 * 7.615283200 / 4)
    assert item(reward, "streaming reward KV (automatic)").bytes / GB == pytest.approx((80 - 14.140572 - 4) / 2)


@pytest.mark.parametrize(("buffer", "added"), [
    # the actor's whole bf16 weights, 2 B x 7.615e9; the largest parameter, 2 B x 3,584 x 152,064;
    # 1/7 of the weights
    ("device", 15.231), ("host", 1.090), ("shards", 2.176),
])
def test_a_background_sync_buffer_adds_the_weights_a_parameter_or_a_partition(buffer, added):
    base = kind_with(preset_count("qwen2.5-7b-async-8gpu.yaml"), "actor")
    synced = kind_with(preset_count("qwen2.5-7b-async-8gpu.yaml", "--oppo.staleness.background_sync", "true",
                                    "--oppo.staleness.background_sync_buffer", buffer), "actor")
    assert (synced.need(TRAINING) - base.need(TRAINING)) / GB == pytest.approx(added, abs=0.001)


def test_adam_offload_leaves_the_gradients_on_the_gpu():
    """--ds.adam_offload: fp32 master weights and moments on the host; the GPU keeps the bf16
    gradients' shard, 2 B x 7.615e9 / 4 = 3.808 GB, in place of 14 B."""
    kind = kind_with(preset_count("qwen2.5-7b-8gpu.yaml", "--ds.adam_offload"), "actor")
    assert item(kind, "actor grads (Adam on the host)").bytes / GB == pytest.approx(3.808, abs=0.001)


# ----------------------------------------------------------------- refusals and notes


def test_a_colocated_7b_layout_at_vllms_default_share_is_refused_naming_the_flags_and_what_fits(tmp_path, gpu_80gb):
    with pytest.raises(ValueError) as err:
        check(make_layout(tmp_path), util=0.95, budget=65536)
    message = str(err.value)
    assert "would need" in message and "80.0 GB (OPPO_DEVICE_MEMORY_GB)" in message
    offered = float(message.split("--vllm.gpu_memory_utilization ")[1].split(" or lower")[0])
    assert "--vllm.enable_sleep --ds.enable_sleep" in message
    check(make_layout(tmp_path), util=offered, budget=65536)  # the share it offers fits


def test_asleep_vllm_is_no_remedy_when_the_training_phase_overflows(tmp_path, gpu_80gb):
    hybrid = {**make_layout(tmp_path, gpus=2), "vllm.num_engines": 1, "vllm.enable_sleep": True,
              "ds.enable_sleep": True}  # 7B ZeRO-3 states over 2 GPUs: 61 GB for the actor alone
    with pytest.raises(ValueError, match=r"would need [\d.]+ GB training actor") as err:
        check(hybrid, util=0.3, budget=65536)
    assert "--vllm.gpu_memory_utilization" not in str(err.value).split("What would fit")[1]


def test_a_colocated_streaming_reward_needs_an_explicit_kv_budget(tmp_path, gpu_80gb):
    with pytest.raises(ValueError, match=r"needs an explicit --oppo.streaming.kv_budget_tokens"):
        check(make_layout(tmp_path), util=0.28, budget=0)


def test_a_streamed_reference_beside_the_actor_needs_an_explicit_kv_budget(gpu_80gb):
    """--train.colocate_actor_ref with --oppo.streaming.reference: each reference actor would size
    its budget from mem_get_info() while the actor's ZeRO-3 initialisation runs on its GPU."""
    argv = ["--config", str(CLUSTER / "qwen2.5-7b-8gpu.yaml"), "--oppo.streaming.reference", "true"]
    with pytest.raises(ValueError, match=r"a streaming reference actor beside the actor \(--train.colocate_actor_ref\) "
                                         r"needs an explicit --oppo.streaming.kv_budget_tokens"):
        preflight.check_config({}, argv, oppo=True)
    preflight.check_config({}, [*argv, "--oppo.streaming.kv_budget_tokens", "40960"], oppo=True)


def test_a_streamed_reference_is_counted_whole_beside_the_actor():
    """With an explicit budget it is counted: the whole reference on each of the actor's GPUs,
    2 B x 7.615e9 = 15.231 GB, its budget 40,960 x 57,344 B = 2.349 GB, and no ZeRO-3 shard."""
    kind = kind_with(preset_count("qwen2.5-7b-8gpu.yaml", "--oppo.streaming.reference", "true",
                                  "--oppo.streaming.kv_budget_tokens", "40960"), "actor")
    assert item(kind, "streaming reference weights").bytes / GB == pytest.approx(15.231, abs=0.001)
    assert item(kind, "streaming reference KV").bytes / GB == pytest.approx(2.349, abs=0.001)
    assert not [i for i in kind.items if i.what.startswith("reference (ZeRO-3")]


def test_a_streaming_reward_beside_the_critic_needs_an_explicit_kv_budget(gpu_80gb):
    argv = ["--config", str(CLUSTER / "qwen2.5-3b-8xa100.yaml"), "--oppo.streaming.kv_budget_tokens", "0"]
    with pytest.raises(ValueError, match=r"beside the critic \(--train.colocate_critic_reward\) needs an explicit"):
        preflight.check_config({}, argv, oppo=True)


def test_a_model_the_check_cannot_count_leaves_the_layout_uncounted_not_passed(gpu_80gb, capsys):
    argv = ["--config", str(CLUSTER / "qwen2.5-7b-8gpu.yaml"), "--reward.model_name_or_path", "someone/Unknown-RM"]
    preflight.check_config({}, argv, oppo=True)
    out = capsys.readouterr().out
    assert "UNCOUNTED: --reward.model_name_or_path someone/Unknown-RM" in out
    assert "warning: the layout is uncounted" in out
    with pytest.raises(ValueError, match=r"the layout is uncounted: --reward.model_name_or_path someone/Unknown-RM"):
        preflight.check_config({}, argv, oppo=True, strict_memory=True)


def test_on_cpu_there_is_no_device_memory_and_nothing_is_refused(tmp_path, no_gpu, capsys):
    check(make_layout(tmp_path), util=0.95, budget=0)
    assert "nothing counted (a CPU run" in capsys.readouterr().out


def test_a_presets_device_is_used_where_neither_the_variable_nor_a_gpu_says(no_gpu, capsys, monkeypatch):
    argv = ["--config", str(CLUSTER / "qwen2.5-72b-async-64gpu.yaml")]
    preflight.check_config({}, argv, oppo=True)
    assert "device 141.0 GB (" in capsys.readouterr().out
    monkeypatch.setenv(run_env.DEVICE_MEMORY_GB, "64")
    with pytest.raises(ValueError, match=r"over its 64.0 GB \(OPPO_DEVICE_MEMORY_GB\)"):
        preflight.check_config({}, argv, oppo=True)


def test_a_device_memory_that_is_not_a_number_names_the_variable():
    with pytest.raises(ValueError, match=run_env.DEVICE_MEMORY_GB):
        memory_check.device_memory({run_env.DEVICE_MEMORY_GB: "80GB"})


@pytest.mark.parametrize(("section", "expected"), [
    ("device: {name: H100, memory_gb: -1}", "device.memory_gb must be a number of GB > 0, got -1"),
    ("device: {name: H100}", "'device' must be a mapping with exactly the keys name, memory_gb"),
])
def test_a_bad_device_section_names_the_key(tmp_path, section, expected):
    path = tmp_path / "preset.yaml"
    path.write_text(f"rollout: {{batch_size: 4}}\n{section}\n")
    with pytest.raises(ValueError, match=expected):
        yaml_config.load(path)


def test_the_table_aligns_its_columns_and_marks_the_tightest_phase_once():
    lines = preset_count("qwen2.5-7b-8gpu.yaml").table()
    rows = [line for line in lines if line.startswith("    ")]  # items, totals and margins of every kind
    # a header, total and margin row a kind; vLLM's 2 items, the actor's 8, the reward actor's 4
    assert len(rows) == 3 * 3 + 2 + 8 + 4
    assert len({len(line) for line in rows}) == 1
    cells = [cell.rstrip("*") for line in rows if not line.lstrip().startswith("item") for cell in line.split()[-3:]]
    assert all(cell == "-" or cell[-2] == "." for cell in cells)  # GB with one decimal
    assert sum(line.count("*") for line in rows) == 1
    (tight,) = [line for line in lines if line.startswith("tightest (*)")]
    assert tight == "tightest (*): [1] generating: 73.0 of 80.0 GB, margin 7.0 GB (8.8%): ok"
    assert rows[0].split() == ["item", "generating", "experience", "training"]


def test_under_the_launcher_the_check_refuses_as_before_but_prints_nothing_again(no_gpu, capsys, monkeypatch):
    """`openrlhf-oppo train` printed the table before launching; its child (OPPO_CHECKED) checks again
    without a second table on the terminal, and a layout that does not fit is still refused."""
    argv = ["--config", str(CLUSTER / "qwen2.5-72b-async-64gpu.yaml")]
    monkeypatch.setenv(run_env.CHECKED, "1")
    preflight.check_config({}, argv, oppo=True)
    assert capsys.readouterr().out == ""
    monkeypatch.setenv(run_env.DEVICE_MEMORY_GB, "24")
    with pytest.raises(ValueError, match="would need"):
        preflight.check_config({}, argv, oppo=True)
    assert capsys.readouterr().out == ""
