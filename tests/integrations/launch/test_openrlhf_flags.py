"""The flag table read from OpenRLHF 0.11.2's train_ppo_ray source."""

from __future__ import annotations

import pytest

from openrlhf_oppo.integrations.launch.openrlhf_flags import namespaces, parse_flags, resolve, train_flags


def test_flags_the_schedules_and_tiny_config_rely_on_exist_upstream():
    flags = train_flags()
    assert flags["train.async_enable"].kind == "bool"
    assert flags["train.partial_rollout_enable"].kind == "bool"
    assert flags["rollout.vllm_generate_batch_size"].kind == "value"
    assert flags["actor.adam.betas"].kind == "list"
    assert flags["critic.adam.lr"].kind == "value"  # from the `for prefix in ("actor", "critic")` loop
    expected = {"actor", "critic", "ref", "reward", "vllm", "ds", "train", "rollout", "algo", "data"}
    assert expected <= set(namespaces(flags))


def test_parse_flags_expands_prefix_loops_and_reads_actions():
    source = '''
p.add_argument("--a.x", action="store_true")
p.add_argument("--a.l", nargs=2, type=float)
for prefix in ("actor", "critic"):
    p.add_argument(f"--{prefix}.lr", type=float)
'''
    flags = parse_flags(source)
    assert {n: f.kind for n, f in flags.items()} == {
        "a.x": "bool",
        "a.l": "list",
        "actor.lr": "value",
        "critic.lr": "value",
    }


def test_resolve_gives_openrlhfs_defaults_types_and_actions():
    values, unknown = resolve(["--rollout.batch_size", "3", "--train.async_enable", "--oppo.delta.max", "2"])
    assert values["rollout.batch_size"] == 3
    assert (values["train.async_enable"], values["train.partial_rollout_enable"]) == (True, False)
    assert (values["data.max_len"], values["rollout.max_new_tokens"]) == (2048, None)
    assert values["data.max_samples"] == int(1e8)
    assert values["actor.adam.betas"] == (0.9, 0.95) and unknown == ["--oppo.delta.max", "2"]
    with pytest.raises(ValueError, match=r"argument --algo.advantage.estimator: invalid choice: 'foo'"):
        resolve(["--algo.advantage.estimator", "foo"])
