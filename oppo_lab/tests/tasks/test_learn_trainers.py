"""The learn build's trainers (oppo_lab.learn.trainers): OpenRLHF's train_sft /
train_rm command lines, the fp32 entry point and the OpenRLHF code it patches, the
length-grouped loader, and the one-process world each trainer runs in."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import types
from pathlib import Path

import pytest

from openrlhf_oppo.tasks import learn
from oppo_lab.learn import trainers


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _module(argv: list[str]) -> str:
    """The OpenRLHF trainer a command line runs: `python -m MODULE` or `python -c ENTRY MODULE`."""
    return argv[2] if argv[1] == "-m" else argv[3]


def test_trainer_command_lines(tmp_path):
    assets, spec = learn.LearnAssets(tmp_path), learn.LearnSpec()
    sft = trainers.sft_argv(assets, spec)
    assert _module(sft) == "openrlhf.cli.train_sft"
    assert _flag(sft, "--data.input_template") == ""  # PPO sees the bare prompt
    assert (_flag(sft, "--data.input_key"), _flag(sft, "--data.output_key")) == ("input", "output")
    assert _flag(sft, "--ckpt.output_dir") == str(assets.actor)
    assert _flag(sft, "--ds.attn_implementation") == "sdpa"
    rm = trainers.rm_argv(assets, spec, pairs=33000)
    assert _module(rm) == "openrlhf.cli.train_rm"
    assert _flag(rm, "--data.dataset") == str(assets.data / "rm_train.jsonl")
    assert _flag(rm, "--data.max_samples") == "33000"  # hand-made and the SFT policy's pairs, all of them
    assert _flag(rm, "--model.model_name_or_path") == str(assets.actor)  # RM starts from the SFT policy
    assert _flag(rm, "--ckpt.output_dir") == str(assets.reward) == str(assets.critic)
    assert [_flag(rm, f"--data.{k}_key") for k in ("prompt", "chosen", "rejected")] == ["prompt", "chosen", "rejected"]


def test_trainer_dtype_picks_the_entry_point(tmp_path):
    assets = learn.LearnAssets(tmp_path)
    stock = trainers.sft_argv(assets, learn.LearnSpec(train_dtype="bf16"))
    assert stock[1:3] == ["-m", "openrlhf.cli.train_sft"] and _flag(stock, "--ds.param_dtype") == "bf16"
    fp32 = trainers.sft_argv(assets, learn.LearnSpec(train_dtype="fp32"))
    assert fp32[1] == "-c" and "fp32_trainer_main" in fp32[2] and fp32[3] == "openrlhf.cli.train_sft"


@pytest.mark.parametrize("fields, message", [
    ({"train_dtype": "fp64"}, "train_dtype must be one of fp32, bf16, got 'fp64'"),
    ({"sft_samples": 16, "sft_batch_size": 32}, r"sft_samples \(16\) must be >= sft_batch_size \(32\) >= 1"),
    ({"rm_train_pairs": 100, "rm_batch_size": 0}, r"rm_train_pairs \(100\) must be >= rm_batch_size \(0\) >= 1"),
    ({"rm_policy_samples": 0}, "rm_policy_prompts must be >= 0 and rm_policy_samples >= 1, got 8192 and 0"),
    ({"rl_prompts": 100, "eval_prompts": 200}, r"eval_prompts must be in \[1, rl_prompts = 100\], got 200"),
    ({"rm_kind_weights": (("swop", 1.0),)}, "rm_kind_weights must weigh kinds of swap, drop, repeat"),
    ({"loop_share": 1.0}, r"loop_share must be in \[0, 1\) and loop_repeats >= 1, got 1.0 and 24"),
    ({"loop_share": 0.1, "train_dtype": "bf16"}, "loop_share needs train_dtype 'fp32'"),
])
def test_bad_spec_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        learn.LearnSpec(**fields)


def test_fp32_configs_turn_half_precision_off():
    make = trainers._without_half_precision(lambda stage: {"bf16": {"enabled": True}, "fp16": {"enabled": False},
                                                        "zero_optimization": {"stage": stage}})
    assert make(2) == {"bf16": {"enabled": False}, "fp16": {"enabled": False}, "zero_optimization": {"stage": 2}}


def _source(module: str) -> str:
    """A module's source, found without importing its package (openrlhf.models imports flash_attn)."""
    package = Path(importlib.util.find_spec("openrlhf").origin).parent
    return (package.joinpath(*module.split(".")[1:]).with_suffix(".py")).read_text()


def test_openrlhf_touch_points_of_the_fp32_trainer():
    """openrlhf 0.11.2, read without importing it: fails when upstream moves what
    `fp32_trainer_main` patches (then re-check it)."""
    for trainer in ("openrlhf.cli.train_sft", "openrlhf.cli.train_rm"):  # why the patch exists
        assert 'choices=["bf16", "fp16"]' in _source(trainer)
    assert "def convert_to_torch_dtype(param_dtype: str) -> torch.dtype:" in _source("openrlhf.utils.utils")
    for module in ("openrlhf.models.actor", "openrlhf.models.model"):  # imported at call time: patchable
        assert re.search(r"^[ ]+from openrlhf\.utils\.utils import convert_to_torch_dtype$", _source(module), re.M)
    strategy = _source("openrlhf.utils.deepspeed.deepspeed")
    assert "get_eval_ds_config," in strategy and "get_train_ds_config," in strategy
    assert strategy.count("get_train_ds_config(") >= 1 and strategy.count("get_eval_ds_config(") >= 1
    assert (
        "def setup_dataloader(\n        self,\n        replay_buffer,\n        batch_size: int,"
        "\n        pin_memory: bool = False,"
        "\n        shuffle=True,\n        collate_fn=None,\n        drop_last=True,\n        sampler=None,"
        "\n        consumed_samples=0,"
    ) in strategy
    for trainer in ("openrlhf.cli.train_sft", "openrlhf.cli.train_rm"):  # the training loader: shuffled, no sampler
        assert re.search(
            r"strategy\.setup_dataloader\(\s*train_dataset,\s*args\.train\.micro_batch_size,\s*True,\s*True,",
            _source(trainer),
        )
    configs = _source("openrlhf.utils.deepspeed.deepspeed_utils")
    assert configs.count('"bf16": {') == 2 and configs.count('"fp16": {') == 2


def test_length_grouped_order_is_a_seeded_permutation_of_similar_length_batches():
    rng = random.Random(0)
    lengths = [rng.choice([3, 3, 3, 5, 8, 12, 30]) + rng.randrange(3) for _ in range(1000)]
    order = trainers.length_grouped_order(lengths, batch_size=16, seed=7, group_batches=8)
    assert sorted(order) == list(range(1000))
    assert order == trainers.length_grouped_order(lengths, 16, seed=7, group_batches=8)
    assert order != trainers.length_grouped_order(lengths, 16, seed=8, group_batches=8)
    batches = [order[i : i + 16] for i in range(0, 992, 16)]  # 1000 = 62 full batches + 8
    padded = sum(16 * max(lengths[i] for i in b) for b in batches)
    random_padded = sum(16 * max(lengths[i] for i in range(k, k + 16)) for k in range(0, 992, 16))
    assert padded < 0.6 * random_padded  # what the order is for
    # 40 = a group of 2 full batches + a short one, which comes last (drop_last drops it)
    # rather than between full ones, where it would shift every later batch
    tail = trainers.length_grouped_order(list(range(40)), 16, seed=0, group_batches=2)
    assert sorted(tail) == list(range(40))
    assert all(block == sorted(block) for block in (tail[:16], tail[16:32], tail[32:]))


def test_length_grouped_loader_keeps_openrlhfs_other_loaders():
    """Only train_rm's training loader (shuffled, no sampler, not resumed) is reordered."""
    calls = []

    def setup_dataloader(
        self,
        replay_buffer,
        batch_size: int,
        pin_memory: bool = False,
        shuffle=True,
        collate_fn=None,
        drop_last=True,
        sampler=None,
        consumed_samples=0,
        num_workers: int = 0,
    ):
        calls.append(sampler)

    wrapped = trainers._length_grouped(setup_dataloader)
    strategy = types.SimpleNamespace(seed=3)
    pairs = types.SimpleNamespace(
        prompts=["reverse: a b =>"] * 4 + ["reverse: a =>"] * 4, chosens=[" b a"] * 8, rejects=[" a b"] * 8
    )
    wrapped(strategy, pairs, 4, True, True, None)  # train_rm's call
    assert sorted(calls[-1]) == list(range(8)) and len(calls[-1]) == 8
    wrapped(strategy, pairs, 4, True, False, None)  # eval: in order
    sft = types.SimpleNamespace(prompts=pairs.prompts, responses=pairs.chosens)
    wrapped(strategy, sft, 4, True, True, None)  # SFT keeps OpenRLHF's order
    wrapped(strategy, pairs, 4, True, True, None, consumed_samples=4)  # resumed: OpenRLHF's sampler
    assert calls[1:] == [None, None, None]


def test_trainer_env_is_a_one_process_world():
    env = trainers.trainer_env({"PATH": "/bin"})
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("0", "0", "1", "127.0.0.1")
    assert 0 < int(env["MASTER_PORT"]) < 65536
    assert env["TORCH_EXTENSIONS_DIR"].endswith("torch_extensions")  # DeepSpeed's Adam built once, reused
    assert env["OMP_NUM_THREADS"] == str(os.cpu_count())  # the trainer runs alone
    assert trainers.trainer_env({"PATH": "/bin", "OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
