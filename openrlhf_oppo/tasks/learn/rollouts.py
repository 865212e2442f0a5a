"""What a learn-task run's `rollouts.jsonl` says: each step's trained samples cut into prompt and
response (`ResponseText`), their lengths and exact-match flags (`trained_samples`), and the SFT
policy's per-prompt baseline (`load_baseline`). Read by `openrlhf-oppo train`'s closing summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from openrlhf_oppo.tasks.learn.task import exact_match


class Tokenizer(Protocol):  # the part of a transformers tokenizer used here
    eos_token: str

    def __call__(self, text: str, add_special_tokens: bool = ...) -> dict: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class ResponseText:
    """Cuts a `rollouts.jsonl` sequence into prompt and response and decodes the response.
    OpenRLHF's vLLM path builds a sequence as the prompt tokenized without special tokens
    followed by the response's ids (EOS included), so the prompt's ids are its prefix."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_token = tokenizer.eos_token
        self.prompt_ids: dict[str, list[int]] = {}  # prompt text -> ids (prompts repeat across runs)

    def response_ids(self, prompt: str, sequence: list[int]) -> list[int] | None:
        """The response's ids, None when the sequence does not start with the prompt's ids."""
        ids = self.prompt_ids.get(prompt)
        if ids is None:
            ids = self.prompt_ids[prompt] = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        return list(sequence[len(ids):]) if list(sequence[: len(ids)]) == ids else None

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(path: Path) -> ResponseText:
    from transformers import AutoTokenizer

    return ResponseText(AutoTokenizer.from_pretrained(str(path)))


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return rows


def trained_samples(record: dict, text: ResponseText | None) -> dict:
    """One `rollouts.jsonl` line -> the step's trained response lengths (tokens; none without
    a tokenizer), exact-match flags (None: no tokenizer and no text, or prompts that are not
    the learn task's) and how many sequences did not start with their prompt's tokens (left out)."""
    lengths: list[int] = []
    exact: list[bool] | None = []
    mismatches = 0
    for sample in record.get("samples", []):
        response = sample.get("response")  # text, where a record holds it
        if text is not None:
            ids = text.response_ids(sample["prompt"], sample["sequence"])
            if ids is None:
                mismatches += 1
                continue
            lengths.append(len(ids))
            if response is None:
                response = text.decode(ids)
        if exact is None:
            continue
        if response is None:
            exact = None
            continue
        try:
            if text:
                matched = exact_match(sample["prompt"], response, text.eos_token)
            else:
                matched = exact_match(sample["prompt"], response)
        except ValueError:  # not a learn-task prompt: no ground truth
            exact = None
            continue
        exact.append(matched)
    return {"lengths": lengths, "exact": exact, "mismatches": mismatches}


Baseline = dict  # prompt -> (the SFT policy's mean reward, its exact-match rate): tasks.learn.evaluation.sft_baseline


def load_baseline(path: Path) -> Baseline | None:
    """A learn task's `data/sft_baseline.jsonl` as a Baseline; None if it is absent."""
    return {r["input"]: (r["reward"], r["exact_match"]) for r in jsonl(path)} or None
