"""Every point where OPPO touches OpenRLHF's PPO pipeline (written against OpenRLHF 0.11.2).

Three names are swapped in the driver process before OpenRLHF's `train_ppo_ray.train`
runs; each is looked up by name at call time there (`RolloutRayActor` by
`create_vllm_engines`):

1. `openrlhf.trainer.ppo_trainer.PPOTrainer` -> `OppoPPOTrainer`, one subclass of
   OpenRLHF's synchronous trainer (and `ppo_trainer_async.PPOTrainerAsync` -> the same: with
   `--train.async_enable`, which the driver allows only with OPPO's async admission, OpenRLHF
   places the models as in its async mode and OPPO's trainer runs them) that
   - replaces its samples generator with `OppoSamplesGenerator`,
   - pauses generation around the weight sync (carried requests are kept) and
     stamps later tokens with the new policy version, its waits bounded
     (`--oppo.timeouts.*`: a stall ends the run naming what was waited for),
   - closes each OPPO step once the batch's mean reward is known (it feeds Δ) and
     merges the `oppo/*` metrics into the status OpenRLHF logs to wandb /
     TensorBoard (and appends them to a JSONL file),
   - keeps the scheduler's state (carried groups with tokens, logprobs, versions;
     Δ, C; prompt-stream position; the ledger of trained groups) in OpenRLHF's
     checkpoint `client_states`,
   - computes advantages and returns in whole-tensor operations and times that step (`advantages`),
   - takes old log-probs from the rollout for samples the current weights decoded, the actor's forward
     for the rest (`old_logprobs`),
   - refuses to train on NaN/inf values, rewards, log-probs or losses, or on a
     response without tokens (`guards`), naming the step and samples.
2. `openrlhf.trainer.ray.vllm_engine.RolloutRayActor` -> `OppoRolloutRayActor`.
3. When OPPO streams rewards: `openrlhf.trainer.ray.launcher.RewardModelActor` ->
   `StreamingRewardModelRayActor`, so OpenRLHF's own reward group (its placement,
   colocated or not, and its model flags) is made of streaming reward actors.
4. When OPPO streams the reference (`--oppo.streaming.reference`):
   `openrlhf.trainer.ray.launcher.ReferenceModelActor` -> `StreamingReferenceModelRayActor`
   likewise, and the trainer's experience maker takes the streamed log-probs in place of
   the reference group's forward (`reference.streamed_reference_forward`).

(Ray copies an actor class's methods when it wraps it, so patching
`BasePPOTrainer` in place would not reach the running trainer; a subclass does.)
`tests/integrations/runtime/test_oppo_touch_points.py` fails if upstream moves these; every
OpenRLHF symbol OPPO relies on is listed in `touch_points.TOUCH_POINTS`.
"""

from __future__ import annotations

import dataclasses
import json

import ray
from openrlhf.trainer import ppo_trainer as _ppo_trainer
from openrlhf.trainer import ppo_trainer_async as _ppo_trainer_async
from openrlhf.trainer.ray import launcher as _launcher
from openrlhf.trainer.ray import vllm_engine as _vllm_engine

from openrlhf_oppo import run_env, timeline
from openrlhf_oppo.config import ASYNC_POLICY_LAG
from openrlhf_oppo.core import OverlapScheduler
from openrlhf_oppo.integrations.runtime import advantages, background_sync, faults, guards, micro_batches, old_logprobs
from openrlhf_oppo.integrations.runtime.engine_pool import EnginePool
from openrlhf_oppo.integrations.runtime.generator import OppoSamplesGenerator
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.ray_calls import Stalled
from openrlhf_oppo.integrations.runtime.reference import streamed_reference_forward
from openrlhf_oppo.integrations.runtime.reward_dispatch import REFERENCE, REWARD, ScorerDispatcher, Scorers
from openrlhf_oppo.integrations.runtime.rollout import OppoRolloutRayActor
from openrlhf_oppo.integrations.runtime.run_config import config_from_env, reward_mode
from openrlhf_oppo.integrations.runtime.scorer import StreamingReferenceModelRayActor, StreamingRewardModelRayActor
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter
from openrlhf_oppo.integrations.runtime.step_mode import resolve_mode
from openrlhf_oppo.upstream import unwrap_ray_actor

STATE_KEY = "oppo_generator"
log = get_logger(__name__)


class StopRequested(RuntimeError):
    """The launcher was asked to stop (SIGTERM/SIGINT): the step ended and a checkpoint was written."""


def _streamed_group(group, streamed: bool, what: str) -> list:
    """The actors of one of OpenRLHF's groups that OPPO streams into (none when not streamed)."""
    actors = list(group._actor_handlers) if streamed and group is not None else []
    if streamed and not actors:
        raise RuntimeError(f"OPPO streams the {what} but OpenRLHF built no {what} group (see trainer.patch_driver)")
    return actors


def admission_warnings(lag: int, args) -> list[str]:
    """Start-up warnings on async admission's policy lag bound `lag` (`--oppo.staleness.max_policy_lag`)."""
    flag = f"OPPO: --oppo.staleness.max_policy_lag {lag}"
    out = []
    if lag and args.train.colocate_all and not args.train.async_enable:
        out.append(f"{flag} with --train.colocate_all: the vLLM engines share the training GPUs, so the groups "
                   "admitted at each batch decode beside the update, not on idle GPUs (little to gain, memory "
                   "shared); async admission is for vLLM on its own GPUs (add --train.async_enable: the DeepSpeed "
                   "models keep sharing theirs, as in OpenRLHF's async mode; or drop --train.colocate_all)")
    if lag > ASYNC_POLICY_LAG:
        out.append(f"{flag}: a bound above {ASYNC_POLICY_LAG} trains on staler tokens than the async schedules "
                   f"allow and may learn less per step than sync; use --oppo.staleness.max_policy_lag "
                   f"{ASYNC_POLICY_LAG} (the async schedules' bound) unless a run on your task shows the higher "
                   f"bound learns as well (docs/evidence.md#policy-lag)")
    return out


def build_samples_generator(base, reward_group, reference_group=None) -> OppoSamplesGenerator:
    """OPPO's generator in place of OpenRLHF's `base` (which only holds references, nothing
    started), with its collaborators and the run's step mode. `reward_group` / `reference_group`:
    OpenRLHF's groups, made of OPPO's streaming actors when OPPO streams into them (`patch_driver`)."""
    args = base.strategy.args
    oppo = config_from_env()
    # an actor that dies is restarted by Ray; its held samples are re-prefilled (`ScorerDispatcher`)
    actors = _streamed_group(reward_group, reward_mode(args, oppo) == "stream", "reward")
    ref_actors = _streamed_group(reference_group, "reference" in oppo.streaming.scorers(), "reference")
    lag = oppo.staleness.max_policy_lag
    for message in admission_warnings(lag, args):
        log.warning(message)
    mode = resolve_mode(oppo.staleness, args, run_env.compat_enabled())
    # the scheduler reads the resolved settings too (it keeps a carried sample's KV as the engines do)
    staleness = dataclasses.replace(oppo.staleness, carried_in_training=mode.carried.value,
                                    keep_kv_cache=mode.keep_kv_cache)
    oppo = dataclasses.replace(oppo, staleness=staleness)
    scorers = []
    if actors:
        scorers.append(REWARD)
    if ref_actors:
        scorers.append(REFERENCE)
    scheduler = OverlapScheduler(oppo, batch_groups=args.rollout.batch_size,
                                 samples_per_group=args.rollout.n_samples_per_prompt, scorers=tuple(scorers))
    deferrals = f"--oppo.staleness.max_deferral_steps {oppo.staleness.max_deferral_steps}"
    if lag:
        bounds = f"--oppo.staleness.max_policy_lag {lag} (or {deferrals})"
    else:
        bounds = deferrals
    meter = StepMeter(scorers=len(actors), bounds=bounds)
    reward = ScorerDispatcher(actors, scheduler, meter, base.strategy, args.reward.model_name_or_path)
    reference = ScorerDispatcher(ref_actors, scheduler, meter.add_scorer("reference_scorer", len(ref_actors)),
                                 base.strategy, args.actor.model_name_or_path, name=REFERENCE)
    engines = EnginePool(base.vllm_engines, timeouts=oppo.timeouts,
                         gpu_memory_utilization=getattr(args.vllm, "gpu_memory_utilization", None))
    return OppoSamplesGenerator(
        base.strategy, base.prompts_dataloader, base.eval_dataloader, base.tokenizer, base.vllm_engines,
        oppo=oppo, mode=mode, scheduler=scheduler, engines=engines, meter=meter,
        scorers=Scorers(reward, reference),
    )


_BASE = unwrap_ray_actor(_ppo_trainer.PPOTrainer)


class OppoPPOTrainerImpl(_BASE):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.samples_generator = build_samples_generator(self.samples_generator, self.reward_model_group,
                                                         self.reference_model_group)
        self.samples_generator.engines.empty_caches = self._empty_model_caches
        # the progress bar counts OpenRLHF's global steps: one a batch of --rollout.batch_size prompts (its
        # dataloader yields prompts one by one)
        per_pass = -(-len(self.prompts_dataloader) // self.args.rollout.batch_size)
        self.samples_generator.meter.plan(per_pass * self.args.train.num_episodes)
        if self.samples_generator.scorers.reference.actors:
            streamed_reference_forward(self.experience_maker, self.samples_generator.reference_logprobs)
        make_experience_batch = self.experience_maker.make_experience_batch

        def checked_experience_batch(rollout_samples):
            # between OpenRLHF's forwards and its PPO update: no NaN, no empty response is trained on
            experiences = make_experience_batch(rollout_samples)
            guards.check_experiences(experiences, self.samples_generator.step, self.samples_generator.batch_sample_ids)
            return experiences

        self.experience_maker.make_experience_batch = checked_experience_batch
        gen = self.samples_generator
        self.old_logprobs = None
        if gen.old_logprobs_from_rollout:
            audit = gen.oppo.train.old_logprobs_audit_steps
            self.old_logprobs = old_logprobs.OldLogprobs(self.experience_maker, gen.rollout_logprobs,
                                                         audit_due=lambda: bool(audit) and gen.step % audit == 0)
        if self.samples_generator.oppo.train.length_buckets:
            self.experience_padding = micro_batches.bucket_experience_making(self.experience_maker)
        else:
            self.experience_padding = {}
        self.advantage_time = advantages.install(self.experience_maker,
                                                 self.samples_generator.oppo.train.vectorized_advantages)

    def broadcast_to_vllm(self) -> None:
        """The weight sync between the engines' pause and resume. With --oppo.staleness.background_sync the
        actor group returns once its weights are gathered, with the engines' loads, and the engines resume
        when those land. A stalled sync (`Stalled`) ends the run without another call to the engines: they
        may be blocked in the broadcast."""
        gen = self.samples_generator
        gen.pause_for_weight_sync()
        loads = None
        try:
            with timeline.RECORDER.timed("driver", "weight_sync"):
                replies = self._sync_weights()
            if gen.mode.background_sync:
                loads = background_sync.engine_loads(replies)
        except Stalled:
            raise
        except BaseException:
            gen.resume_after_weight_sync()
            raise
        gen.resume_after_weight_sync(loads)

    def _sync_weights(self) -> list:
        """OpenRLHF 0.11.2's `PPOTrainer.broadcast_to_vllm` with its waits bounded: under --vllm.enable_sleep
        the engines wake their weights only (the KV cache wakes before the next step's generation), then every
        actor rank runs `broadcast_to_vllm`; their replies, within --oppo.timeouts.weight_sync_s."""
        engines = self.samples_generator.engines
        if self.args.vllm.enable_sleep:
            engines.wake(["weights"], phase="the weight sync", span=False)  # within the driver's weight_sync span
        refs = self.actor_model_group.async_run_method(method_name="broadcast_to_vllm")
        return engines.wait_weight_sync(refs, "the actor group's weight sync (broadcast_to_vllm: gather and send)")

    def _empty_model_caches(self) -> list:
        """Calls that empty the CUDA caches of OpenRLHF's model groups (`empty_cache`, as its experience
        maker calls it), before a wake of the engines beside them is retried."""
        groups = [self.actor_model_group, self.critic_model_group, self.reference_model_group,
                  self.reward_model_group]
        refs = []
        for group in groups:
            if group is not None:
                refs += group.async_run_method(method_name="empty_cache")
        return refs

    def train_step(self, rollout_samples, global_step: int):
        status, step = super().train_step(rollout_samples, global_step)
        guards.check_losses(status, self.samples_generator.step)
        # the batch's rewards exist only now (OpenRLHF's reward forward when not streaming)
        status.update(self.samples_generator.finish_step(status["rollout/reward_mean"]), **self.experience_padding,
                      **self.advantage_time, **(self.old_logprobs.take_stats() if self.old_logprobs else {}))
        path = run_env.path(run_env.METRICS_JSONL)
        if path:
            row = {"global_step": step, **{k: v for k, v in status.items() if isinstance(v, (int, float))}}
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        return status, step

    def save_logs_and_checkpoints(self, global_step: int, logs_dict=None, client_states=None) -> None:
        client_states = dict(client_states or {})
        stop = run_env.stop_requested()  # SIGTERM/SIGINT to the launcher
        saving = stop or global_step % self.args.ckpt.save_steps == 0  # OpenRLHF's own condition (inf: never)
        if saving:
            client_states[STATE_KEY] = json.dumps(self.samples_generator.state_dict())
        # the generator reads the dataloader ahead (B+Δ groups); between steps its
        # position is the scheduler's next_prompt_index, as OpenRLHF's own state says
        save_steps = self.args.ckpt.save_steps
        if stop:
            self.args.ckpt.save_steps = 1  # OpenRLHF saves when global_step % save_steps == 0
        try:
            super().save_logs_and_checkpoints(global_step, logs_dict, client_states)
        finally:
            self.args.ckpt.save_steps = save_steps
        if saving:  # written: a resume may start after this step
            self.samples_generator.ledger_checkpoint()
        if stop:
            raise StopRequested(
                f"OPPO: stopped on request after step {global_step}: checkpoint global_step{global_step} written to "
                f"{self.args.ckpt.path} with "
                f"{len(self.samples_generator.scheduler.in_flight_groups)} carried group(s); "
                f"resume with --ckpt.load_enable"
            )
        if saving and faults.due("driver", self.samples_generator.step - 1):
            faults.kill_this_process(f"the trainer after step {self.samples_generator.step - 1}'s checkpoint")

    def restore_best_checkpoint_state(self, checkpoint_states) -> None:
        super().restore_best_checkpoint_state(checkpoint_states)
        if checkpoint_states:  # a resumed run: its bar goes on from the checkpoint's step
            self.samples_generator.meter.plan(self.samples_generator.meter.progress.total,
                                              done=checkpoint_states.get("global_step", 0))
        if checkpoint_states and checkpoint_states.get(STATE_KEY):
            self.samples_generator.load_state_dict(json.loads(checkpoint_states[STATE_KEY]))


OppoPPOTrainer = ray.remote(OppoPPOTrainerImpl)


def patch_driver(stream_rewards: bool, stream_reference: bool = False, megatron: bool = False,
                 sync_in_background: bool = False) -> None:
    """Swap the names in the driver, before `train_ppo_ray.train` runs (and imports them)."""
    _ppo_trainer.PPOTrainer = OppoPPOTrainer
    _ppo_trainer_async.PPOTrainerAsync = OppoPPOTrainer  # --train.async_enable: OpenRLHF's async layout, OPPO's trainer
    _vllm_engine.RolloutRayActor = OppoRolloutRayActor
    if stream_rewards:
        _launcher.RewardModelActor = StreamingRewardModelRayActor
    if stream_reference:
        _launcher.ReferenceModelActor = StreamingReferenceModelRayActor
    if sync_in_background:  # --oppo.staleness.background_sync (the launcher refuses it with Megatron)
        from openrlhf.trainer.ray import ppo_actor

        ppo_actor.PolicyModelActor = background_sync.BackgroundSyncPolicyModelRayActor
    if megatron:
        from openrlhf.trainer.ray import ppo_actor

        from openrlhf_oppo.integrations.runtime.megatron_actor import MegatronPolicyModelRayActor

        ppo_actor.PolicyModelActor = MegatronPolicyModelRayActor
