"""`build`: the learn task's assets, stage by stage (data and tokenizer, the initial actor,
SFT by OpenRLHF's train_sft, the SFT policy's mistakes, the reward model by train_rm, then
the measurements of `summary`), and the shipped build of a spec where there is one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from openrlhf_oppo.tasks import tiny
from openrlhf_oppo.tasks.learn.assets import (
    DEFAULT_ASSETS_DIR,
    LearnAssets,
    LearnSpec,
    build_marker,
    read_jsonl,
    write_data,
    write_jsonl,
)
from openrlhf_oppo.tasks.learn.evaluation import sample_policy
from openrlhf_oppo.tasks.learn.shipped import install
from openrlhf_oppo.tasks.learn.task import answer, exact_match, prompt_records
from openrlhf_oppo.tasks.learn.tokenizer import build_tokenizer
from oppo_lab.learn.summary import Stages, measure, summary_table
from oppo_lab.learn.trainers import rm_argv, run_trainer, sft_argv


def policy_pairs(actor: Path, records: list[dict], samples: int, max_new_tokens: int, seed: int,
                 batch_size: int = 64) -> list[dict]:
    """Pairs {"prompt", "chosen", "rejected", "kind": "policy"}: the gold answer against each
    wrong one of `samples` samples per record of the policy at `actor` (a sample that runs
    into `max_new_tokens` without EOS is wrong and kept as it is)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(actor)
    prompts = [r["input"] for r in records for _ in range(samples)]
    _, responses = sample_policy(actor, prompts, max_new_tokens, seed, batch_size)
    pairs = []
    for prompt, text in zip(prompts, tokenizer.batch_decode(responses), strict=False):  # EOS stays in the text
        if not exact_match(prompt, text, tokenizer.eos_token):
            pairs.append({"prompt": prompt, "chosen": f" {answer(prompt)}{tokenizer.eos_token}",
                          "rejected": text, "kind": "policy"})
    return pairs


def write_rm_train(assets: LearnAssets, spec: LearnSpec) -> int:
    """data/rm_policy.jsonl (the SFT policy's mistakes; `policy_pairs` on prompts of their own
    seed) and data/rm_train.jsonl, the hand-made and the policy's pairs together (train_rm
    shuffles them); returns the number of training pairs."""
    records = prompt_records(spec.rm_policy_prompts, spec.seed + 50, spec.lengths)
    policy = policy_pairs(assets.actor, records, spec.rm_policy_samples, spec.rm_policy_max_new_tokens,
                          spec.seed + 50, spec.sample_batch_size)
    write_jsonl(assets.data / "rm_policy.jsonl", policy)
    train = read_jsonl(assets.data / "rm_mistakes.jsonl") + policy
    write_jsonl(assets.data / "rm_train.jsonl", train)
    return len(train)


def init_actor(assets: LearnAssets, spec: LearnSpec, tokenizer) -> int:
    """A randomly initialised Qwen2ForCausalLM (bf16) with the tokenizer; returns its parameter count."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(spec.seed)
    actor = Qwen2ForCausalLM(tiny._qwen2_config(spec.actor, tokenizer)).to(torch.bfloat16)
    actor.save_pretrained(assets.init_actor)
    tokenizer.save_pretrained(assets.init_actor)
    return sum(p.numel() for p in actor.parameters())


def build(root: Path | str | None = None, spec: LearnSpec = LearnSpec(), force: bool = False,  # noqa: B008 (frozen)
          log=print) -> LearnAssets:
    """Build the assets under `root` (default ~/.cache/openrlhf_oppo/learn) unless already
    built with this spec, or install the package's shipped build of this spec (`shipped`)
    unless `force`: data and tokenizer, SFT (OpenRLHF's train_sft), reward model (OpenRLHF's
    train_rm), then measurements; prints a summary table and writes summary.json."""
    assets = LearnAssets(Path(root).expanduser() if root else DEFAULT_ASSETS_DIR)
    if assets.is_built(spec) and not force:
        return assets
    if not force and install(assets, spec, log):
        return assets
    assets.root.mkdir(parents=True, exist_ok=True)
    (assets.root / "BUILD_OK").unlink(missing_ok=True)
    for stale in ("logs", "ckpt"):  # a former build's TensorBoard events would mix into the losses
        shutil.rmtree(assets.root / stale, ignore_errors=True)
    stages = Stages()

    def prepare():
        tokenizer = build_tokenizer(assets.tokenizer, spec.actor.vocab_size, spec.seed + 40)
        write_data(assets, spec, tokenizer.eos_token)
        init_actor(assets, spec, tokenizer)

    stages.run("data, tokenizer, initial actor", prepare, log)
    stages.run("SFT (openrlhf.cli.train_sft)", lambda: run_trainer(sft_argv(assets, spec), assets.root, log), log)
    pairs = stages.run("SFT policy's mistakes (reward-model pairs)", lambda: write_rm_train(assets, spec), log)
    stages.run("reward model (openrlhf.cli.train_rm)",
               lambda: run_trainer(rm_argv(assets, spec, pairs), assets.root, log), log)
    summary = measure(assets, spec, stages, log)
    assets.summary.write_text(json.dumps(summary, indent=2) + "\n")
    log(summary_table(summary))
    (assets.root / "BUILD_OK").write_text(build_marker(spec))
    return assets
