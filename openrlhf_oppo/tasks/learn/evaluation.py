"""Measurements of the learn task: the reward model's held-out accuracy, a policy's samples
(exact match, lengths, learned reward, how the reward model judges the policy's own
mistakes), the SFT policy's per-prompt baseline, and the final actors of PPO runs on
held-out prompts (`python -m oppo_lab convergence`). Models run in bf16, as PPO runs them."""

from __future__ import annotations

import math
from pathlib import Path

from openrlhf_oppo.tasks.learn.assets import LearnAssets, LearnSpec, read_jsonl
from openrlhf_oppo.tasks.learn.task import RESPONSE_CAP, LengthLaw, exact_match, parse_prompt


def load_reward_model(path: Path):
    """The reward model as OpenRLHF's PPO loads it (`get_llm_for_sequence_regression(...,
    "reward")`, eval mode), with the CPU compat layer where CUDA is absent."""
    from openrlhf_oppo import compat

    compat.apply()  # openrlhf.models imports flash_attn at module top
    from openrlhf.models import get_llm_for_sequence_regression

    model = get_llm_for_sequence_regression(str(path), "reward", param_dtype="bf16", attn_implementation="sdpa")
    return model.eval()


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i : i + size]


def score(model, tokenizer, sequences: list[list[int]], batch_size: int = 64) -> list[float]:
    """Rewards of whole token sequences (prompt + response), left-padded as OpenRLHF does;
    batched by length (the lengths are long-tailed: padding to the longest would dominate)."""
    import torch

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    rewards = [0.0] * len(sequences)
    with torch.no_grad():
        for batch in _batches(order, batch_size):
            width = max(len(sequences[i]) for i in batch)
            ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(sequences[i])) + sequences[i] for i in batch])
            mask = torch.tensor([[0] * (width - len(sequences[i])) + [1] * len(sequences[i]) for i in batch])
            for i, reward in zip(batch, model(ids, attention_mask=mask).float().tolist(), strict=False):
                rewards[i] = reward
    return rewards


def rm_accuracy(model, tokenizer, pairs: list[dict], lengths: LengthLaw) -> dict:
    """Share of pairs with r(chosen) > r(rejected) (a tie counts as wrong, as in OpenRLHF's
    eval): overall, per mistake kind and per length band of `lengths`. Text is tokenized as
    OpenRLHF's RewardDataset does (prompt + response, no special tokens added)."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    chosen = score(model, tokenizer, [ids(p["prompt"] + p["chosen"]) for p in pairs])
    rejected = score(model, tokenizer, [ids(p["prompt"] + p["rejected"]) for p in pairs])
    wins = [c > r for c, r in zip(chosen, rejected, strict=False)]

    def share_by(key) -> dict[str, float]:
        groups: dict[str, list[bool]] = {}
        for p, win in zip(pairs, wins, strict=False):
            groups.setdefault(key(p), []).append(win)
        return {k: sum(v) / len(v) for k, v in sorted(groups.items())}

    return {
        "accuracy": sum(wins) / len(wins),
        "by_kind": share_by(lambda p: p["kind"]),
        "by_band": share_by(lambda p: _band(len(parse_prompt(p["prompt"])), lengths)),
    }


def sample_policy(actor_path: Path, prompts: list[str], max_new_tokens: int, seed: int,
                  batch_size: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) per prompt: one sample each at temperature 1.0, no top-k /
    top-p (as vLLM samples in PPO), transformers `generate`. A response ends with EOS unless
    it ran into `max_new_tokens`. Responses decode to RESPONSE_CAP tokens first; those still
    going decode on together to `max_new_tokens` (a long-tailed policy would otherwise hold
    every batch with one long sample in it to the cap)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(actor_path)
    model = AutoModelForCausalLM.from_pretrained(actor_path, dtype=torch.bfloat16).eval()
    torch.manual_seed(seed)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    response_ids: list[list[int]] = [[] for _ in prompts]
    pending = range(len(prompts))
    for cap in sorted({min(RESPONSE_CAP, max_new_tokens), max_new_tokens}):
        # batched by length: long lists (long answers) decode together, short batches end early
        pending = sorted(pending, key=lambda i: len(prompt_ids[i]) + len(response_ids[i]))
        with torch.no_grad():
            for batch in _batches(pending, batch_size):
                rows = [prompt_ids[i] + response_ids[i] for i in batch]
                width = max(len(row) for row in rows)
                ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(row)) + row for row in rows])
                mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                     top_p=1.0, max_new_tokens=cap - len(response_ids[batch[0]]),
                                     pad_token_id=tokenizer.pad_token_id)
                for i, row in zip(batch, out[:, width:].tolist(), strict=False):
                    end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
                    response_ids[i] = response_ids[i] + row[:end]
        pending = [i for i in pending if len(response_ids[i]) == cap and response_ids[i][-1] != tokenizer.eos_token_id]
    return prompt_ids, response_ids


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (q in [0, 1])."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _band(n_words: int, lengths: LengthLaw) -> str:
    if n_words <= lengths.short[1]:
        return "short"
    if n_words <= lengths.mid[1]:
        return "mid"
    return "long"


def auc(positives: list[float], negatives: list[float]) -> float | None:
    """P(score of a random positive > one of a random negative), ties half; None if a side is empty."""
    if not positives or not negatives:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def _scored_samples(actor: Path, records: list[dict], spec: LearnSpec, seed: int, reward_model, tokenizer):
    """One sample per record of the policy at `actor` (`sample_policy`, seeded): prompt ids,
    response ids, the decoded responses and their learned rewards."""
    prompt_ids, response_ids = sample_policy(actor, [r["input"] for r in records], spec.max_new_tokens, seed,
                                             spec.sample_batch_size)
    texts = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    rewards = score(reward_model, tokenizer, [p + r for p, r in zip(prompt_ids, response_ids, strict=False)])
    return prompt_ids, response_ids, texts, rewards


def evaluate_policy(assets: LearnAssets, spec: LearnSpec, reward_model, tokenizer, actor: Path | None = None,
                    records: list[dict] | None = None, samples_per_prompt: int = 1) -> dict:
    """A policy (default: the SFT actor) on RL prompts (default: the first `eval_prompts`):
    exact match (overall, per length band, on prompts unseen in SFT), response lengths, the
    learned reward of its samples, and the reward model on the policy's own samples: how
    often it scores a wrong sample below the gold answer of the same prompt (what RL needs),
    and how well it separates correct samples from wrong ones across prompts (AUC: also asks
    that rewards be comparable from prompt to prompt, which Bradley-Terry training on
    same-prompt pairs does not). Shares are over all `samples_per_prompt` samples of each prompt."""
    prompts = read_jsonl(assets.prompts)[: spec.eval_prompts] if records is None else records
    records = [r for r in prompts for _ in range(samples_per_prompt)]
    seen = {r["input"] for r in read_jsonl(assets.data / "sft.jsonl")}
    prompt_ids, response_ids, texts, rewards = _scored_samples(actor or assets.actor, records, spec, spec.seed,
                                                               reward_model, tokenizer)
    correct = [exact_match(r["input"], t) for r, t in zip(records, texts, strict=False)]
    gold_ids = [tokenizer(f" {r['label']}{tokenizer.eos_token}", add_special_tokens=False)["input_ids"]
                for r in records]
    gold_rewards = score(reward_model, tokenizer, [p + g for p, g in zip(prompt_ids, gold_ids, strict=False)])
    gold_wins = [g > x for x, g, ok in zip(rewards, gold_rewards, correct, strict=False) if not ok]
    bands: dict[str, list[bool]] = {}
    for r, ok in zip(records, correct, strict=False):
        bands.setdefault(_band(len(r["label"].split()), spec.lengths), []).append(ok)
    unseen = [ok for r, ok in zip(records, correct, strict=False) if r["input"] not in seen]
    lengths = [len(r) for r in response_ids]
    return {
        "prompts": len(prompts),
        "samples_per_prompt": samples_per_prompt,
        "exact_match": sum(correct) / len(correct),
        "exact_match_by_band": {b: {"n": len(v), "exact_match": sum(v) / len(v)} for b, v in sorted(bands.items())},
        "unseen_prompts": len(unseen) // samples_per_prompt,
        "exact_match_unseen": sum(unseen) / len(unseen) if unseen else None,
        "response_tokens": {"median": quantile(lengths, 0.5), "p95": quantile(lengths, 0.95), "max": max(lengths),
                            "at_cap": sum(n >= spec.max_new_tokens for n in lengths) / len(lengths)},
        "mean_reward": _mean(rewards),
        "wrong_samples": len(gold_wins),
        "reward_gold_above_wrong_sample": _mean(gold_wins),
        "reward_auc_correct_vs_wrong": auc([x for x, ok in zip(rewards, correct, strict=False) if ok],
                                           [x for x, ok in zip(rewards, correct, strict=False) if not ok]),
        "mean_reward_correct": _mean([x for x, ok in zip(rewards, correct, strict=False) if ok]),
        "mean_reward_wrong": _mean([x for x, ok in zip(rewards, correct, strict=False) if not ok]),
    }


BASELINE_SAMPLES = 8
"""Samples per RL prompt of the SFT policy's baseline (`sft_baseline`)."""


def sft_baseline(assets: LearnAssets, spec: LearnSpec, reward_model, tokenizer,
                 samples: int = BASELINE_SAMPLES) -> list[dict]:
    """Per RL prompt (prompts.jsonl, in order): the SFT policy's mean learned reward and
    exact-match rate over `samples` samples at T=1 (seed spec.seed + 1). A PPO step's reward
    minus this baseline of the prompts it trained on measures what the policy has learned
    rather than which prompts the step drew (the reward gain the lab's convergence study
    reports): a step of long lists scores far below one of short lists, whatever the policy."""
    prompts = read_jsonl(assets.prompts)
    records = [r for r in prompts for _ in range(samples)]
    _, _, texts, rewards = _scored_samples(assets.actor, records, spec, spec.seed + 1, reward_model, tokenizer)
    rows = []
    for k, r in enumerate(prompts):
        own = range(k * samples, (k + 1) * samples)
        rows.append({"input": r["input"], "reward": _mean([rewards[i] for i in own]),
                     "exact_match": _mean([float(exact_match(r["input"], texts[i])) for i in own]), "samples": samples})
    return rows


def heldout_records(assets: LearnAssets, spec: LearnSpec, trained_prompts: int) -> list[dict]:
    """Up to `eval_prompts` RL prompts a PPO run with `--data.max_samples trained_prompts`
    never draws: OpenRLHF keeps the dataset's first max_samples rows, so these follow them."""
    rows = read_jsonl(assets.prompts)
    if len(rows) <= trained_prompts:
        raise ValueError(f"{assets.prompts}: no prompts after the first {trained_prompts} (--data.max_samples) "
                         f"to evaluate on; it holds {len(rows)}")
    return rows[trained_prompts:][: spec.eval_prompts]


def evaluate_actors(root: Path | str, actors: dict[str, Path], trained_prompts: int,
                    spec: LearnSpec = LearnSpec(), samples_per_prompt: int = 1) -> dict[str, dict]:  # noqa: B008 (frozen)
    """`evaluate_policy` of each actor directory (name -> path), all on the same held-out
    prompts (`heldout_records`), `samples_per_prompt` samples each with the same seed, scored
    by the task's reward model."""
    from transformers import AutoTokenizer

    assets = LearnAssets(Path(root).expanduser())
    tokenizer = AutoTokenizer.from_pretrained(assets.tokenizer)
    reward_model = load_reward_model(assets.reward)
    records = heldout_records(assets, spec, trained_prompts)
    return {name: evaluate_policy(assets, spec, reward_model, tokenizer, actor=path, records=records,
                                  samples_per_prompt=samples_per_prompt)
            for name, path in actors.items()}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


SAMPLES_PER_PROMPT = 4
"""Samples of each held-out prompt per actor in `evaluate_against_sft`: one sample each of 256
prompts left a 0.03 standard error on exact match, as large as the differences to measure."""


def evaluate_against_sft(root: Path, spec: LearnSpec, actors: dict[str, Path],
                         trained: int) -> tuple[int, dict[str, dict]]:
    """The task's SFT policy (`sft`) and `actors` (name -> model directory) on the held-out
    prompts after the first `trained` rows, SAMPLES_PER_PROMPT samples each at T=1 with one
    seed: (prompts, name -> FINAL_EVAL_KEYS' figures)."""
    evals = evaluate_actors(root, {"sft": LearnAssets(root).actor, **actors}, trained, spec,
                                       SAMPLES_PER_PROMPT)

    def figures(e: dict) -> dict:
        bands = e["exact_match_by_band"]
        return {"exact_match": e["exact_match"], "mean_reward": e["mean_reward"],
                "exact_match_mid": bands.get("mid", {}).get("exact_match"),
                "exact_match_long": bands.get("long", {}).get("exact_match"),
                "median_response_tokens": e["response_tokens"]["median"],
                "at_cap": e["response_tokens"]["at_cap"]}

    return evals["sft"]["prompts"], {name: figures(e) for name, e in evals.items()}
