"""OpenRLHF's trainers (`openrlhf.cli.train_sft`, `train_rm`) as the learn task's build runs
them: subprocess command lines and environment, and the entry point that runs them with fp32
parameters and train_rm's batches grouped by length (`fp32_trainer_main`, named in a
`python -c` command line). See `openrlhf_oppo.tasks.learn` for the task and its assets;
above `assets`, below `builder`."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

from openrlhf_oppo.tasks.learn.assets import LearnAssets, LearnSpec


def trainer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one OpenRLHF trainer process: the CPU compat layer (where CUDA is
    absent), the project's compile caches (DeepSpeed's JIT-built Adam is reused) and a
    single-process torch.distributed world, which DeepSpeed's init needs without a launcher."""
    from openrlhf_oppo import compat
    from openrlhf_oppo.compat import caches
    from openrlhf_oppo.compat.ports import free_port

    base = dict(os.environ if base is None else base)
    env = dict(base)
    env.update(compat.launch_env(base))
    env.update(caches.cache_env(base))
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    # launch_env's 1 thread suits a PPO run's many processes; a lone trainer may use every
    # core (2 threads: a reward-model step ~1.4x faster on 2 cores). A value you set wins.
    env["OMP_NUM_THREADS"] = base.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


def _common_flags(spec: LearnSpec, out_dir: Path, logs: Path, run_name: str) -> list[str]:
    return [
        "--ds.zero_stage", "2",
        "--ds.attn_implementation", "sdpa",  # flash_attention_2 needs CUDA
        "--data.max_len", str(spec.max_len),
        "--train.seed", str(spec.seed),
        "--lr_warmup_ratio", "0.03",
        "--logger.logging_steps", "1",
        "--logger.tensorboard_dir", str(logs),
        "--logger.wandb.run_name", run_name,  # fixes TensorBoard's subdirectory
        "--ckpt.output_dir", str(out_dir),
        "--ckpt.path", str(out_dir.parent / "ckpt" / run_name),
        "--ckpt.save_steps", "-1",
    ]


def sft_argv(assets: LearnAssets, spec: LearnSpec) -> list[str]:
    return trainer_argv("openrlhf.cli.train_sft", [
        "--model.model_name_or_path", str(assets.init_actor),
        "--data.dataset", str(assets.data / "sft.jsonl"),
        "--data.input_key", "input",
        "--data.output_key", "output",
        "--data.input_template", "",  # the prompt as it is, as PPO sees it (no "User: ... Assistant:")
        "--data.max_samples", str(spec.sft_samples),
        "--train.batch_size", str(spec.sft_batch_size),
        "--train.micro_batch_size", str(spec.sft_batch_size),
        "--train.max_epochs", "1",
        "--adam.lr", str(spec.sft_lr),
        *_common_flags(spec, assets.actor, assets.root / "logs", "sft"),
    ], spec.train_dtype)


def rm_argv(assets: LearnAssets, spec: LearnSpec, pairs: int) -> list[str]:
    return trainer_argv("openrlhf.cli.train_rm", [
        "--model.model_name_or_path", str(assets.actor),  # the SFT policy: it already knows the task
        "--data.dataset", str(assets.data / "rm_train.jsonl"),
        "--eval.dataset", str(assets.data / "rm_heldout.jsonl"),  # OpenRLHF's own eval; mean/std from it
        "--data.prompt_key", "prompt",
        "--data.chosen_key", "chosen",
        "--data.rejected_key", "rejected",
        "--data.max_samples", str(pairs),
        "--train.batch_size", str(spec.rm_batch_size),
        "--train.micro_batch_size", str(spec.rm_batch_size),
        "--train.max_epochs", "1",
        "--adam.lr", str(spec.rm_lr),
        *_common_flags(spec, assets.reward, assets.root / "logs", "rm"),
    ], spec.train_dtype)


_FP32_ENTRY = "from oppo_lab.learn.trainers import fp32_trainer_main; fp32_trainer_main()"


def trainer_argv(module: str, flags: list[str], dtype: str) -> list[str]:
    """Command line of OpenRLHF's trainer `module` (e.g. openrlhf.cli.train_sft)."""
    if dtype == "bf16":
        return [sys.executable, "-m", module, "--ds.param_dtype", "bf16", *flags]  # as OpenRLHF ships it
    return [sys.executable, "-c", _FP32_ENTRY, module, "--ds.param_dtype", "bf16", *flags]


def _without_half_precision(make_config):
    def wrapper(*args, **kwargs):
        config = make_config(*args, **kwargs)
        config["bf16"]["enabled"] = False
        config["fp16"]["enabled"] = False
        return config

    return wrapper


GROUP_BATCHES = 4
"""Batches per length group of train_rm's batch order (`length_grouped_order`). Measured on
the learn task's reward model (96,000 + 9,321 pairs, one build each): random order held-out
accuracy 0.869 with a step of 0.28 s; groups of 4 batches 0.889 and 0.13 s; groups of 32,
whose batches are nearly of one length, 0.797 (0.41 on long lists) and 0.12 s."""


LONG_PAIR = 128
"""Words (tokens) beyond which a sample is batched only with such samples (`length_grouped_order`):
above the learn task's longest pair (43 + RESPONSE_CAP), below learn-longtail's loops (43 + 512)."""


def length_grouped_order(lengths: list[int], batch_size: int, seed: int,
                         group_batches: int = GROUP_BATCHES) -> list[int]:
    """A shuffled order of range(len(lengths)) in which each consecutive block of batch_size
    holds samples of similar length (the idea of transformers' `group_by_length`): a random
    permutation cut into groups of group_batches batches, each group sorted by length and cut
    into batches, the full batches shuffled and the short ones (of the last group, and of the
    long samples below) put last. A batch is padded to its longest sample: with the task's
    long-tailed lengths, random batches of 64 reward-model pairs hold 3.8x their pairs'
    tokens, groups of 4 batches 1.6x. Samples longer than LONG_PAIR (learn-longtail's loops to the cap) form
    batches of their own: in a group, the few there would pad a whole batch to their length
    (a reward-model step 1.1 s instead of 0.13 s on average)."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    long = [i for i in order if lengths[i] > LONG_PAIR]
    order = [i for i in order if lengths[i] <= LONG_PAIR]
    batches = [long[i : i + batch_size] for i in range(0, len(long), batch_size)]
    span = batch_size * group_batches
    for start in range(0, len(order), span):
        group = sorted(order[start : start + span], key=lengths.__getitem__)
        batches += [group[i : i + batch_size] for i in range(0, len(group), batch_size)]
    full = [b for b in batches if len(b) == batch_size]
    rng.shuffle(full)
    return [i for b in full + [b for b in batches if len(b) < batch_size] for i in b]


def _pair_lengths(dataset) -> list[int] | None:
    """Words per pair of OpenRLHF's RewardDataset: prompt + the longer response (train_rm pads
    chosen and rejected together); None for another dataset (SFT keeps OpenRLHF's order). A
    word of the task is one token."""
    if not hasattr(dataset, "chosens"):
        return None
    return [len(p.split()) + max(len(c.split()), len(r.split()))
            for p, c, r in zip(dataset.prompts, dataset.chosens, dataset.rejects, strict=False)]


def _length_grouped(setup_dataloader):
    """Wrap `DeepspeedStrategy.setup_dataloader`: train_rm's shuffled training loader (one
    process) takes its order from `length_grouped_order`, seeded with the strategy's seed."""
    import inspect

    import torch.distributed as dist

    signature = inspect.signature(setup_dataloader)

    def wrapper(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        lengths = _pair_lengths(a["replay_buffer"])
        single = not dist.is_initialized() or dist.get_world_size() == 1
        if a["shuffle"] and a["sampler"] is None and lengths is not None and single and not a["consumed_samples"]:
            a["sampler"] = length_grouped_order(lengths, a["batch_size"], self.seed)  # DataLoader takes any iterable
        return setup_dataloader(*bound.args, **bound.kwargs)

    return wrapper


def _unended_records_do_not_end(getitem):
    """Wrap `SFTDataset.__getitem__`: OpenRLHF ends every record with EOS (appended to a
    response without one, or put at the last position where max_len cuts it) and trains it.
    A response without EOS in the data (a looping record of learn-longtail) does not train
    that EOS, so the policy learns that a loop does not end. Every other record is as
    OpenRLHF makes it."""
    def wrapper(self, idx):
        input_ids, attention_mask, loss_mask = getitem(self, idx)
        if not self.pretrain_mode and not self.responses[idx].rstrip("\n").endswith(self.tokenizer.eos_token):
            loss_mask[0, -2] = 0  # the loss at position -2 is that of the last token, the EOS
        return input_ids, attention_mask, loss_mask

    return wrapper


def fp32_trainer_main() -> None:
    """`python -c ... MODULE FLAGS...`: run OpenRLHF's trainer MODULE as `python -m MODULE
    FLAGS...` does, with fp32 parameters. Two touch points of openrlhf 0.11.2, both read at
    call time: `openrlhf.utils.utils.convert_to_torch_dtype` (the dtype `Actor` and
    `get_llm_for_sequence_regression` load in; "bf16" from the flag) and the DeepSpeed
    configs `DeepspeedStrategy` builds (`get_train_ds_config` / `get_eval_ds_config`,
    imported by name into `openrlhf.utils.deepspeed.deepspeed`): bf16 off, else DeepSpeed
    casts the model back to bf16. A third, `DeepspeedStrategy.setup_dataloader`: train_rm's
    batches grouped by length (`length_grouped_order`: a step 2x faster, see GROUP_BATCHES).
    A fourth, `SFTDataset.__getitem__`: a response without EOS does not learn to end
    (`_unended_records_do_not_end`)."""
    import runpy

    import torch
    from openrlhf.datasets import SFTDataset
    from openrlhf.utils import utils
    from openrlhf.utils.deepspeed import deepspeed as strategy_module

    utils.convert_to_torch_dtype = lambda param_dtype: torch.float32
    strategy_module.get_train_ds_config = _without_half_precision(strategy_module.get_train_ds_config)
    strategy_module.get_eval_ds_config = _without_half_precision(strategy_module.get_eval_ds_config)
    strategy = strategy_module.DeepspeedStrategy
    strategy.setup_dataloader = _length_grouped(strategy.setup_dataloader)
    SFTDataset.__getitem__ = _unended_records_do_not_end(SFTDataset.__getitem__)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def run_trainer(argv: list[str], cwd: Path, log=print) -> None:
    """Run one OpenRLHF trainer; its progress bars go to this process's terminal."""
    log(f"learn: $ {' '.join(argv)}")
    proc = subprocess.run(argv, cwd=cwd, env=trainer_env())
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:5])} ... exited with {proc.returncode} (its output is above)")
