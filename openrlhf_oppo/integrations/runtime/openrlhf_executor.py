"""What OPPO copies from OpenRLHF's executor (mirrors OpenRLHF 0.11.2, keep in step with upstream).

TRY NOT TO MODIFY: none of this is OPPO's algorithm. Each function repeats what
`openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator._dispatch_prompts_to_vllm`
and the rollout executor (`openrlhf.utils.agent.SingleTurnAgentExecutor`) do for a
prompt, so that a sample OPPO decodes is sampled, truncated and handed to training as
OpenRLHF's own would be. When upstream changes one of them, change it here.

- `sampling_params`: the vLLM `SamplingParams` OpenRLHF builds from `generate_kwargs`;
- `response_budget` / `truncate_prompt`: how the executor sizes a response and cuts a
  long prompt to `max_len`;
- `response`: the executor's per-sample output dict, which OpenRLHF's
  `SamplesGenerator._process_response_into_experience` turns into an `Experience`.
"""

from __future__ import annotations

from typing import Any

from vllm import SamplingParams

from openrlhf_oppo.core import TrainSample


def sampling_params(generate_kwargs: dict[str, Any], record_logprobs: bool, detokenize: bool = True) -> SamplingParams:
    """OpenRLHF's parameters; `detokenize` (OPPO's, not OpenRLHF's: `run_config.engine_text_needed`)
    False spares the engines the text nobody reads."""
    return SamplingParams(
        temperature=generate_kwargs.get("temperature", 1.0),
        top_p=generate_kwargs.get("top_p", 1.0),
        top_k=generate_kwargs.get("top_k", -1),
        max_tokens=generate_kwargs.get("max_new_tokens"),
        min_tokens=generate_kwargs.get("min_new_tokens", 1),
        skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
        # rollout logprobs only where a correction uses them (as OpenRLHF requests them)
        logprobs=1 if record_logprobs else None,
        detokenize=detokenize,
    )


def response_budget(max_tokens: int | None, max_len: int, prompt_len: int) -> int:
    """Response tokens of a sample: `max_new_tokens`, or what `max_len` leaves after the prompt."""
    return max_tokens if max_tokens is not None else max(1, max_len - prompt_len)


def truncate_prompt(prompt_ids: list[int], max_len: int, budget: int) -> list[int]:
    """A long prompt keeps its last tokens, as the executor truncates it."""
    return prompt_ids[-max(1, max_len - budget):]


def response(prompt: str, label: str, prompt_ids: list[int], sample: TrainSample, scored: dict,
             record_logprobs: bool) -> dict[str, Any]:
    """The executor's output for one sample. `scored`: {"reward", "scores", "extra_logs"} as far
    as known (empty: OpenRLHF's reward forward scores the batch)."""
    tokens = sample.token_ids
    reward = scored.get("reward")
    return {
        "prompt": prompt,
        "label": label,
        "images": None,
        "mm_train_inputs": None,
        "observation_tokens": prompt_ids + tokens,
        "action_ranges": [(len(prompt_ids), len(prompt_ids) + len(tokens))],
        "rollout_log_probs": [0.0] * len(prompt_ids) + sample.rollout_logprobs if record_logprobs else None,
        "truncated": sample.finish_reason == "length",
        "reward": reward,
        "scores": scored.get("scores", reward),
        "extra_logs": scored.get("extra_logs", {}),
    }
