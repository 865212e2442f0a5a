"""OPPO's samples generator for OpenRLHF's synchronous PPO trainer.

Replaces `openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator` (OpenRLHF 0.11.2) inside `PPOTrainer`.
One `generate_samples` call is one OPPO step; it executes the plans of the scheduler core (`OverlapScheduler`),
which makes every decision:

    admit     begin_step -> tokenize the new prompts, start them on the engines,
              open them on the streaming reward (and reference) actors
    stream    engines' deltas -> on_tokens -> chunks -> scorer actors (fire and forget)
              their acks -> on_scored_many; finished -> last chunk -> score
    batch     take_batch: the first B complete groups -> OpenRLHF Experiences with the streamed
              rewards (OpenRLHF skips its reward forward) and reference log-probs (`reference`)
    early     with --oppo.staleness.max_policy_lag N >= 1 (async admission): end_step and the
              next begin_step run as the batch is taken, so the next step's groups decode
              while the trainer trains (the scheduler forces a group into a batch before any
              of its tokens would be more than N versions behind)
    carry     end_step: unfinished groups decode through training (held from the batch where the engines share
              the trainer's devices: --oppo.staleness.carried_in_training); the weight sync pauses them (KV kept
              unless --oppo.staleness.keep_kv_cache false) and bumps the policy version their next tokens are
              stamped with (--oppo.staleness.background_sync: once the engines loaded it)
    sleep     with --vllm.enable_sleep (the hybrid engine: vLLM and the DeepSpeed models share
              the GPUs) the carried requests stop at the batch with every token kept, the
              engines sleep while the models train, and after the wake they decode on from
              their tokens (prompt + partial response re-prefilled, `oppo/reprefilled_tokens`)

Which of these a run does is its `StepMode` (`step_mode`), resolved once by the trainer; the branches
below read it. What one step leaves the next (a checkpoint load, parked samples, a step begun at the
batch, the batch awaiting training) is one `StepState`, changed at the four events its methods name.

The generator orchestrates; `trainer.build_samples_generator` hands in its collaborators: the
`EnginePool` (placement, starts, polls, aborts, pause/resume), the `Scorers` (chunks to the scorer
actors, in-order acks, restarts) and the `StepMeter` (`oppo/*` metrics); `openrlhf_executor`
holds what mirrors OpenRLHF's executor. Per-token policy versions and rollout logprobs are recorded;
OpenRLHF computes values (and reference logprobs, unless streamed) on the full sequences at training
time, and old logprobs for the samples holding tokens of older weights (`old_logprobs`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import run_env
from openrlhf_oppo.core import OverlapScheduler, StepPlan, StepReport, StepStats, TrainBatch
from openrlhf_oppo.integrations.runtime import old_logprobs, openrlhf_executor, reference, timeline_hooks
from openrlhf_oppo.integrations.runtime.deltas import SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.engine_pool import EnginePool
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.prompt_stream import GroupPrompts, PromptStream
from openrlhf_oppo.integrations.runtime.reward_dispatch import Scorers
from openrlhf_oppo.integrations.runtime.run_config import engine_text_needed, reward_mode
from openrlhf_oppo.integrations.runtime.seeding import request_seed, write_rollouts
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter
from openrlhf_oppo.integrations.runtime.step_mode import BegunStep, Phase, StepMode, StepState, TakenBatch
from openrlhf_oppo.integrations.runtime.trace import RunLedger, write_trace

log = get_logger(__name__)
NO_CHUNKS = 1 << 30  # wake threshold when nothing is streamed: only finished samples wake the driver


class OppoSamplesGenerator(SamplesGenerator):
    def __init__(self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines, *,
                 oppo: oppo_config.OppoConfig, mode: StepMode, scheduler: OverlapScheduler, engines: EnginePool,
                 scorers: Scorers, meter: StepMeter):
        """OpenRLHF's generator arguments, then OPPO's: its config `oppo` and the run's step `mode` (both
        resolved by the trainer), the scheduler core, the `engines` that decode `vllm_engines`, the
        `scorers` that stream into OpenRLHF's reward / reference groups, and the `meter` of `oppo/*`
        metrics."""
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        self.oppo = oppo
        self.mode = mode
        # "stream": OPPO's reward actors prefill chunks and supply the rewards; "rule": the engines score each
        # sample with --reward.remote_url the moment it finishes; "batch": OpenRLHF's reward forward.
        self.reward_mode = reward_mode(self.args, oppo)
        self.correction_logprobs = self.args.algo.advantage.is_correction_level != "off"  # in the experiences
        # old log-probs from the rollout for samples the current weights decoded (`old_logprobs`)
        self.old_logprobs_from_rollout, fallback = old_logprobs.resolve(oppo.train.old_logprobs, self.args)
        if fallback:
            log.warning(fallback)
        self.record_logprobs = self.correction_logprobs or self.old_logprobs_from_rollout  # recorded only when used
        # the open batch's fresh samples' action log-probs by tokens; None: some stale sample holds the tokens
        self.rollout_logprobs: dict[tuple[int, ...], torch.Tensor | None] = {}
        self.detokenize = engine_text_needed(self.args)  # vLLM's text: read by an agent only
        self.scheduler = scheduler
        self.engines = engines
        self.scorers = scorers
        self.meter = meter
        if self.reward_mode == "rule":
            self.engines.set_reward_tokenizer(tokenizer)
        self.rule_rewards: dict[int, dict] = {}  # sample id -> {"reward", "scores", "extra_logs"} from its engine
        self.sampling_params = None  # vLLM SamplingParams, set by each step's admission
        self.prompts = GroupPrompts(PromptStream(prompts_dataloader), tokenizer, self.reward_mode == "rule")
        self.step = 0  # == policy version: weight syncs done so far
        self.state = StepState()  # what the next step starts from, and the batch awaiting training
        self.trace_path = run_env.path(run_env.TRACE_JSONL)
        self.ledger = RunLedger()
        self.step_admitted: list[list] = []  # [group id, prompt index, prompt hash] admitted since the last step event
        # async admission: the last trained batch's mean reward, what eq4/alg1 see when a step ends before
        # training (None before the first: they wait)
        self.last_mean_reward: float | None = None
        self.admitted_s = 0.0  # async admission: when the open step's groups were admitted (the meter's clock)
        self.reference_logprobs: dict[tuple[int, ...], torch.Tensor] = {}  # the open batch's, by tokens

    # ------------------------------------------------------------------ a step

    @torch.no_grad()
    def generate_samples(self, **generate_kwargs):
        """Phases admit -> stream -> batch of one OPPO step; `finish_step` closes it once OpenRLHF has the rewards.

        Returns OpenRLHF's tuple: the batch's experiences, no prompt batch, the groups admitted, and whether
        the batch held the pass's last groups (OpenRLHF's episode ends)."""
        start = self.state
        self.state = start.started()  # raises while the previous step's batch is open
        with timeline_hooks.generating():
            out = self._generate_step(start, generate_kwargs)
        carrying = bool(self.scheduler.in_flight_groups)
        if self.state.taken is not None and self.mode.pauses_at_batch(carrying):
            self.engines.pause(self.mode.keep_kv_cache)  # the carried decode on after the weight sync
        return out

    def _generate_step(self, start: StepState, generate_kwargs):
        """One step, from the state the last one left (`start`) to its batch."""
        self._open_step()
        # One pass over the prompts is one OpenRLHF episode: no prompt of the next pass is
        # admitted before every prompt of this one is trained, and the step that trains the
        # pass's last groups ends the episode (OpenRLHF's step count and LR schedule hold).
        if start.phase is Phase.BEGUN:
            started = start.begun  # begun as the last batch was taken: its groups are decoding
            admitted = 0  # counted by the call that admitted them
        elif start.phase is Phase.RESTORED and self._resumed_at_pass_end():
            # resumed from the checkpoint of a pass's last step: that episode is over (OpenRLHF's own
            # resumed dataloader is exhausted too); the next episode's call admits the next pass
            return [], None, 0, True
        else:
            started = self._begin(self.step, generate_kwargs, start.phase)
            admitted = len(started.plan.admit)
        if self.scorers.streaming:
            wake_tokens = started.plan.chunk_size_tokens
        else:
            wake_tokens = NO_CHUNKS
        batch, generated = self._stream_until_batch(wake_tokens)
        parked = False
        if self.mode.sleeps_while_training:
            parked_tokens, parked = self._park_and_sleep()
            generated += parked_tokens
        self.meter.end_generation(generated)
        exhausted = self.scheduler.oldest_prompt_index >= started.pass_end  # the batch held the pass's last groups
        experiences, sample_ids = self._build_experiences(batch, generate_kwargs)
        report = None
        next_step = None
        if self.mode.admits_at_batch:
            report, next_step = self._end_at_batch(exhausted, generate_kwargs)
        if next_step is not None:
            admitted += len(next_step.plan.admit)
        taken = TakenBatch(batch, sample_ids, report)
        self.state = self.state.batch_taken(self.mode, taken, parked=parked, begun=next_step)
        return experiences, None, admitted, exhausted

    def _open_step(self) -> None:
        """The step's start on the meter, the engines and the scorers (and the ledger, after a (re)start)."""
        self.meter.start_step()
        self.engines.begin_step(self.step)
        self.scorers.begin_step(self.step)
        if self.mode.sleeps_while_training:  # asleep since the engines started or the last batch (or an evaluation)
            self.engines.wake()
        if not self.ledger.started:  # after any checkpoint load: the run (re)starts here
            self.ledger.start(self.step - 1, list(self.scheduler.in_flight_groups), self.scheduler.next_prompt_index,
                              len(self.prompts_dataloader))

    def _resumed_at_pass_end(self) -> bool:
        """Nothing is carried and the stream stands at a pass's start (past the first): the checkpoint was
        written by the step that trained a pass's last groups."""
        position = self.scheduler.next_prompt_index
        if self.scheduler.in_flight_groups or position == 0:
            return False
        return position % self._per_pass == 0

    @property
    def _per_pass(self) -> int:
        """Prompts in one pass: the length of OpenRLHF's prompt dataloader."""
        return len(self.prompts_dataloader)

    def _begin(self, step: int, generate_kwargs, phase: Phase) -> BegunStep:
        """Begin `step` in the scheduler and start its plan, restarting what `phase` says the engines and
        scorers lost; returns the plan with the pass end (prompt index) it admits up to."""
        per_pass = self._per_pass
        pass_end = (self.scheduler.oldest_prompt_index // per_pass + 1) * per_pass
        plan = self.scheduler.begin_step(step, admit_until=pass_end)
        self.admitted_s = self.meter.clock()
        self._admit(plan, generate_kwargs, step, phase)
        self.scorers.dispatch(list(plan.restream))  # after a checkpoint load: re-score held tokens
        return BegunStep(plan, pass_end)

    def _end_at_batch(self, exhausted: bool, generate_kwargs) -> tuple[StepReport, BegunStep | None]:
        """Async admission: the step ends as its batch is taken (Δ sees the last reward known) and the next
        begins while the trainer trains; not across a pass's end (`exhausted`): the next pass's prompts wait
        for OpenRLHF's next episode. Returns the step's report and the step begun, if any."""
        report = self._adapt(self.last_mean_reward)
        if exhausted:
            return report, None
        return report, self._begin(self.step + 1, generate_kwargs, Phase.READY)

    def finish_step(self, mean_reward: float) -> dict[str, float]:
        """Close the step with the trained batch's mean reward (feeds Δ); returns `oppo/*` metrics."""
        taken = self.state.taken
        self.state = self.state.finished()  # raises when no batch is open
        if self.mode.admits_at_batch:
            report = taken.report  # the step ended as its batch was taken
        else:
            report = self._adapt(mean_reward)
        self.last_mean_reward = mean_reward
        metrics = self.meter.metrics(report, self.step, self.scorers.restarts_this_step,
                                     self.engines.aborted_this_step, self.engines.take_paused_s())
        self._finalize(taken.batch, report)
        self.step += 1
        response_tokens = [s.num_tokens for g in taken.batch.groups for s in g.samples]
        self.meter.show(report, mean_reward, response_tokens)
        return metrics

    # ------------------------------------------------------------------ admit

    def _admit(self, plan: StepPlan, generate_kwargs, step: int, phase: Phase) -> None:
        """Start the plan's new groups (and the carried ones the engines lost, by `phase`): each sample on its
        engine and, when streaming, opened on its reward actor."""
        self.sampling_params = openrlhf_executor.sampling_params(generate_kwargs, self.record_logprobs,
                                                                 self.detokenize)
        self.prompts.set_limits(self.sampling_params.max_tokens, generate_kwargs.get("max_len", 2048))
        starts: list[tuple[int, SampleRequest]] = []  # (group id, request)
        opens: dict[int, list[int]] = {}  # sample id -> prompt ids
        for slot, group in enumerate(plan.admit):
            gid = group.group_id
            prompt, ids = self.prompts.admit(gid)
            self.step_admitted.append([gid, group.prompt_index, hashlib.sha1(prompt.encode()).hexdigest()[:12]])
            self.engines.place(gid)
            for j, sid in enumerate(group.sample_ids):
                opens[sid] = ids
                starts.append((gid, self.prompts.request(gid, sid, j, [], self._seed(step, slot, prompt, j))))
        if phase.engines_lost_carried:
            self._restart_carried(plan, step, phase, starts, opens)
        self.scorers.open(opens)
        self.engines.start(starts, self.sampling_params)
        self.scorers.confirm_opened()

    def _restart_carried(self, plan: StepPlan, step: int, phase: Phase, starts: list[tuple[int, SampleRequest]],
                         opens: dict[int, list[int]]) -> None:
        """Add to `starts` (and `opens`) the carried samples the engines (and scorers) lost.

        After a checkpoint load the engines and scorer actors hold nothing: every held sample is reopened
        (`plan.restream` re-sends its tokens); after a sleep only the engines lost them. Either way the
        unfinished ones decode on after the tokens they had."""
        reopen = phase.scorers_lost_carried
        for slot, gid in enumerate(plan.carried, start=len(plan.admit)):
            prompt, _, ids = self.prompts.by_group[gid]
            if reopen:
                self.engines.place(gid)
            for j, sid in enumerate(self.scheduler.group_sample_ids(gid)):
                if reopen:
                    opens[sid] = ids
                if self.scheduler.is_finished(sid):  # a finished one has nothing to decode
                    continue
                held = self.scheduler.held_tokens(sid)
                starts.append((gid, self.prompts.request(gid, sid, j, held, self._seed(step, slot, prompt, j))))
                self.meter.reprefilled_tokens += len(ids) + len(held)

    def _seed(self, step: int, slot: int, prompt: str, sample_index: int) -> int | None:
        """vLLM seed of a request (`--train.full_determinism_enable`) as OpenRLHF seeds its own; None: engine RNG."""
        if not self.args.train.full_determinism_enable:
            return None
        return request_seed(self.args.train.seed, step, slot, prompt, sample_index)

    # ------------------------------------------------------------------ generate + stream

    def _stream_until_batch(self, wake_tokens: int) -> tuple[TrainBatch, int]:
        """Feed the engines' deltas to the scheduler and its chunks to the scorers until the scheduler hands
        over a batch; returns the batch and the tokens decoded meanwhile. `wake_tokens`: an engine's poll
        returns once it holds that many undelivered tokens (or a finished sample)."""
        generated = 0
        batch = self.scheduler.take_batch()
        while batch is None:
            self.meter.waiting(self.scheduler.waiting_on_forced)
            deltas = self.engines.poll(wake_tokens, also=self.scorers.in_flight())
            generated += sum(len(d.token_ids) for d in deltas)
            aborted = [d for d in deltas if d.finish_reason == "abort"]
            self.scorers.dispatch(self._feed(deltas))
            self._restart_aborted(aborted)
            self.scorers.collect()
            batch = self.scheduler.take_batch()
        self.meter.batch_taken()
        return batch, generated

    def _feed(self, deltas: list[SampleDelta]) -> list:
        """The engines' deltas to the core, in order: each run of one policy version in one
        `on_tokens_many` call, a finished sample's `on_finished` right after its tokens; the
        chunks that became ready. An aborted sample is not an answer: it decodes on from its
        tokens (`_restart_aborted`) and is never trained."""
        chunks: list = []
        run: list[tuple] = []  # (sample id, token ids, logprobs) of one version, not yet fed
        version = 0
        for d in deltas:
            if run and d.policy_version != version:
                chunks += self.scheduler.on_tokens_many(run, version)
                run = []
            run.append((d.sample_id, d.token_ids, d.logprobs))
            version = d.policy_version
            if d.finish_reason is not None:
                chunks += self.scheduler.on_tokens_many(run, version)
                run = []
                if d.finish_reason != "abort":
                    chunks += self._on_finished(d)
        if run:
            chunks += self.scheduler.on_tokens_many(run, version)
        return chunks

    def _on_finished(self, d: SampleDelta) -> list:
        """A sample finished (not aborted): meter it, keep its rule reward, and tell the core; returns the
        chunks that became ready (its last one)."""
        self.meter.on_finished(d.sample_id, d.time_s)
        if self.reward_mode == "rule":
            if d.reward is None:
                raise RuntimeError(f"OPPO step {self.step}: --reward.remote_url gave no reward for sample "
                                   f"{d.sample_id} (group {self.scheduler.group_of(d.sample_id)}): {d.error}")
            self.rule_rewards[d.sample_id] = d.reward
        return self.scheduler.on_finished(d.sample_id, d.finish_reason)

    def _restart_aborted(self, aborted: list[SampleDelta]) -> None:
        """Start every aborted sample again on its engine, from the tokens it holds (a vLLM abort or a failed
        engine is not an answer). Unseeded: a failure is not part of a reproducible run."""
        restarts = []
        for d in aborted:
            gid = self.scheduler.group_of(d.sample_id)
            held = self.scheduler.held_tokens(d.sample_id)
            j = self.scheduler.group_sample_ids(gid).index(d.sample_id)
            request = self.prompts.request(gid, d.sample_id, j, held, None)
            restarts.append((d, gid, request))
            self.meter.reprefilled_tokens += len(request.prompt_ids) + len(held)
        self.engines.restart_aborted(restarts, self.sampling_params)

    def _park_and_sleep(self) -> tuple[int, bool]:
        """Sleep mode, as the batch is taken (the models train on the engines' GPUs next): stop every carried
        request where it is and feed the scheduler the tokens each decoded until then (one that finished
        meanwhile finishes as usual), then put the engines to sleep; the next step restarts the stopped ones
        (`Phase.PARKED`). Returns the tokens fed and whether any request was stopped."""
        decoding = set()
        for gid in self.scheduler.in_flight_groups:
            for sid in self.scheduler.group_sample_ids(gid):
                if not self.scheduler.is_finished(sid):
                    decoding.add(sid)
        parked = bool(decoding)
        generated = 0
        if parked:
            self.engines.park()
        while decoding:  # every request's last delta is in its engine's outbox
            deltas = self.engines.poll(1)
            generated += sum(len(d.token_ids) for d in deltas)
            self.scorers.dispatch(self._feed(deltas))
            decoding -= {d.sample_id for d in deltas if d.finish_reason is not None}
        self.engines.sleep()
        return generated, parked

    # ------------------------------------------------------------------ build experiences

    def _build_experiences(self, batch: TrainBatch, generate_kwargs) -> tuple[list, list[int]]:
        """OpenRLHF's experiences of the batch, groups in stream order (not completion order: training sees a
        reproducible order), and their sample ids in that order."""
        groups = sorted(batch.groups, key=lambda g: g.prompt_index)
        sample_ids = [s.sample_id for g in groups for s in g.samples]
        self.reference_logprobs.clear()
        self.rollout_logprobs.clear()
        experiences = [self._experience(g, s, generate_kwargs) for g in groups for s in g.samples]
        rollouts = run_env.path(run_env.ROLLOUTS_JSONL)
        if rollouts:
            write_rollouts(rollouts, self.step, experiences)
        return experiences, sample_ids

    def _experience(self, group, sample, generate_kwargs):
        """One trained sample as OpenRLHF's executor would have returned it, with its reward."""
        prompt, label, prompt_ids = self.prompts.by_group[group.group_id]
        sid = sample.sample_id
        scored = self._scored(sid)
        reward = scored.get("reward")
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"OPPO step {self.step}: the reward of sample {sid} (group {group.group_id}, "
                             f"{len(sample.token_ids)} response tokens) is {reward}; refusing to train on it")
        response = openrlhf_executor.response(prompt, label, prompt_ids, sample, scored, self.correction_logprobs)
        exp = self._process_response_into_experience(response, **generate_kwargs)
        if self.scorers.reference.actors:  # read by `reference.streamed_reference_forward`
            reference.keep(self.reference_logprobs, exp, self.scorers.reference.scores[sid])
        if self.old_logprobs_from_rollout:  # read by `old_logprobs.OldLogprobs`
            old_logprobs.keep(self.rollout_logprobs, exp, sample, self.step)
        return exp

    def _scored(self, sample_id: int) -> dict:
        """What a sample was scored with: its streamed reward, its engine's rule reward ({"reward", "scores",
        "extra_logs"}), or nothing (OpenRLHF's reward forward scores the batch)."""
        if self.reward_mode == "stream":
            return {"reward": self.scorers.reward.scores[sample_id]}
        if self.reward_mode == "rule":
            return self.rule_rewards[sample_id]
        return {}

    @property
    def batch_sample_ids(self) -> list[int] | None:
        """The open batch's sample ids, in the order its experiences were handed to OpenRLHF (None: no batch
        awaits training)."""
        if self.state.taken is None:
            return None
        return self.state.taken.sample_ids

    # ------------------------------------------------------------------ adapt, finalize

    def _adapt(self, mean_reward: float | None) -> StepReport:
        """The scheduler closes the step; its controllers set the next Δ and C (C from the tokens decoded a second
        since the step's groups were admitted: with async admission, since the previous batch, training included)."""
        if self.mode.admits_at_batch:
            seconds = self.meter.clock() - self.admitted_s
        else:
            seconds = self.meter.gen_s
        stats = StepStats(mean_reward, self.meter.generated_tokens, seconds, self.meter.forced_wait_s)
        report = self.scheduler.end_step(stats)
        lag = self.mode.max_policy_lag
        if lag and report.max_lag > lag:  # the core's forcing rules this out: a driver fed it stale tokens
            log.error("OPPO step %d trains tokens %d policy versions old, over --oppo.staleness.max_policy_lag %d",
                      report.step, report.max_lag, lag)
        return report

    def _finalize(self, batch: TrainBatch, report: StepReport) -> None:
        """Record the step (trace, ledger) and drop what the trained groups held."""
        if self.trace_path:
            if self.reward_mode == "rule":
                rewards = {sid: r["reward"] for sid, r in self.rule_rewards.items()}
            else:
                rewards = self.scorers.reward.scores
            write_trace(self.trace_path, self.scheduler, batch, report, self.prompts.by_group, rewards,
                        self.scorers.reference.scores)
        # held: in flight now (async admission: with the next step's groups, admitted at the batch)
        self.ledger.event("step", step=report.step, admitted=self.step_admitted,
                          trained=[[g.group_id, g.deferrals] for g in batch.groups],
                          held=list(self.scheduler.in_flight_groups))
        self.step_admitted = []
        for g in batch.groups:  # trained: nothing of it is needed again
            del self.prompts.by_group[g.group_id]
            sample_ids = [s.sample_id for s in g.samples]
            self.engines.release(g.group_id, sample_ids)
            self.scorers.forget(sample_ids)
            self.meter.forget(sample_ids)
            for sid in sample_ids:
                self.rule_rewards.pop(sid, None)

    # ----------------------------------------------------------- weight sync hooks

    def pause_for_weight_sync(self) -> None:
        """Pause the engines for the weight sync where the step mode says so (`StepMode.pauses_for_weight_sync`)."""
        if self.mode.pauses_for_weight_sync(carrying=bool(self.scheduler.in_flight_groups)):
            self.engines.pause(self.mode.keep_kv_cache)

    def resume_after_weight_sync(self, loads: list | None = None) -> None:
        """The engines hold (with `loads`, a background sync's: once those finish) the weights trained on the
        open step's batch, or on a resume the checkpoint's: tokens from here on are that policy version."""
        if self.state.taken is not None:
            version = self.step + 1
        else:
            version = self.step
        if loads is not None:
            return self.engines.resume_when_loaded(loads, version, bool(self.args.vllm.enable_prefix_caching))
        self.engines.resume(version)

    # ---------------------------------------------------------------- ledger, checkpoint

    def ledger_checkpoint(self) -> None:
        """Record in the ledger that the last finished step's checkpoint was written: a resume may start after it."""
        self.ledger.event("checkpoint", step=self.step - 1)

    def state_dict(self) -> dict[str, Any]:
        """What OpenRLHF's checkpoint keeps between steps (JSON): the scheduler's state, the policy version,
        the last trained batch's mean reward, the prompts of the groups in flight and the rule rewards of
        their finished samples (a finished sample is not decoded again after a resume, so its engine
        never scores it again)."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "last_mean_reward": self.last_mean_reward,
            "prompts": {str(gid): list(v) for gid, v in self.prompts.by_group.items()},  # in-flight groups only
            "rule_rewards": {str(sid): reward for sid, reward in self.rule_rewards.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict`'s output: OpenRLHF restores the dataloader at the scheduler's
        `next_prompt_index`; the engines and scorer actors start empty (`Phase.RESTORED`)."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.last_mean_reward = state.get("last_mean_reward")  # absent before async admission
        self.prompts.by_group = {int(gid): (p, lb, ids) for gid, (p, lb, ids) in state["prompts"].items()}
        # absent from a checkpoint written before rule rewards were kept in it
        self.rule_rewards = {int(sid): reward for sid, reward in state.get("rule_rewards", {}).items()}
        self.scorers.forget_all()  # scorer actors restart empty: every held sample is re-scored
        self.state = self.state.restored()
