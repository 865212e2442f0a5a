"""The learnable task (openrlhf_oppo.tasks.learn): prompts with a long length tail, a
checker that accepts the gold answer and rejects every kind of plausible mistake,
preference pairs that differ, the data splits and the evaluation's arithmetic. Building the
models is the lab's (oppo_lab/tests/tasks/test_learn_build.py)."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from openrlhf_oppo import tasks
from openrlhf_oppo.tasks import learn
from openrlhf_oppo.tasks.learn import evaluation

EOS = "<|eos|>"


def test_answer_is_the_reversed_list():
    assert learn.answer("reverse: red cat blue dog =>") == "dog blue cat red"
    assert learn.parse_prompt(learn.make_prompt(["sun", "moon"])) == ["sun", "moon"]


def test_prompt_not_of_the_task_is_refused():
    with pytest.raises(ValueError, match="not a reverse prompt"):
        learn.parse_prompt("question: red cat answer:")


def test_list_lengths_have_a_long_tail():
    rl_law = learn.LearnSpec().lengths
    words = [len(learn.parse_prompt(r["input"])) for r in learn.prompt_records(20000, seed=5, lengths=rl_law)]
    share = Counter("short" if n <= 6 else "mid" if n <= 14 else "long" for n in words)
    assert 0.58 < share["short"] / len(words) < 0.62
    assert 0.09 < share["long"] / len(words) < 0.11
    assert min(words) == 1 and max(words) == 40
    assert sorted(words)[len(words) // 2] <= 6 < 15 <= sorted(words)[int(0.92 * len(words))]


def test_sft_lists_are_mostly_short():
    words = [len(learn.parse_prompt(r["input"])) for r in learn.sft_records(20000, seed=5, eos_token=EOS)]
    share = Counter("short" if n <= 6 else "mid" if n <= 14 else "long" for n in words)
    assert 0.83 < share["short"] / len(words) < 0.87 and 0.04 < share["long"] / len(words) < 0.06


def test_labels_are_the_ground_truth():
    for rec in learn.prompt_records(50, seed=2):
        assert rec["label"] == learn.answer(rec["input"])
        assert learn.exact_match(rec["input"], " " + rec["label"])


def test_exact_match_ignores_spacing_and_eos_text():
    prompt = "reverse: red cat blue =>"
    assert learn.exact_match(prompt, " blue cat red")
    assert learn.exact_match(prompt, "blue  cat red \n")
    assert learn.exact_match(prompt, " blue cat red<|eos|>")
    assert learn.exact_match(prompt, " blue cat red<|eos|> trailing junk after EOS")
    assert not learn.exact_match(prompt, " blue cat red red")
    assert not learn.exact_match(prompt, "")


@pytest.mark.parametrize("kind, expected", [
    ("swap", " cat blue red"),  # adjacent, both spots differ: the rng picks one
    ("unreversed", "red cat blue"),
])
def test_mistake_of_a_three_word_list(kind, expected):
    wrong = learn.mistake(kind, "reverse: red cat blue =>", random.Random(0))
    assert wrong.split() != ["blue", "cat", "red"]
    if kind == "unreversed":
        assert wrong == expected


def test_one_word_list_admits_only_repeat_substitute_run_on_and_loop():
    rng = random.Random(0)
    applicable = {k for k in learn.MISTAKES if learn.mistake(k, "reverse: sun =>", rng) is not None}
    assert applicable == {"repeat", "substitute", "run_on", "loop"}
    assert learn.mistake("repeat", "reverse: sun =>", rng) == "sun sun"


def test_palindrome_has_no_unreversed_mistake():
    assert learn.mistake("unreversed", "reverse: red cat red =>", random.Random(0)) is None
    assert learn.mistake("swap", "reverse: cat cat =>", random.Random(0)) is None


def test_checker_rejects_every_mistake_kind():
    rng = random.Random(3)
    tried = Counter()
    for rec in learn.prompt_records(300, seed=11):
        for kind in learn.MISTAKES:
            wrong = learn.mistake(kind, rec["input"], rng)
            if wrong is not None:
                tried[kind] += 1
                assert not learn.exact_match(rec["input"], " " + wrong), (kind, rec["input"], wrong)
    assert set(tried) == set(learn.MISTAKES) and min(tried.values()) > 100


def test_preference_pairs_differ_and_only_chosen_is_correct():
    pairs = learn.preference_pairs(400, seed=7, eos_token=EOS)
    assert {p["kind"] for p in pairs} == set(learn.MISTAKES)
    for p in pairs:
        assert p["chosen"] != p["rejected"]
        assert p["chosen"].startswith(" ") and p["chosen"].endswith(EOS)
        # a response ends with EOS unless it ran on to the cap, where a sample ends without one
        words = len(p["rejected"].removesuffix(EOS).split())
        assert p["rejected"].endswith(EOS) == (words < learn.RESPONSE_CAP) and words <= learn.RESPONSE_CAP
        assert learn.exact_match(p["prompt"], p["chosen"], EOS)
        assert not learn.exact_match(p["prompt"], p["rejected"], EOS)


def test_run_on_continues_the_answer_half_the_time_to_the_cap():
    rng = random.Random(0)
    prompt = "reverse: red cat blue =>"
    outs = [learn.mistake("run_on", prompt, rng).split() for _ in range(400)]
    assert all(o[:3] == ["blue", "cat", "red"] and 3 < len(o) <= learn.RESPONSE_CAP for o in outs)
    at_cap = sum(len(o) == learn.RESPONSE_CAP for o in outs) / len(outs)
    assert 0.4 < at_cap < 0.6
    assert learn.mistake("run_on", learn.make_prompt(["sun"] * learn.RESPONSE_CAP), rng) is None  # no room


def test_kind_weights_shift_the_mix_of_mistakes():
    weights = {"swap": 3.0, "substitute": 3.0, "unreversed": 2.0, "drop": 1.0, "repeat": 1.0, "truncate": 1.0}
    weighted = Counter(p["kind"] for p in learn.preference_pairs(3000, seed=7, eos_token=EOS, kind_weights=weights))
    uniform = Counter(p["kind"] for p in learn.preference_pairs(3000, seed=7, eos_token=EOS))
    assert weighted["substitute"] > 1.4 * uniform["substitute"] and weighted["drop"] < uniform["drop"]
    only_local = Counter(p["kind"] for p in learn.preference_pairs(200, seed=7, eos_token=EOS,
                                                                   kind_weights={"substitute": 1.0}))
    assert set(only_local) == {"substitute"}


def test_splits_are_seeded():
    assert learn.prompt_records(20, seed=1) == learn.prompt_records(20, seed=1)
    assert learn.prompt_records(20, seed=1) != learn.prompt_records(20, seed=2)
    sft = learn.sft_records(5, seed=1, eos_token=EOS)
    assert [r["input"] for r in sft] == [r["input"] for r in learn.prompt_records(5, seed=1)]
    assert all(r["output"] == " " + learn.answer(r["input"]) + EOS for r in sft)


def test_write_data_splits(tmp_path):
    spec = learn.LearnSpec(sft_samples=30, sft_batch_size=10, rm_train_pairs=20, rm_batch_size=10,
                           rm_heldout_pairs=10, rl_prompts=40, eval_prompts=8)
    assets = learn.LearnAssets(tmp_path)
    learn.write_data(assets, spec, EOS)
    rows = {name: [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
            for name in ("data/sft.jsonl", "data/rm_mistakes.jsonl", "data/rm_heldout.jsonl", "prompts.jsonl")}
    assert [len(v) for v in rows.values()] == [30, 20, 10, 40]
    assert set(rows["data/sft.jsonl"][0]) == {"input", "output"}
    assert set(rows["data/rm_mistakes.jsonl"][0]) == {"prompt", "chosen", "rejected", "kind"}
    assert set(rows["prompts.jsonl"][0]) == {"input", "label"}
    assert rows["data/rm_mistakes.jsonl"][:10] != rows["data/rm_heldout.jsonl"]


def test_variant_registry_names_learn():
    assert "learn" in tasks.VARIANTS and {"tiny", "longtail"} <= set(tasks.VARIANTS)
    assert tasks.default_root("learn") == learn.DEFAULT_ASSETS_DIR
    assert learn.DEFAULT_ASSETS_DIR.name == "learn"
    with pytest.raises(ValueError, match="allowed: tiny, longtail, learn"):
        tasks.build("lern")


def test_marker_changes_with_the_spec():
    assert learn.build_marker(learn.LearnSpec()) != learn.build_marker(learn.LearnSpec(sft_samples=640))


def test_quantile_and_auc_by_hand():
    assert evaluation.quantile([5, 1, 3, 2, 4], 0.5) == 3
    assert evaluation.quantile(list(range(1, 101)), 0.95) == 95
    assert evaluation.quantile([7], 0.95) == 7
    assert evaluation.auc([3.0, 1.0], [2.0, 0.0]) == 0.75  # 3>2, 3>0, 1>0; 1<2
    assert evaluation.auc([1.0], [1.0]) == 0.5
    assert evaluation.auc([], [1.0]) is None
