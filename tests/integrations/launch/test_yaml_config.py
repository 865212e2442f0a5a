"""YAML -> OpenRLHF dotted flags, and one-line errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from openrlhf_oppo.config import ASYNC_POLICY_LAG
from openrlhf_oppo.integrations.launch import schedules, yaml_config

REPO = Path(__file__).resolve().parents[3]


def test_tiny_cpu_config_translates_to_openrlhf_flags():
    config = yaml_config.load(REPO / "configs" / "tiny-cpu.yaml")
    argv = yaml_config.to_argv(config.flags)
    assert argv[argv.index("--ds.zero_stage") + 1] == "3"
    assert "--vllm.enforce_eager" in argv
    assert argv[argv.index("--ds.attn_implementation") + 1] == "sdpa"
    assert config.oppo["chunk"] == {"size_tokens": 8, "adaptive": True, "candidates": [4, 8, 16], "trial_steps": 1,
                                    "period_steps": 4} and "assets" in config.task


def test_nested_keys_become_dotted_flags_and_switches_follow_booleans(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {async_enable: true, partial_rollout_enable: false}\nactor: {adam: {betas: [0.9, 0.99]}}\n")
    argv = yaml_config.to_argv(yaml_config.load(path).flags)
    assert argv == ["--train.async_enable", "--actor.adam.betas", "0.9", "0.99"]


def test_oppo_section_is_passed_through_unparsed(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("oppo: {anything: [1, 2], nested: {x: 1}}\n")
    config = yaml_config.load(path)
    assert config.oppo == {"anything": [1, 2], "nested": {"x": 1}} and config.flags == {}


@pytest.mark.parametrize(
    "text, message",
    [
        ("actr: {}\n", "unknown top-level key 'actr' (did you mean 'actor'?); allowed: task, oppo, device, actor"),
        ("actor: {lrr: 1}\n", "unknown key 'actor.lrr'"),
        ("task: {asets: x}\n",
         "unknown key 'task.asets' (did you mean 'assets'?); allowed: assets, variant, fixed_lengths"),
        ("train: {async_enable: 1}\n", None),
    ],
)
def test_bad_keys_name_the_key_and_what_is_allowed(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        yaml_config.to_argv(yaml_config.load(path).flags)
    assert "\n" not in str(err.value)
    assert message is None or message in str(err.value)


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="--config: file not found: .*nope.yaml"):
        yaml_config.load(tmp_path / "nope.yaml")


def test_schedule_table_maps_to_openrlhf_modes():
    base = {"rollout.batch_size": 4}
    assert schedules.schedule_flags("sync", base) == {}
    assert schedules.schedule_flags("async", base) == {"train.async_enable": True}
    assert schedules.schedule_flags("partial", base) == {"train.async_enable": True,
                                                         "train.partial_rollout_enable": True}
    assert schedules.schedule_flags("oversample", base) == {
        "train.async_enable": True,
        "rollout.vllm_generate_batch_size": 8,
    }


def test_oppo_schedules_run_oppos_entry_point_with_the_section_and_their_overrides():
    for name in ("oppo", "oppo-async", "oppo-async-bg"):
        assert schedules.check(name).entry_module == "openrlhf_oppo.cli.train_ppo_ray"
    from openrlhf_oppo.cli.train_ppo_ray import parse

    section = {"delta": {"init": 1, "max": 2}, "chunk": {"size_tokens": 8}}
    intra = {**section, "delta": {**section["delta"], "enable": False}}  # streaming only
    cfg, rest = parse(schedules.oppo_argv("oppo", intra))
    assert rest == [] and cfg.delta.enable is False and cfg.delta.init == 1 and cfg.chunk.size_tokens == 8
    assert cfg.streaming.enable is True
    cfg, _ = parse(schedules.oppo_argv("oppo", {**section, "streaming": {"enable": False}}))  # carry-over only
    assert cfg.streaming.enable is False and cfg.delta.enable is True
    cfg, _ = parse(schedules.oppo_argv("oppo", section))
    assert cfg.streaming.enable and cfg.delta.enable and cfg.delta.max == 2 and cfg.staleness.max_policy_lag == 0
    cfg, _ = parse(schedules.oppo_argv("oppo-async", section))
    assert cfg.streaming.enable and cfg.staleness.max_policy_lag == ASYNC_POLICY_LAG and cfg.delta.max == 2
    cfg, _ = parse(schedules.oppo_argv("oppo-async-bg", {**section, "streaming": {"enable": True}}))
    assert cfg.streaming.enable is False  # the schedule's own settings over the section's
    assert cfg.staleness.background_sync and cfg.staleness.max_policy_lag == ASYNC_POLICY_LAG
    assert cfg.delta.init == 1 and cfg.chunk.size_tokens == 8
    assert schedules.oppo_argv("sync", section) == []  # OpenRLHF's schedules ignore the section


def test_bad_oppo_section_names_the_field():
    with pytest.raises(ValueError, match=r"--oppo\.delta\.max"):
        schedules.oppo_argv("oppo", {"delta": {"min": 3, "max": 1, "init": 1}})


def test_unknown_schedule_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="unknown schedule 'fast'; allowed: sync, async, partial, oversample, oppo"):
        schedules.check("fast")
