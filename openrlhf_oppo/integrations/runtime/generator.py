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

The generator orchestrates; `trainer.build_samples_generator` hands in its collaborators: the
`EnginePool` (placement, starts, polls, aborts, pause/resume), the `Scorers` (chunks to the scorer
actors, in-order acks, restarts) and the `StepMeter` (`oppo/*` metrics); `openrlhf_executor`
holds what mirrors OpenRLHF's executor. Per-token policy versions (and rollout logprobs, when an
importance-sampling correction uses them) are recorded; OpenRLHF computes old logprobs, values
(and reference logprobs, unless streamed) on the full sequences at training time.
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
from openrlhf_oppo.integrations.runtime import openrlhf_executor, reference, timeline_hooks
from openrlhf_oppo.integrations.runtime.deltas import SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.engine_pool import EnginePool
from openrlhf_oppo.integrations.runtime.log import get_logger
from openrlhf_oppo.integrations.runtime.prompt_stream import GroupPrompts, PromptStream
from openrlhf_oppo.integrations.runtime.reward_dispatch import Scorers
from openrlhf_oppo.integrations.runtime.run_config import engine_text_needed, reward_mode
from openrlhf_oppo.integrations.runtime.seeding import request_seed, write_rollouts
from openrlhf_oppo.integrations.runtime.step_meter import StepMeter
from openrlhf_oppo.integrations.runtime.trace import RunLedger, write_trace

log = get_logger(__name__)
NO_CHUNKS = 1 << 30  # wake threshold when nothing is streamed: only finished samples wake the driver


class OppoSamplesGenerator(SamplesGenerator):
    def __init__(self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines, *,
                 oppo: oppo_config.OppoConfig, scheduler: OverlapScheduler, engines: EnginePool,
                 scorers: Scorers, meter: StepMeter):
        """`engines` decode `vllm_engines`; `scorers` stream into OpenRLHF's reward / reference groups."""
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        self.oppo = oppo
        self.reward_mode = reward_mode(self.args, oppo)
        # "stream": OPPO's reward actors prefill chunks and supply the rewards; "rule": the engines score each
        # sample with --reward.remote_url the moment it finishes; "batch": OpenRLHF's reward forward.
        self.record_logprobs = self.args.algo.advantage.is_correction_level != "off"  # recorded only when used
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
        self.needs_restart = False  # after a checkpoint load: engines and scorers hold nothing
        self.open_batch: TrainBatch | None = None  # taken, awaiting finish_step
        self.batch_order: list[int] | None = None  # its sample ids in the order its experiences were handed over
        self.trace_path, self.ledger = run_env.path(run_env.TRACE_JSONL), RunLedger()
        self.step_admitted: list[list] = []  # [group id, prompt index, prompt hash] admitted since the last step event
        self.async_admission = oppo.staleness.max_policy_lag >= 1
        self.background_sync = oppo.staleness.background_sync  # the launcher allows it with async admission only
        self.sleep_mode = bool(self.args.vllm.enable_sleep)  # OpenRLHF ignores it without --train.colocate_all
        self.hold = oppo.staleness.carried_in_training == "hold"  # 'auto' resolved by the trainer's layout
        self.parked = False  # sleep mode: the carried samples were stopped at the last batch, to decode on
        self.early: tuple[StepPlan, int] | None = None  # async: the next step's plan and pass end, begun at the batch
        self.report: StepReport | None = None  # async: the open step's report, made when its batch was taken
        # async: the last trained batch's mean reward, what eq4/alg1 see when a step ends before training (None
        # before the first: they wait); and when the open step's groups were admitted
        self.last_mean_reward, self.admitted_s = None, 0.0
        self.reference_logprobs: dict[tuple[int, ...], torch.Tensor] = {}  # the open batch's, by tokens

    # ------------------------------------------------------------------ a step

    @torch.no_grad()
    def generate_samples(self, **generate_kwargs):
        """Phases admit -> stream -> batch of one OPPO step; `finish_step` closes it once OpenRLHF has the rewards."""
        if self.open_batch is not None:
            raise RuntimeError("generate_samples called before finish_step closed the previous step")
        with timeline_hooks.generating():
            out = self._generate_step(generate_kwargs)
        if self.hold and self.open_batch is not None and self.scheduler.in_flight_groups:
            self.engines.pause(self.oppo.staleness.keep_kv_cache)  # the carried decode on after the weight sync
        return out

    def _generate_step(self, generate_kwargs):
        self.meter.start_step()
        self.engines.begin_step(self.step)
        self.scorers.begin_step(self.step)
        if self.sleep_mode:  # asleep since the engines started or the last batch (or an evaluation)
            self.engines.wake()
        if not self.ledger.started:  # after any checkpoint load: the run (re)starts here
            self.ledger.start(self.step - 1, list(self.scheduler.in_flight_groups), self.scheduler.next_prompt_index,
                              len(self.prompts_dataloader))
        # One pass over the prompts is one OpenRLHF episode: no prompt of the next pass is
        # admitted before every prompt of this one is trained, and the step that trains the
        # pass's last groups ends the episode (OpenRLHF's step count and LR schedule hold).
        position = self.scheduler.next_prompt_index
        if self.early is not None:  # begun when the previous batch was taken: its groups are decoding
            (plan, boundary), self.early = self.early, None
            admitted = 0  # counted by the call that admitted them
        elif self.needs_restart and not self.scheduler.in_flight_groups and position and position % self._per_pass == 0:
            # resumed from the checkpoint of a pass's last step: that episode is over (OpenRLHF's own
            # resumed dataloader is exhausted too); the next episode's call admits the next pass
            self.needs_restart = False
            return [], None, 0, True
        else:
            plan, boundary = self._begin(self.step, generate_kwargs)
            admitted = len(plan.admit)
        batch, generated = self._stream_until_batch(plan.chunk_size_tokens if self.scorers.streaming else NO_CHUNKS)
        if self.sleep_mode:  # the models train on the engines' GPUs next
            generated += self._park()
            self.engines.sleep()
        self.meter.end_generation(generated)
        self.open_batch = batch
        exhausted = self.scheduler.oldest_prompt_index >= boundary  # the batch held the pass's last groups
        experiences = self._build_experiences(batch, generate_kwargs)
        if self.async_admission:
            # the step ends now (Δ sees the last reward known) and the next begins while the trainer
            # trains; not across a pass's end: the next pass's prompts wait for OpenRLHF's next episode
            self.report = self._adapt(self.last_mean_reward)
            if not exhausted:
                self.early = self._begin(self.step + 1, generate_kwargs)
                admitted += len(self.early[0].admit)
        return experiences, None, admitted, exhausted

    @property
    def _per_pass(self) -> int:
        return len(self.prompts_dataloader)

    def _begin(self, step: int, generate_kwargs) -> tuple[StepPlan, int]:
        """Begin `step` in the scheduler, start its plan; returns it and the pass end (prompt index) it admits to."""
        per_pass = self._per_pass
        boundary = (self.scheduler.oldest_prompt_index // per_pass + 1) * per_pass
        plan = self.scheduler.begin_step(step, admit_until=boundary)
        self.admitted_s = self.meter.clock()
        self._admit(plan, generate_kwargs, step)
        self.scorers.dispatch(list(plan.restream))  # after a checkpoint load: re-score held tokens
        return plan, boundary

    def finish_step(self, mean_reward: float) -> dict[str, float]:
        """Close the step with the trained batch's mean reward (feeds Δ); returns `oppo/*` metrics."""
        batch, self.open_batch, self.batch_order = self.open_batch, None, None
        report, self.report = self.report or self._adapt(mean_reward), None
        self.last_mean_reward = mean_reward
        metrics = self.meter.metrics(report, self.step, self.scorers.restarts_this_step,
                                     self.engines.aborted_this_step, self.engines.take_paused_s())
        self._finalize(batch, report)
        self.step += 1
        self.meter.show(report, mean_reward, [s.num_tokens for g in batch.groups for s in g.samples])
        return metrics

    # ------------------------------------------------------------------ admit

    def _admit(self, plan: StepPlan, generate_kwargs, step: int) -> None:
        """Start the plan's new groups (and, after a checkpoint load, the held ones): each sample on its engine
        and, when streaming, opened on its reward actor."""
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
        if self.needs_restart or self.parked:
            # after a checkpoint load engines and scorer actors hold nothing: reopen every held
            # sample (`plan.restream` re-sends its tokens); after a sleep only the engines lost
            # them. Either way the unfinished ones decode on after the tokens they had.
            reopen, self.needs_restart, self.parked = self.needs_restart, False, False
            for slot, gid in enumerate(plan.carried, start=len(plan.admit)):
                prompt, _, ids = self.prompts.by_group[gid]
                if reopen:
                    self.engines.place(gid)
                for j, sid in enumerate(self.scheduler.group_sample_ids(gid)):
                    if reopen:
                        opens[sid] = ids
                    if not self.scheduler.is_finished(sid):  # a finished one has nothing to decode
                        held = self.scheduler.held_tokens(sid)
                        starts.append((gid, self.prompts.request(gid, sid, j, held, self._seed(step, slot, prompt, j))))
                        self.meter.reprefilled_tokens += len(ids) + len(held)
        self.scorers.open(opens)
        self.engines.start(starts, self.sampling_params)
        self.scorers.confirm_opened()

    def _seed(self, step: int, slot: int, prompt: str, sample_index: int) -> int | None:
        """vLLM seed of a request (`--train.full_determinism_enable`) as OpenRLHF seeds its own; None: engine RNG."""
        full = self.args.train.full_determinism_enable
        return request_seed(self.args.train.seed, step, slot, prompt, sample_index) if full else None

    # ------------------------------------------------------------------ generate + stream

    def _stream_until_batch(self, wake_tokens: int) -> tuple[TrainBatch, int]:
        """Deltas to the scheduler, its chunks to the scorers, until a batch; returns it and the tokens decoded."""
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
        self.meter.on_finished(d.sample_id, d.time_s)
        if self.reward_mode == "rule":
            if d.reward is None:
                raise RuntimeError(f"OPPO step {self.step}: --reward.remote_url gave no reward for sample "
                                   f"{d.sample_id} (group {self.scheduler.group_of(d.sample_id)}): {d.error}")
            self.rule_rewards[d.sample_id] = d.reward
        return self.scheduler.on_finished(d.sample_id, d.finish_reason)

    def _restart_aborted(self, aborted: list[SampleDelta]) -> None:
        restarts = []
        for d in aborted:  # unseeded: a failure is not part of a reproducible run
            gid, held = self.scheduler.group_of(d.sample_id), self.scheduler.held_tokens(d.sample_id)
            j = self.scheduler.group_sample_ids(gid).index(d.sample_id)
            restarts.append((d, gid, req := self.prompts.request(gid, d.sample_id, j, held, None)))
            self.meter.reprefilled_tokens += len(req.prompt_ids) + len(held)
        self.engines.restart_aborted(restarts, self.sampling_params)

    def _park(self) -> int:
        """Sleep mode: stop every carried request where it is and feed the scheduler the tokens each decoded until
        then (one that finished meanwhile finishes as usual); `_admit` decodes them on. Returns the tokens fed."""
        decoding = {sid for gid in self.scheduler.in_flight_groups for sid in self.scheduler.group_sample_ids(gid)
                    if not self.scheduler.is_finished(sid)}
        generated = 0
        if decoding:
            self.engines.park()
            self.parked = True
        while decoding:  # every request's last delta is in its engine's outbox
            deltas = self.engines.poll(1)
            generated += sum(len(d.token_ids) for d in deltas)
            self.scorers.dispatch(self._feed(deltas))
            decoding -= {d.sample_id for d in deltas if d.finish_reason is not None}
        return generated

    # ------------------------------------------------------------------ build experiences

    def _build_experiences(self, batch: TrainBatch, generate_kwargs) -> list:
        # groups in stream order, not completion order: training sees a reproducible order
        groups = sorted(batch.groups, key=lambda g: g.prompt_index)
        self.batch_order = [s.sample_id for g in groups for s in g.samples]
        self.reference_logprobs.clear()
        experiences = [self._experience(g, s, generate_kwargs) for g in groups for s in g.samples]
        rollouts = run_env.path(run_env.ROLLOUTS_JSONL)
        if rollouts:
            write_rollouts(rollouts, self.step, experiences)
        return experiences

    def _experience(self, group, sample, generate_kwargs):
        prompt, label, prompt_ids = self.prompts.by_group[group.group_id]
        sid = sample.sample_id
        # None: OpenRLHF's reward forward scores the batch
        scored = {"stream": lambda: {"reward": self.scorers.reward.scores[sid]},
                  "rule": lambda: self.rule_rewards[sid], "batch": dict}[self.reward_mode]()
        reward = scored.get("reward")
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"OPPO step {self.step}: the reward of sample {sid} (group {group.group_id}, "
                             f"{len(sample.token_ids)} response tokens) is {reward}; refusing to train on it")
        response = openrlhf_executor.response(prompt, label, prompt_ids, sample, scored, self.record_logprobs)
        exp = self._process_response_into_experience(response, **generate_kwargs)
        if self.scorers.reference.actors:  # read by `reference.streamed_reference_forward`
            reference.keep(self.reference_logprobs, exp, self.scorers.reference.scores[sid])
        return exp

    @property
    def batch_sample_ids(self) -> list[int] | None:  # the open batch's, in the order handed to OpenRLHF
        return self.batch_order

    # ------------------------------------------------------------------ adapt, finalize

    def _adapt(self, mean_reward: float | None) -> StepReport:
        """The scheduler closes the step; its controllers set the next Δ and C (C from the tokens decoded a second
        since the step's groups were admitted: with async admission, since the previous batch, training included)."""
        seconds = self.meter.clock() - self.admitted_s if self.async_admission else self.meter.gen_s
        report = self.scheduler.end_step(StepStats(mean_reward, self.meter.generated_tokens, seconds,
                                                   self.meter.forced_wait_s))
        lag = self.oppo.staleness.max_policy_lag
        if lag and report.max_lag > lag:  # the core's forcing rules this out: a driver fed it stale tokens
            log.error("OPPO step %d trains tokens %d policy versions old, over --oppo.staleness.max_policy_lag %d",
                      report.step, report.max_lag, lag)
        return report

    def _finalize(self, batch: TrainBatch, report: StepReport) -> None:
        """Record the step (trace, ledger) and drop what the trained groups held."""
        if self.trace_path:
            rewards = ({sid: r["reward"] for sid, r in self.rule_rewards.items()} if self.reward_mode == "rule"
                       else self.scorers.reward.scores)
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
        # none carried (Δ = 0): no pause; held or asleep: stopped at the batch; a background sync: always paused
        if (self.scheduler.in_flight_groups or self.background_sync) and not (self.sleep_mode or self.hold):
            self.engines.pause(self.oppo.staleness.keep_kv_cache)

    def resume_after_weight_sync(self, loads: list | None = None) -> None:
        """The engines hold (with `loads`, a background sync's: once those finish) the weights trained on the
        open step's batch, or on a resume the checkpoint's: tokens from here on are that policy version."""
        version = self.step + (1 if self.open_batch is not None else 0)
        if loads is not None:
            return self.engines.resume_when_loaded(loads, version, bool(self.args.vllm.enable_prefix_caching))
        self.engines.resume(version)

    # ---------------------------------------------------------------- ledger, checkpoint

    def ledger_checkpoint(self) -> None:
        self.ledger.event("checkpoint", step=self.step - 1)

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "last_mean_reward": self.last_mean_reward,
            "prompts": {str(gid): list(v) for gid, v in self.prompts.by_group.items()},  # in-flight groups only
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.last_mean_reward = state.get("last_mean_reward")  # absent before async admission
        self.prompts.by_group = {int(gid): (p, lb, ids) for gid, (p, lb, ids) in state["prompts"].items()}
        self.scorers.forget_all()  # scorer actors restart empty: every held sample is re-scored
        self.needs_restart, self.parked = True, False  # OpenRLHF restores the dataloader at scheduler.next_prompt_index
