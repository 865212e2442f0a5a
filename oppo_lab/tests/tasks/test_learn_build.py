"""Building the learn task's models (oppo_lab.learn.builder): a tokenizer with one token a word,
the reward model's pairs from the SFT policy's wrong samples, and (slow) a whole build through
OpenRLHF's own train_sft / train_rm on a few dozen samples."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from openrlhf_oppo.tasks import learn
from oppo_lab.learn import builder

EOS = "<|eos|>"


def test_tokenizer_makes_every_word_one_token(tmp_path):
    tok = builder.build_tokenizer(tmp_path / "tok", vocab_size=384)
    assert len(tok) <= 384
    prompt = "reverse: red cat blue =>"
    ids = tok(prompt + " blue cat red" + tok.eos_token, add_special_tokens=False)["input_ids"]
    # "reverse", ":", 3 words, " =>" | 3 words, EOS: the prompt's tokens are a prefix, as PPO sees them
    assert len(ids) == 6 + 4
    assert ids[:6] == tok(prompt, add_special_tokens=False)["input_ids"] and ids[-1] == tok.eos_token_id


def test_policy_pairs_keep_the_wrong_samples_against_the_gold_answer(tmp_path, monkeypatch):
    tok = builder.build_tokenizer(tmp_path / "actor", vocab_size=384)
    records = [{"input": learn.make_prompt(w), "label": " ".join(w[::-1])} for w in (["red", "cat"], ["sun"])]

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False)["input_ids"]

    # per prompt, 3 samples: the gold answer, a swap, and one that runs into the cap without EOS
    samples = {"reverse: red cat =>": [" cat red" + EOS, " red cat" + EOS, " cat red cat red"],
               "reverse: sun =>": [" sun" + EOS, " sun sun" + EOS, " moon"]}
    seen = []

    def fake_sample_policy(actor, prompts, max_new_tokens, seed, batch_size):
        seen.append((actor, prompts, max_new_tokens, seed, batch_size))
        counts: Counter = Counter()
        responses = []
        for p in prompts:
            responses.append(ids(samples[p][counts[p]]))
            counts[p] += 1
        return [ids(p) for p in prompts], responses

    monkeypatch.setattr(builder, "sample_policy", fake_sample_policy)
    pairs = builder.policy_pairs(tmp_path / "actor", records, samples=3, max_new_tokens=16, seed=5)
    assert seen == [(tmp_path / "actor", ["reverse: red cat =>"] * 3 + ["reverse: sun =>"] * 3, 16, 5, 64)]
    assert [(p["prompt"], p["rejected"]) for p in pairs] == [
        ("reverse: red cat =>", " red cat" + EOS), ("reverse: red cat =>", " cat red cat red"),
        ("reverse: sun =>", " sun sun" + EOS), ("reverse: sun =>", " moon")]
    assert {p["chosen"] for p in pairs} == {" cat red" + EOS, " sun" + EOS} and {p["kind"] for p in pairs} == {"policy"}


# Runs OpenRLHF's train_sft and train_rm (DeepSpeed on CPU) on a few dozen samples:
# ~1-2 min on a 2-core machine, most of it process start-up.
SMOKE = learn.LearnSpec(
    sft_samples=64,
    sft_batch_size=16,
    rm_train_pairs=32,
    rm_heldout_pairs=16,
    rm_policy_prompts=8,
    rm_batch_size=16,
    rl_prompts=16,
    eval_prompts=8,
    max_new_tokens=16,
)


@pytest.mark.slow
def test_build_through_openrlhf_trainers_on_cpu(tmp_path):
    assets = builder.build(tmp_path / "learn", SMOKE)
    assert assets.is_built(SMOKE) and not assets.is_built(learn.LearnSpec())
    summary = json.loads(assets.summary.read_text())
    # 8 prompts x 3 samples of an SFT policy after 4 steps: nearly all wrong, each a pair
    policy_pairs = summary["rm_policy_pairs"]
    assert 16 <= policy_pairs <= 24 and summary["rm_train_pairs"] == 32 + policy_pairs
    assert summary["sft_steps"] == 4 and summary["rm_steps"] == (32 + policy_pairs) // 16
    assert 0.0 <= summary["rm_heldout_accuracy"] <= 1.0
    assert summary["sft_policy"]["prompts"] == 8
    # the SFT baseline: every RL prompt, in order, 8 samples each
    baseline = [json.loads(line) for line in assets.sft_baseline.read_text().splitlines()]
    prompts = [json.loads(line)["input"] for line in assets.prompts.read_text().splitlines()]
    assert [row["input"] for row in baseline] == prompts and len(prompts) == SMOKE.rl_prompts
    assert all(row["samples"] == 8 and 0.0 <= row["exact_match"] <= 1.0 for row in baseline)
    # the reward model is in OpenRLHF's layout, as PPO's --reward.model_name_or_path loads it
    config = json.loads((assets.reward / "config.json").read_text())
    assert config["value_head_prefix"] == "score" and "mean" in config
    from openrlhf_oppo.models.loaders import detect_layout

    assert detect_layout(assets.reward) == "openrlhf"
    # cached: a second call returns at once, leaving the marker as it was
    marker_mtime = (assets.root / "BUILD_OK").stat().st_mtime_ns
    assert builder.build(tmp_path / "learn", SMOKE).root == assets.root
    assert (assets.root / "BUILD_OK").stat().st_mtime_ns == marker_mtime
