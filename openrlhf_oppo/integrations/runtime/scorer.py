"""Streaming reward and reference actors: OPPO's replacement for OpenRLHF's batched reward and
reference forwards.

Each actor holds a `StreamingRewardScorer` or a `StreamingReferenceScorer` (incremental prefill with a KV cache per
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
batch is a plain forward of a frozen model. `StreamingReferenceModelActor` likewise takes
the place of `ReferenceModelActor` in OpenRLHF's reference group (built when
`--algo.kl.init_coef` > 0, colocated with the actor under `--train.colocate_actor_ref` /
`--train.colocate_all`) and holds the whole reference, not a ZeRO-3 shard of it.
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
__all__ = ["ScoreReply", "StreamingReferenceActor", "StreamingReferenceModelActor", "StreamingReferenceModelRayActor",
           "StreamingRewardActor", "StreamingRewardModelActor", "StreamingRewardModelRayActor"]


def _dtype(param_dtype: str | None):
    """`--ds.param_dtype` ("bf16" / "fp16"; None: fp32) as a torch dtype."""
    import torch

    return {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[param_dtype]


def _refuse_before_loading(model_dir, dtype, what: str, role: str) -> None:
    """Refuse, naming `what`, a checkpoint whose weights cannot fit this process's GPU, from its
    files' headers (or config.json) alone: a load would first hold it whole in host memory, in
    every actor of the group (a 70B model: ~140 GB each). Nothing to refuse without CUDA."""
    import torch

    from openrlhf_oppo.models.device_memory import check_fits_device, checkpoint_bytes

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        need = checkpoint_bytes(model_dir, dtype, lm_head=role == "reference")
        check_fits_device(need, free, total, what, role)


def _on_device(model, what: str, role: str):
    """The model on this process's GPU (refused, naming `what`, when it cannot fit) or the CPU."""
    import torch

    from openrlhf_oppo.models.device_memory import check_fits_device, model_bytes

    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        check_fits_device(model_bytes(model), free, total, what, role)
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


class _StreamingActor:
    """A scorer replica: opens samples, prefills their chunks, finishes them. `lane` names it
    (timeline row, logs); `loaded` is what was loaded, as the flags asked."""

    lane = "scorer"

    def _set_scorer(self, scorer_cls, model, kv_budget_tokens: int, scorers_per_host: int, **kwargs) -> None:
        """`kv_budget_tokens` 0: derived from the device's memory once the model is loaded
        (`models.budget`); on a CPU host, split among `scorers_per_host` actors."""
        from openrlhf_oppo.models.budget import auto_kv_budget

        param = next(model.parameters())
        self.loaded = {"dtype": str(param.dtype).removeprefix("torch."),
                       "attn_implementation": model.config._attn_implementation}
        if kv_budget_tokens > 0:
            how = "--oppo.streaming.kv_budget_tokens"
        else:
            auto = auto_kv_budget(model.config, param.dtype, param.device, share=scorers_per_host,
                                  forward_reserve_tokens=2 * MAX_BATCH_TOKENS)
            kv_budget_tokens = auto.tokens
            how = f"auto: {auto.how}"
        logger.info("OPPO streaming %s actor: KV budget %s tokens (%s)", self.lane, f"{kv_budget_tokens:,}", how)
        self.scorer = scorer_cls(model, kv_budget_tokens=kv_budget_tokens, max_batch_tokens=MAX_BATCH_TOKENS,
                                 **kwargs)

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
            timeline.RECORDER.span(self.lane, "prefill", t0, t1, tokens=sum(map(len, extends.values())))
        if finishes:
            timeline.RECORDER.span(self.lane, "score", t1, t2, tokens=sum(map(len, finishes.values())))
        stats = self.scorer.stats()
        return ScoreReply(scores, t0, t2, self.scorer.cached_tokens, self.scorer.kv_budget_tokens,
                          stats.evictions, stats.reprefilled_tokens, stats.oom_retries)


class StreamingRewardActor(_StreamingActor):
    """One reward-model replica: scores finished sequences (one float each)."""

    lane = "reward"

    def __init__(self, model_path: str, kv_budget_tokens: int, normalize_reward: bool, value_head_prefix: str,
                 scorers_per_host: int = 1, *, param_dtype: str | None = None, attn_implementation: str = "sdpa",
                 pooling: str = "last"):
        """`kv_budget_tokens`, `scorers_per_host`: as `_set_scorer`; `param_dtype` as `_dtype`."""
        from openrlhf_oppo.models import StreamingRewardScorer, load_reward_model, resolve_model_path

        what = f"--reward.model_name_or_path {model_path}"
        model_dir = resolve_model_path(model_path)
        _refuse_before_loading(model_dir, _dtype(param_dtype), what, "reward")
        model = _on_device(load_reward_model(model_dir, normalize_reward=normalize_reward,
                                             value_head_prefix=value_head_prefix, dtype=_dtype(param_dtype),
                                             attn_implementation=attn_implementation), what, "reward")
        self._set_scorer(StreamingRewardScorer, model, kv_budget_tokens, scorers_per_host, pooling=pooling)
        self.loaded["pooling"] = pooling


class StreamingReferenceActor(_StreamingActor):
    """One replica of the whole frozen reference (the actor's initial checkpoint): each finished
    sequence's result is the log-probability of every response token, as OpenRLHF's reference
    `Actor` computes it (logits divided by `--rollout.temperature`)."""

    lane = "reference"

    def __init__(self, model_path: str, kv_budget_tokens: int, temperature: float, scorers_per_host: int = 1, *,
                 param_dtype: str | None = None, attn_implementation: str = "sdpa"):
        from transformers import AutoModelForCausalLM

        from openrlhf_oppo.models import StreamingReferenceScorer
        from openrlhf_oppo.models.loaders import resolve_model_path

        what = f"--actor.model_name_or_path {model_path} (the streamed reference)"
        model_dir = resolve_model_path(model_path)
        _refuse_before_loading(model_dir, _dtype(param_dtype), what, "reference")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(param_dtype),
                                                     attn_implementation=attn_implementation).eval()
        model = _on_device(model, what, "reference")
        self._set_scorer(StreamingReferenceScorer, model, kv_budget_tokens, scorers_per_host,
                         temperature=temperature)


class _StreamingModelActor(BaseModelActor):
    """A member of one of OpenRLHF's model groups, streaming: `init_model_from_pretrained` is what
    OpenRLHF's trainer calls on the group; `open_many` / `process` are OPPO's."""

    streaming: _StreamingActor

    def _loaded(self, pretrain: str, t0: float) -> None:
        ctx = ray.get_runtime_context()  # where OpenRLHF placed it: its group's placement
        placement = {"placement_group": ctx.get_placement_group_id(),
                     "gpus": ctx.get_assigned_resources().get("GPU", 0)}
        lane = self.streaming.lane
        logger.info("OPPO streaming %s actor: loaded %s (%s, %s)", lane, pretrain, self.streaming.loaded, placement)
        timeline.RECORDER.span(lane, "load", t0, time.time(), **self.streaming.loaded, **placement)

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
            # restarts this actor in its bundle and its dispatcher re-prefills what it held.
            logger.exception("OPPO streaming %s actor: out of device memory after evicting every other KV cache; "
                             "exiting so Ray restarts it (lower --oppo.streaming.kv_budget_tokens)",
                             self.streaming.lane)
            os._exit(1)


def _cpu_actors(group_args) -> int:
    """Actors of one group sharing a CPU host's memory (a derived KV budget is split among them)."""
    import torch

    return 1 if torch.cuda.is_available() else group_args.num_nodes * group_args.num_gpus_per_node


class StreamingRewardModelActor(_StreamingModelActor):
    """In OpenRLHF's reward group, in place of its `RewardModelActor`."""

    def init_model_from_pretrained(self, strategy, pretrain: str) -> None:
        args = strategy.args
        oppo = config_from_env()
        if not isinstance(pretrain, str) or "," in pretrain:
            raise ValueError(f"--reward.model_name_or_path: OPPO streams into one reward model, got {pretrain!r}")
        t0 = time.time()
        self.streaming = StreamingRewardActor(
            pretrain, oppo.streaming.kv_budget_tokens, bool(args.reward.normalize_enable), args.ds.value_head_prefix,
            _cpu_actors(args.reward), param_dtype=args.ds.param_dtype,
            attn_implementation=args.ds.attn_implementation, pooling=oppo.streaming.reward_pooling,
        )
        self._loaded(pretrain, t0)


class StreamingReferenceModelActor(_StreamingModelActor):
    """In OpenRLHF's reference group, in place of its `ReferenceModelActor`: OpenRLHF loads it with
    the actor's checkpoint (`--actor.model_name_or_path`); the trainer takes the streamed
    log-probs instead of calling `forward` (`reference.streamed_reference_forward`)."""

    def init_model_from_pretrained(self, strategy, pretrain: str) -> None:
        args = strategy.args
        oppo = config_from_env()
        t0 = time.time()
        self.streaming = StreamingReferenceActor(
            pretrain, oppo.streaming.kv_budget_tokens, args.rollout.temperature, _cpu_actors(args.ref),
            param_dtype=args.ds.param_dtype, attn_implementation=args.ds.attn_implementation,
        )
        self._loaded(pretrain, t0)

    def forward(self, *args, **kwargs):
        raise RuntimeError("OPPO streams the reference: its log-probs come from the streamed chunks, not a batch "
                           "forward (a sample reached experience making without them)")


# a dead actor is restarted by Ray in its place (its bundle); its dispatcher reloads its model
StreamingRewardModelRayActor = ray.remote(num_gpus=1, max_restarts=SCORER_RESTARTS)(StreamingRewardModelActor)
StreamingReferenceModelRayActor = ray.remote(num_gpus=1, max_restarts=SCORER_RESTARTS)(StreamingReferenceModelActor)
