"""Streaming reward actors: OPPO's replacement for OpenRLHF's batched reward forward.

Each actor holds a `StreamingRewardScorer` (incremental prefill with a KV cache per
sequence). Calls from one caller run in submission order, so routing a sample
always to the same actor (``sample_id % len(group)``) keeps its chunks in order.

`StreamingRewardModelActor` takes the place of OpenRLHF 0.11.2's `RewardModelActor`
in OpenRLHF's own reward group (`cli.train_ppo_ray` builds it with
`RayActorGroup(..., RewardModelActor, pg=pg, num_gpus_per_actor=0.2 if pg else 1)`),
so it is placed exactly where OpenRLHF places its reward model: a GPU of its own, or
a share of the colocated placement group under `--train.colocate_all` /
`--train.colocate_critic_reward`. It loads the model as OpenRLHF's reward actor does
(`--ds.param_dtype`, `--ds.attn_implementation`, `--reward.normalize_enable`,
`--ds.value_head_prefix`; a hub id or a local path), without DeepSpeed: a chunk
batch is a plain forward of a frozen model.
"""

from __future__ import annotations

import os
import time

import ray
from openrlhf.trainer.ray.launcher import BaseModelActor

from openrlhf_oppo import timeline
from openrlhf_oppo.footprint import STREAM_MAX_BATCH_TOKENS
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.reward_dispatch import ScoreReply
from openrlhf_oppo.integrations.runtime.run_config import SCORER_RESTARTS, config_from_env
from openrlhf_oppo.models.device_memory import OutOfMemoryError, release_device_memory

logger = get_logger(__name__)
# most padded tokens in one batched forward (PrefillEngine's max_batch_tokens): its padded cache
# copy and the per-sequence clones (2 x this x KV bytes per token) come out of the KV budget
MAX_BATCH_TOKENS = STREAM_MAX_BATCH_TOKENS
__all__ = ["ScoreReply", "StreamingRewardActor", "StreamingRewardModelActor", "StreamingRewardModelRayActor"]


class StreamingRewardActor:
    """One reward-model replica that prefills chunks and scores finished sequences."""

    def __init__(self, model_path: str, kv_budget_tokens: int, normalize_reward: bool, value_head_prefix: str,
                 scorers_per_host: int = 1, *, param_dtype: str | None = None, attn_implementation: str = "sdpa",
                 pooling: str = "last"):
        """`kv_budget_tokens` 0: derived from the device's memory once the model is loaded
        (`models.budget`); on a CPU host, split among `scorers_per_host` actors.
        `param_dtype` "bf16" / "fp16" as OpenRLHF's `--ds.param_dtype`; None: fp32."""
        import torch

        from openrlhf_oppo.models import StreamingRewardScorer, load_reward_model
        from openrlhf_oppo.models.budget import auto_kv_budget
        from openrlhf_oppo.models.device_memory import check_fits_device, model_bytes

        torch.set_grad_enabled(False)
        dtype = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[param_dtype]
        model = load_reward_model(
            model_path,
            normalize_reward=normalize_reward,
            value_head_prefix=value_head_prefix,
            dtype=dtype,
            attn_implementation=attn_implementation,
        )
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            check_fits_device(model_bytes(model), free, total, f"--reward.model_name_or_path {model_path}")
        model = model.to("cuda" if torch.cuda.is_available() else "cpu")
        param = next(model.parameters())
        # what was loaded, as the flags asked (recorded on the timeline by StreamingRewardModelActor)
        self.loaded = {"dtype": str(param.dtype).removeprefix("torch."),
                       "attn_implementation": model.config._attn_implementation, "pooling": pooling}
        if kv_budget_tokens > 0:
            how = "--oppo.streaming.kv_budget_tokens"
        else:
            auto = auto_kv_budget(model.config, param.dtype, param.device, share=scorers_per_host,
                                  forward_reserve_tokens=2 * MAX_BATCH_TOKENS)
            kv_budget_tokens, how = auto.tokens, f"auto: {auto.how}"
        logger.info("OPPO streaming reward actor: KV budget %s tokens (%s)", f"{kv_budget_tokens:,}", how)
        self.scorer = StreamingRewardScorer(model, kv_budget_tokens=kv_budget_tokens, pooling=pooling,
                                            max_batch_tokens=MAX_BATCH_TOKENS)

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
        if scores:  # finished caches freed: hand the blocks back to the colocated models
            release_device_memory()
        t2 = time.time()
        if extends:
            timeline.RECORDER.span("reward", "prefill", t0, t1, tokens=sum(map(len, extends.values())))
        if finishes:
            timeline.RECORDER.span("reward", "score", t1, t2, tokens=sum(map(len, finishes.values())))
        stats = self.scorer.stats()
        return ScoreReply(scores, t0, t2, self.scorer.cached_tokens, self.scorer.kv_budget_tokens,
                          stats.evictions, stats.reprefilled_tokens, stats.oom_retries)


class StreamingRewardModelActor(BaseModelActor):
    """OpenRLHF's reward-group member, streaming: `init_model_from_pretrained` is what
    OpenRLHF's trainer calls on its reward group; `open_many` / `process` are OPPO's."""

    def init_model_from_pretrained(self, strategy, pretrain: str) -> None:
        import torch

        args, oppo = strategy.args, config_from_env()
        if not isinstance(pretrain, str) or "," in pretrain:
            raise ValueError(f"--reward.model_name_or_path: OPPO streams into one reward model, got {pretrain!r}")
        t0 = time.time()
        cpu_actors = 1 if torch.cuda.is_available() else args.reward.num_nodes * args.reward.num_gpus_per_node
        self.streaming = StreamingRewardActor(
            pretrain,
            oppo.streaming.kv_budget_tokens,
            bool(args.reward.normalize_enable),
            args.ds.value_head_prefix,
            cpu_actors,  # a derived KV budget: CPU actors share the host's memory
            param_dtype=args.ds.param_dtype,
            attn_implementation=args.ds.attn_implementation,
            pooling=oppo.streaming.reward_pooling,
        )
        ctx = ray.get_runtime_context()  # where OpenRLHF placed it: its reward group's placement
        placement = {"placement_group": ctx.get_placement_group_id(),
                     "gpus": ctx.get_assigned_resources().get("GPU", 0)}
        logger.info("OPPO streaming reward actor: loaded %s (%s, %s)", pretrain, self.streaming.loaded, placement)
        timeline.RECORDER.span("reward", "load", t0, time.time(), **self.streaming.loaded, **placement)

    def empty_cache(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def open_many(self, prompts: dict[int, list[int]]) -> None:
        self.streaming.open_many(prompts)

    def process(self, extends: dict[int, list[int]], finishes: dict[int, list[int]]) -> ScoreReply:
        try:
            return self.streaming.process(extends, finishes)
        except OutOfMemoryError:
            # The engine already evicted every other cache and retried one sequence at a time.
            # A fresh process (no fragmentation, nothing else cached) is the restart path: Ray
            # restarts this actor in its bundle and the reward dispatcher re-prefills what it held.
            logger.exception("OPPO streaming reward actor: out of device memory after evicting every other "
                             "KV cache; exiting so Ray restarts it (lower --oppo.streaming.kv_budget_tokens)")
            os._exit(1)


# a dead actor is restarted by Ray in its place (its bundle); the reward dispatcher reloads its model
StreamingRewardModelRayActor = ray.remote(num_gpus=1, max_restarts=SCORER_RESTARTS)(StreamingRewardModelActor)
