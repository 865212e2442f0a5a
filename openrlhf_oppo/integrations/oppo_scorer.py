"""Streaming reward actor group: OPPO's replacement for OpenRLHF's batched reward forward.

Each actor holds a `StreamingRewardScorer` (incremental prefill with a KV cache per
sequence). Calls from one caller run in submission order, so routing a sample
always to the same actor (``sample_id % len(group)``) keeps its chunks in order.
Not ZeRO-3: calls are per chunk batch, a plain forward of a frozen model. On a GPU
cluster each actor takes one GPU (`num_gpus=1`); OpenRLHF still creates its own reward
model group (its `train()` does whenever `--reward.remote_url` is unset), which then
sits idle while OPPO streams.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ray

from openrlhf_oppo import timeline


@dataclass(frozen=True)
class ScoreReply:
    """What one `process` call returns: rewards of the samples it finished, and when it worked."""

    scores: dict[int, float]
    start_s: float  # time.time() at the call's start and end: the actor's busy interval
    end_s: float
    kv_tokens: int = 0  # tokens the actor holds in KV caches after the call
    kv_budget_tokens: int = 0  # its budget (explicit, or derived from the device's memory)


class StreamingRewardActor:
    """One reward-model replica that prefills chunks and scores finished sequences."""

    def __init__(self, model_path: str, kv_budget_tokens: int, normalize_reward: bool, value_head_prefix: str,
                 scorers_per_host: int = 1):
        """`kv_budget_tokens` 0: derived from the device's memory once the model is loaded
        (`models.budget`); on a CPU host, split among `scorers_per_host` actors."""
        import torch

        from openrlhf_oppo.models import StreamingRewardScorer, load_reward_model
        from openrlhf_oppo.models.budget import auto_kv_budget

        torch.set_grad_enabled(False)
        # fp32 on CPU; on a GPU the reward model's own bf16, as OpenRLHF runs it
        cuda = torch.cuda.is_available()
        model = load_reward_model(
            model_path,
            normalize_reward=normalize_reward,
            value_head_prefix=value_head_prefix,
            dtype=torch.bfloat16 if cuda else torch.float32,
        ).to("cuda" if cuda else "cpu")
        if kv_budget_tokens > 0:
            how = "--oppo.streaming.kv_budget_tokens"
        else:
            param = next(model.parameters())
            auto = auto_kv_budget(model.config, param.dtype, param.device, share=scorers_per_host)
            kv_budget_tokens, how = auto.tokens, f"auto: {auto.how}"
        print(f"OPPO streaming reward actor: KV budget {kv_budget_tokens:,} tokens ({how})", flush=True)
        self.scorer = StreamingRewardScorer(model, kv_budget_tokens=kv_budget_tokens)

    def open_many(self, prompts: dict[int, list[int]]) -> None:
        for seq_id, prompt_ids in prompts.items():
            self.scorer.open(seq_id, prompt_ids)

    def process(self, extends: dict[int, list[int]], finishes: dict[int, list[int]]) -> ScoreReply:
        """Prefill `extends`, then prefill the last chunks in `finishes` and score them."""
        t0 = time.time()
        if extends:
            self.scorer.extend_many(extends)
        t1 = time.time()
        scores = self.scorer.finish_many(finishes) if finishes else {}
        for seq_id in scores:
            self.scorer.drop(seq_id)
        t2 = time.time()
        if extends:
            timeline.RECORDER.span("reward", "prefill", t0, t1, tokens=sum(map(len, extends.values())))
        if finishes:
            timeline.RECORDER.span("reward", "score", t1, t2, tokens=sum(map(len, finishes.values())))
        return ScoreReply(scores, t0, t2, self.scorer.cached_tokens, self.scorer.kv_budget_tokens)


StreamingRewardRayActor = ray.remote(StreamingRewardActor)
