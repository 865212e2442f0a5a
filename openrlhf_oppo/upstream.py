"""OpenRLHF as OPPO meets it: the pinned version, the class under a Ray actor, and every
OpenRLHF 0.11.2 symbol OPPO swaps, subclasses, wraps, patches or calls.

One row per symbol, dotted from the module (`openrlhf.trainer.ppo_trainer.PPOTrainer`,
a method as `Class.method`). `missing()` resolves each against the installed
OpenRLHF (a `@ray.remote` class is read through the class under the decorator), so a
rename upstream fails `tests/test_upstream.py` by name instead of a
run failing half-way on a cluster. docs/design.md explains each group.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

OPENRLHF_VERSION = "0.11.2"
"""The OpenRLHF release every touch point below was written against."""


def ray_actor_classes(actor) -> tuple[type, type]:
    """(the class under `@ray.remote`, Ray's subclass holding a wrapper of every method) of
    a Ray actor class made with `ray.remote(cls)` (Ray 2.55)."""
    modified = actor.__ray_metadata__.modified_class
    return modified.__mro__[1], modified


def unwrap_ray_actor(actor) -> type:
    """The plain class under a `@ray.remote` actor class, to subclass or patch."""
    return ray_actor_classes(actor)[0]


@dataclass(frozen=True)
class Touch:
    symbol: str  # openrlhf.<module>.<Name>[.<method>]
    how: str  # swapped | subclassed | wrapped | patched | called
    where: str  # the openrlhf_oppo module that does it


_T = Touch
TOUCH_POINTS: tuple[Touch, ...] = (
    # names swapped in the driver before OpenRLHF's train() imports them (oppo_trainer.patch_driver)
    _T("openrlhf.trainer.ppo_trainer.PPOTrainer", "swapped", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ppo_trainer_async.PPOTrainerAsync", "swapped", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor", "swapped", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ray.launcher.RewardModelActor", "swapped", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ray.launcher.ReferenceModelActor", "swapped", "integrations.runtime.trainer"),
    # the streamed reference log-probs in place of the reference group's forward
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker._dispatch_forward", "wrapped",
       "integrations.runtime.reference"),
    # old log-probs from the rollout for samples the current weights decoded (--oppo.train.old_logprobs)
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker._dispatch_forward", "wrapped",
       "integrations.runtime.old_logprobs"),
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker._flatten_results", "wrapped",
       "integrations.runtime.old_logprobs"),
    # experience making's micro-batches cut by length (--oppo.train.length_buckets)
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.split_rollout_samples", "wrapped",
       "integrations.runtime.micro_batches"),
    _T("openrlhf.trainer.ppo_utils.experience.Experience.concat_experiences", "called",
       "integrations.runtime.micro_batches"),
    # whole-tensor advantages and returns (--oppo.train.vectorized_advantages)
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.get_advantages_and_returns", "swapped",
       "integrations.runtime.advantages"),
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.get_cumulative_returns", "swapped",
       "integrations.runtime.advantages"),
    _T("openrlhf.trainer.ray.vllm_engine.create_vllm_engines", "called", "integrations.runtime.trainer"),
    # OPPO's classes are subclasses of OpenRLHF's
    _T("openrlhf.trainer.ppo_trainer.BasePPOTrainer", "subclassed", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator", "subclassed", "integrations.runtime.generator"),
    _T("openrlhf.trainer.ppo_utils.samples_generator._collect_prompt_batch", "called", "integrations.runtime.prompt_stream"),
    _T("openrlhf.trainer.ray.launcher.BaseModelActor", "subclassed", "integrations.runtime.scorer"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.pause_generation", "subclassed", "integrations.runtime.rollout"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.resume_generation", "called", "integrations.runtime.engine_pool"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.sleep", "called", "integrations.runtime.engine_pool"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.wake_up", "called", "integrations.runtime.engine_pool"),
    # rule-based / remote rewards, scored in the engine with OpenRLHF's own executor
    _T("openrlhf.utils.agent.SingleTurnAgentExecutor._fetch_rewards_via_func", "called", "integrations.runtime.rollout"),
    _T("openrlhf.utils.agent.SingleTurnAgentExecutor._fetch_rewards_via_http", "called", "integrations.runtime.rollout"),
    # timeline spans around OpenRLHF's own stages (integrations.runtime.timeline_hooks), every schedule
    _T("openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator.generate_samples", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ppo_utils.experience_maker.RemoteExperienceMaker.make_experience_batch", "wrapped",
       "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ppo_trainer.BasePPOTrainer.ppo_train", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ppo_trainer.BasePPOTrainer.broadcast_to_vllm", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ppo_trainer.BasePPOTrainer.train_step", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.generate", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.update_weight", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.update_weight_cuda_ipc", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.launcher.ReferenceModelActor.forward", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.launcher.RewardModelActor.forward", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.ppo_actor.PolicyModelActor.forward", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.ppo_actor.PolicyModelActor.fit", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.ppo_actor.PolicyModelActor.broadcast_to_vllm", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.ppo_critic.CriticModelActor.forward", "wrapped", "integrations.runtime.timeline_hooks"),
    _T("openrlhf.trainer.ray.ppo_critic.CriticModelActor.fit", "wrapped", "integrations.runtime.timeline_hooks"),
    # length-bucketed training micro-batches (integrations.runtime.micro_batches), OPPO's runs
    _T("openrlhf.trainer.ray.ppo_actor.iter_grad_accum_global_norm", "wrapped", "integrations.runtime.micro_batches"),
    _T("openrlhf.trainer.ray.ppo_critic.iter_grad_accum_global_norm", "wrapped", "integrations.runtime.micro_batches"),
    _T("openrlhf.trainer.ppo_utils.replay_buffer.NaiveReplayBuffer.collate_fn", "called", "integrations.runtime.micro_batches"),
    # seeded samples for same-sample comparisons (integrations.runtime.seeding, compat layer)
    _T("openrlhf.trainer.ppo_utils.samples_generator.SamplingParams", "patched", "integrations.runtime.seeding"),
    _T("openrlhf.trainer.ppo_trainer.prepare_datasets", "patched", "integrations.runtime.seeding"),
    # what lets OpenRLHF run without CUDA (compat.patches; applied only where CUDA is absent)
    _T("openrlhf.models.ring_attn_utils", "patched", "compat.patches"),
    _T("openrlhf.utils.deepspeed.deepspeed.DeepspeedStrategy.setup_distributed", "patched", "compat.patches"),
    _T("openrlhf.utils.deepspeed.deepspeed.get_train_ds_config", "patched", "compat.patches"),
    _T("openrlhf.utils.deepspeed.deepspeed.get_eval_ds_config", "patched", "compat.patches"),
    _T("openrlhf.trainer.ppo_utils.replay_buffer.NaiveReplayBuffer", "patched", "compat.patches"),
    _T("openrlhf.trainer.ray.launcher.BaseDistributedActor._get_free_port", "patched", "compat.patches"),
    _T("openrlhf.trainer.ray.launcher.BaseModelActor._setup_distributed", "patched", "compat.patches"),
    _T("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer.broadcast_to_vllm", "patched", "compat.patches"),
    _T("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer._init_vllm_sync_group", "patched", "compat.patches"),
    _T("openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap.update_weight", "patched", "compat.patches"),
    _T("openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap.init_process_group", "patched", "compat.patches"),
    _T("openrlhf.datasets.reward_dataset.RewardDataset", "patched", "compat.patches"),
    _T("openrlhf.datasets.sft_dataset.SFTDataset", "patched", "compat.patches"),
    # the ZeRO-3 gather check of the compat layer
    _T("openrlhf.models.Actor", "called", "compat.zero3_check"),
    # the learnable task's reward model, scored as OpenRLHF loads it
    _T("openrlhf.models.get_llm_for_sequence_regression", "called", "tasks.learn.evaluation"),
    # the Megatron backend trains with OpenRLHF's losses and normalisation; its check runs OpenRLHF's actor
    _T("openrlhf.models.loss.PolicyLoss", "called", "megatron.engine"),
    _T("openrlhf.models.loss.aggregate_loss", "called", "megatron.engine"),
    _T("openrlhf.models.utils.compute_approx_kl", "called", "megatron.engine"),
    _T("openrlhf.utils.loss_utils._optimizer_step_loss_norm", "called", "megatron.engine"),
    _T("openrlhf.utils.loss_utils.iter_grad_accum_global_norm", "called", "megatron.equivalence"),
    _T("openrlhf.models.Actor", "called", "megatron.equivalence"),
    # the Megatron actor in place of OpenRLHF's policy actor (--oppo.megatron.enable)
    _T("openrlhf.trainer.ray.ppo_actor.PolicyModelActor", "swapped", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ray.launcher.BaseModelActor.execute_batch", "subclassed", "integrations.runtime.megatron_actor"),
    _T("openrlhf.trainer.ray.launcher.RayActorGroup.async_run_method_batch", "called", "integrations.runtime.megatron_actor"),
    _T("openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer._init_vllm_sync_group", "called", "integrations.runtime.megatron_actor"),
    _T("openrlhf.trainer.ppo_utils.replay_buffer.NaiveReplayBuffer", "called", "integrations.runtime.megatron_actor"),
    _T("openrlhf.utils.get_tokenizer", "called", "integrations.runtime.megatron_actor"),
    # the weight sync off the trainer's path (--oppo.staleness.background_sync)
    _T("openrlhf.trainer.ray.ppo_actor.PolicyModelActor.broadcast_to_vllm", "subclassed", "integrations.runtime.background_sync"),
    _T("openrlhf.trainer.ray.launcher.RayActorGroup.async_run_method", "called", "integrations.runtime.trainer"),
    _T("openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap.update_weight", "called", "integrations.runtime.rollout"),
    # its shards (--oppo.staleness.background_sync_buffer shards): every actor rank and engine worker in one group
    _T("openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap", "subclassed", "integrations.runtime.worker_ext"),
    _T("openrlhf.trainer.ray.vllm_engine.RolloutRayActor.init_process_group", "called",
       "integrations.runtime.background_sync"),
    _T("openrlhf.utils.distributed_util.stateless_init_process_group", "called", "integrations.runtime.background_sync"),
)


def _resolve(symbol: str) -> object:
    parts = symbol.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            inner = ray_actor_classes(obj)[1] if hasattr(obj, "__ray_metadata__") else None
            obj = getattr(inner if inner is not None and not hasattr(obj, name) else obj, name)
        return obj
    raise ImportError(symbol)


def missing(touch_points: tuple[Touch, ...] = TOUCH_POINTS, package: str = "openrlhf_oppo") -> list[str]:
    """Rows whose symbol the installed OpenRLHF lacks, with the error (`package`: whose modules
    the rows' `where` names)."""
    out = []
    for touch in touch_points:
        try:
            _resolve(touch.symbol)
        except (ImportError, AttributeError) as exc:
            out.append(f"{touch.symbol} ({touch.how} by {package}.{touch.where}): {exc!r}")
    return out
