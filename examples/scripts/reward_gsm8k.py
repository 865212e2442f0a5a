"""GSM8K rule-based reward for `--reward.remote_url examples/scripts/reward_gsm8k.py`.

OpenRLHF 0.11.2 (`openrlhf.utils.agent.SingleTurnAgentExecutor`) loads this file in every
rollout engine and calls `reward_func(queries, prompts, labels)` once per finished sample:
`queries` are prompt + response decoded with special tokens, `prompts` the chat-templated
prompts, `labels` the dataset's `--data.label_key` (GSM8K's `answer`, which ends in
`#### <number>`). The reward is 1.0 when the last number of the response equals that
number, else 0.0; `extra_logs.accuracy` is the same value, logged per step.
"""

from __future__ import annotations

import re

import torch

# "1,234.5" (thousands separators) or "-12" / "3.75"; a sentence's final "." is not taken
NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
ASSISTANT_TURN = "<|im_start|>assistant"  # ChatML (Qwen): where the response starts


def _response(query: str, prompt: str) -> str:
    # the query starts with the prompt; should the decode differ, the last assistant turn
    # still leaves the prompt's own numbers (the question) out of the search
    if query.startswith(prompt):
        return query[len(prompt):]
    return query.rsplit(ASSISTANT_TURN, 1)[-1]


def last_number(text: str) -> float | None:
    """The last number in `text`, or None when it has none."""
    found = NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def label_number(label: str) -> float | None:
    """The number after GSM8K's `####` marker, or None when the label has no marker."""
    if "####" not in label:
        return None
    return last_number(label.rsplit("####", 1)[1])


def score(query: str, prompt: str, label: str) -> float:
    expected, got = label_number(label), last_number(_response(query, prompt))
    return float(expected is not None and got is not None and got == expected)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """{"rewards", "scores": (B,) float tensors, "extra_logs": {"accuracy": (B,)}} as OpenRLHF reads it."""
    rewards = torch.tensor([score(q, p, label) for q, p, label in zip(queries, prompts, labels)], dtype=torch.float32)
    return {"rewards": rewards, "scores": rewards.clone(), "extra_logs": {"accuracy": rewards.clone()}}
