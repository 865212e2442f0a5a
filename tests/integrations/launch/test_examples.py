"""examples/scripts/reward_gsm8k.py: the rule-based GSM8K reward OpenRLHF 0.11.2 loads by path
(`--reward.remote_url`), imported here the same way, by path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[3]
PROMPT = ("<|im_start|>user\nJanet has 3 apples and buys 15 more. How many does she have?<|im_end|>\n"
          "<|im_start|>assistant\n")
LABEL = "She has 3 + 15 = <<3+15=18>>18 apples.\n#### 18"


@pytest.fixture(scope="module")
def reward():
    spec = importlib.util.spec_from_file_location("reward_func", REPO / "examples" / "scripts" / "reward_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _score(reward, response: str, label: str = LABEL) -> float:
    out = reward.reward_func([PROMPT + response + "<|im_end|>"], [PROMPT], [label])
    return out["rewards"].item()


def test_gsm8k_reward_is_one_when_the_last_number_of_the_response_is_the_label(reward):
    assert _score(reward, "3 + 15 = 18. The answer is \\boxed{18}.") == 1.0
    assert _score(reward, "The answer is 18, not 3 + 14 = 17... wait: 17") == 0.0


def test_gsm8k_reward_ignores_the_numbers_of_the_prompt(reward):
    # the question holds 3 and 15; a response without a number scores 0 even for label 15
    assert _score(reward, "I cannot tell.", label="#### 15") == 0.0
    # a query whose prompt part decodes differently: the last assistant turn is the response
    out = reward.reward_func(["<|im_start|>system\n" + PROMPT + "I cannot tell."], [PROMPT], ["#### 15"])
    assert out["rewards"].item() == 0.0


def test_gsm8k_reward_reads_thousands_separators_decimals_and_signs(reward):
    assert _score(reward, "Total: $1,000.00", label="#### 1000") == 1.0
    assert _score(reward, "It drops to -7 degrees.", label="#### -7") == 1.0
    assert _score(reward, "so 2.5 hours", label="#### 2") == 0.0


def test_gsm8k_reward_label_without_the_marker_scores_zero(reward):
    assert _score(reward, "18", label="18") == 0.0


def test_gsm8k_reward_returns_what_openrlhf_reads(reward):
    out = reward.reward_func([PROMPT + "18", PROMPT + "17"], [PROMPT, PROMPT], [LABEL, LABEL])
    assert set(out) == {"rewards", "scores", "extra_logs"}
    assert out["rewards"].dtype == torch.float32 and out["rewards"].tolist() == [1.0, 0.0]
    assert out["scores"].tolist() == [1.0, 0.0] and out["extra_logs"]["accuracy"].tolist() == [1.0, 0.0]
