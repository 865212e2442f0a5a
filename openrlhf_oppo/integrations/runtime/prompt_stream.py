"""The prompts OPPO admits: read from OpenRLHF's prompt dataloader as one stream, and held
per group while it is in flight."""

from __future__ import annotations

from openrlhf.trainer.ppo_utils.samples_generator import _collect_prompt_batch

from openrlhf_oppo.integrations.runtime import fixed_lengths, openrlhf_executor
from openrlhf_oppo.integrations.runtime.deltas import SampleRequest


class PromptStream:
    """OpenRLHF's prompt dataloader read as one stream, pass after pass, in the
    dataloader's own (seeded, shuffled) order: OPPO admits the prompts that
    `--schedule sync` would draw, in the same order. Position `p` of the stream is
    prompt `p % len(dataloader)` of pass `p // len(dataloader)`. Read ahead one
    group at a time as the scheduler admits them; between steps the dataloader's
    `state_dict` stands at the next unread position (OpenRLHF checkpoints it)."""

    def __init__(self, dataloader) -> None:
        self.dataloader = dataloader
        self._it = None

    def next(self) -> tuple[str, str]:
        """(prompt, label) at the next position."""
        for _ in range(2):
            if self._it is None:
                self._it = iter(self.dataloader)
            prompts, labels, _, _ = _collect_prompt_batch(self._it, 1)
            if prompts:
                return prompts[0], labels[0]
            self._it = None  # the pass is over; the next one reshuffles
        raise ValueError("the prompt dataset is empty (--data.prompt_dataset, --data.max_samples)")


class GroupPrompts:
    """The prompt of every group in flight (prompt, label, prompt ids), read from the stream
    at admission, tokenized and truncated as OpenRLHF's executor does; and the requests that
    decode the group's samples. Held until the group is trained (and in checkpoints)."""

    def __init__(self, stream: PromptStream, tokenizer, rule_rewards: bool) -> None:
        """`rule_rewards`: requests carry (prompt, label) for the engine to score the sample
        with `--reward.remote_url`."""
        self.stream = stream
        self.tokenizer = tokenizer
        self.rule_rewards = rule_rewards
        self.by_group: dict[int, tuple[str, str, list[int]]] = {}  # group id -> (prompt, label, prompt ids)
        self.max_tokens: int | None = None  # `max_new_tokens` of the step's sampling params
        self.max_len = 2048  # OpenRLHF's `max_len`: prompt and response
        self.lengths = fixed_lengths.from_env()  # task.fixed_lengths, as OpenRLHF's engines apply it

    def set_limits(self, max_tokens: int | None, max_len: int) -> None:
        self.max_tokens = max_tokens
        self.max_len = max_len

    def admit(self, group_id: int) -> tuple[str, list[int]]:
        """Read the next prompt for a new group: (prompt, prompt ids)."""
        prompt, label = self.stream.next()
        ids = self.tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
        ids = openrlhf_executor.truncate_prompt(ids, self.max_len, self.budget(len(ids)))
        self.by_group[group_id] = (prompt, label, ids)
        return prompt, ids

    def budget(self, prompt_len: int) -> int:
        return openrlhf_executor.response_budget(self.max_tokens, self.max_len, prompt_len)

    def request(self, group_id: int, sample_id: int, sample_index: int, held: list[int],
                seed: int | None) -> SampleRequest:
        """Decode sample `sample_id`, the group's `sample_index`-th, on from its `held` tokens (none for a new one)."""
        prompt, label, prompt_ids = self.by_group[group_id]
        query = (prompt, label) if self.rule_rewards else None
        budget = self.budget(len(prompt_ids))
        if self.lengths is not None:
            budget = self.lengths.length(prompt, sample_index, budget)
        return SampleRequest(sample_id, prompt_ids, held, budget, seed, query, exact=self.lengths is not None)
