"""OPPO's samples generator for OpenRLHF's synchronous PPO trainer.

Replaces `openrlhf.trainer.ppo_utils.samples_generator.SamplesGenerator` (OpenRLHF
0.11.2) inside `PPOTrainer`. One `generate_samples` call is one OPPO step; it
executes the plans of the scheduler core (`OverlapScheduler`), which makes every
decision:

    admit     begin_step -> tokenize the new prompts, start them on the engines,
              open them on the streaming reward actors
    stream    engines' deltas -> on_tokens -> chunks -> reward actors (fire and forget)
              reward actors' acks -> on_scored_many; finished -> last chunk -> score
    batch     take_batch: the first B complete groups -> OpenRLHF Experiences with
              the streamed rewards (so OpenRLHF skips its own reward forward)
    carry     end_step: unfinished groups keep decoding through training; the
              trainer's weight sync pauses them (`pause_generation(mode="keep")`, KV cache
              kept unless --oppo.staleness.keep_kv_cache false)
              and bumps the policy version their next tokens are stamped with

Per-token policy versions (and rollout logprobs, when an importance-sampling
correction uses them) are recorded; OpenRLHF recomputes
old logprobs, reference logprobs and values on the full sequences at training time.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from typing import Any

import ray
import torch
from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator, _collect_prompt_batch
from tqdm import tqdm
from vllm import SamplingParams

from openrlhf_oppo import config as oppo_config
from openrlhf_oppo import run_env, timeline
from openrlhf_oppo.core import ChunkReady, OverlapScheduler, StepStats, TrainBatch, ledger
from openrlhf_oppo.integrations.runtime import faults, timeline_hooks
from openrlhf_oppo.integrations.runtime.rollout import SampleDelta, SampleRequest
from openrlhf_oppo.integrations.runtime.scorer import SCORER_RESTARTS
from openrlhf_oppo.integrations.runtime.seeding import request_seed, write_rollouts
from openrlhf_oppo.integrations.runtime.trace import write_trace

REWARD = "reward"
POLL_S = 1.0  # an engine answers `next_outputs` when it has a chunk or a finished sample, or after this long
SCORER_RESTART_TIMEOUT_S = 300.0  # a restarted reward actor reloads its model
ABORT_RETRIES = 3  # an engine aborting one sample more often than this fails the step
NO_CHUNKS = 1 << 30  # wake threshold when nothing is streamed: only finished samples wake the driver


def reward_mode(args, oppo: oppo_config.OppoConfig) -> str:
    """How OPPO gets a sample's reward: "rule" (`--reward.remote_url`, a `.py` reward function
    or an HTTP endpoint: the engine scores each sample the moment it finishes, through
    OpenRLHF's own executor; nothing to prefill), "stream" (chunks prefilled by the reward
    model while the actor decodes) or "batch" (OpenRLHF's reward forward on the batch)."""
    if args.reward.remote_url:
        return "rule"
    return "stream" if oppo.streaming.enable and oppo.streaming.reward else "batch"


def config_from_env() -> oppo_config.OppoConfig:
    raw = run_env.config_json()
    if raw is None:
        raise RuntimeError(f"{run_env.CONFIG_JSON} is not set: launch OPPO with `python -m openrlhf_oppo.cli.train_ppo_ray`")
    return oppo_config.from_dict(json.loads(raw))


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


class OppoSamplesGenerator(SamplesGenerator):
    def __init__(self, strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines, reward_actors=()):
        """`reward_actors`: OpenRLHF's reward group when OPPO streams into it (its members are
        `StreamingRewardModelActor`s, placed by OpenRLHF; see `reward_mode`)."""
        super().__init__(strategy, prompts_dataloader, eval_dataloader, tokenizer, vllm_engines)
        args = self.args
        self.oppo = config_from_env()
        self.reward_mode = reward_mode(args, self.oppo)
        # "stream": OPPO's reward actors prefill chunks and supply the rewards.
        # "rule": the engines score each sample with --reward.remote_url the moment it finishes.
        # "batch" (oppo-inter): OpenRLHF's own reward forward scores the batch.
        self.streaming = self.reward_mode == "stream"
        self.record_logprobs = args.algo.advantage.is_correction_level != "off"  # recorded only when used
        self.scheduler = OverlapScheduler(
            self.oppo,
            batch_groups=args.rollout.batch_size,
            samples_per_group=args.rollout.n_samples_per_prompt,
            scorers=(REWARD,) if self.streaming else (),
        )
        # a reward actor that dies is restarted by Ray; its held samples are re-prefilled (`_restart_scorer`)
        self.reward_actors = list(reward_actors) if self.streaming else []
        if self.streaming and not self.reward_actors:
            raise RuntimeError("OPPO streams rewards but OpenRLHF built no reward group (see oppo_trainer.patch_driver)")
        if self.reward_mode == "rule":  # the engines decode the query text as OpenRLHF's executor does
            ray.get([e.set_reward_tokenizer.remote(tokenizer) for e in self.vllm_engines])
        self.rule_rewards: dict[int, dict] = {}  # sample id -> {"reward", "scores", "extra_logs"} from its engine
        self.aborts: dict[int, int] = {}  # sample id -> times its engine aborted it (restarted from its tokens)
        self.step_aborted = 0  # aborted requests restarted this step
        self.sampling_params: SamplingParams | None = None  # set by each step's admission
        self.max_len = 2048
        # actor index -> (most KV tokens held after a call this step, after its latest call)
        self.scorer_kv_tokens: dict[int, tuple[int, int]] = {}
        self.scorer_kv_budget_tokens = 0  # summed over actors, from their replies
        self.prompt_stream = PromptStream(prompts_dataloader)
        self.step = 0  # == policy version: weight syncs done so far
        self.prompts: dict[int, tuple[str, str, list[int]]] = {}  # group id -> (prompt, label, prompt ids)
        self.scores: dict[int, float] = {}  # sample id -> streamed reward
        # reward calls in flight: (ref, actor, chunks, {sample id: tokens prefilled ahead of its final chunk})
        self.pending: list[tuple[Any, int, list[ChunkReady], dict[int, int]]] = []
        self.finished_s: dict[int, float] = {}  # sample id -> when its engine finished it
        # sample id -> [(prefill end, tokens)] acknowledged before the driver saw it finish
        self.prefilled_early: dict[int, list[tuple[float, int]]] = {}
        self.polls: dict[int, Any] = {}  # engine index -> its `next_outputs` call in flight (outlives a step)
        self.engine_of: dict[int, int] = {}  # group id -> engine decoding its samples (a group stays on one)
        self.scorer_busy: list[tuple[float, float]] = []  # acknowledged reward calls' (start, end), this step
        self.needs_restart = False  # after a checkpoint load: engines and scorers hold nothing
        self.step_started_s = 0.0
        self.step_gen_s = 0.0  # generation+scoring phase of the open step
        self.step_generated_tokens = 0
        self.step_overlap_tokens = [0, 0]  # response tokens whose prefill finished before / not before their sample
        self.open_batch: TrainBatch | None = None  # taken, awaiting finish_step
        self.paused = False  # engines paused for the weight sync under way
        self.scorer_restarts = 0  # this step
        self.step_reward_calls = 0
        self.step_polls = 0  # engine replies this step (crash injection counts them)
        self.trace_path = run_env.path(run_env.TRACE_JSONL)
        self.ledger_path = run_env.path(run_env.LEDGER_JSONL)
        self.ledger_started = False
        self.step_admitted: list[list] = []  # [group id, prompt index, prompt hash] admitted this step
        self.progress = tqdm(desc="OPPO", unit="step", dynamic_ncols=True)

    # ------------------------------------------------------------------ a step

    @torch.no_grad()
    def generate_samples(self, **generate_kwargs):
        """Phases admit -> stream -> batch of one OPPO step; `finish_step` closes it
        once OpenRLHF has the batch's rewards."""
        if self.open_batch is not None:
            raise RuntimeError("generate_samples called before finish_step closed the previous step")
        with timeline_hooks.generating():
            return self._generate_step(generate_kwargs)

    def _generate_step(self, generate_kwargs):
        self.step_started_s = time.time()
        if not self.ledger_started:  # after any checkpoint load: the run (re)starts here
            self._ledger_event("start", last_step=self.step - 1, held=list(self.scheduler.in_flight_groups),
                               next_group_id=self.scheduler.next_prompt_index, per_pass=len(self.prompts_dataloader))
            self.ledger_started = True
        # One pass over the prompts is one OpenRLHF episode: no prompt of the next pass is
        # admitted before every prompt of this one is trained, and the step that trains the
        # pass's last groups ends the episode (OpenRLHF's step count and LR schedule hold).
        per_pass = len(self.prompts_dataloader)
        position = self.scheduler.next_prompt_index
        if self.needs_restart and not self.scheduler.in_flight_groups and position and position % per_pass == 0:
            # resumed from the checkpoint of a pass's last step: that episode is over (OpenRLHF's own
            # resumed dataloader is exhausted too); the next episode's call admits the next pass
            self.needs_restart = False
            return [], None, 0, True
        boundary = (self.scheduler.oldest_prompt_index // per_pass + 1) * per_pass
        plan = self.scheduler.begin_step(self.step, admit_until=boundary)
        self.step_overlap_tokens = [0, 0]
        self._admit(plan, generate_kwargs)
        self._dispatch(list(plan.restream))  # after a checkpoint load: re-score held tokens
        batch, self.step_generated_tokens = self._stream_until_batch(plan.chunk_size_tokens if self.streaming else NO_CHUNKS)
        self.step_gen_s = time.time() - self.step_started_s
        self.open_batch = batch
        exhausted = self.scheduler.oldest_prompt_index >= boundary  # the batch held the pass's last groups
        # groups in stream order, not completion order: training sees a reproducible order
        groups = sorted(batch.groups, key=lambda g: g.prompt_index)
        experiences = [self._experience(g, s, generate_kwargs) for g in groups for s in g.samples]
        rollouts = run_env.path(run_env.ROLLOUTS_JSONL)
        if rollouts:
            write_rollouts(rollouts, self.step, experiences)
        return experiences, None, len(plan.admit), exhausted

    def finish_step(self, mean_reward: float) -> dict[str, float]:
        """Close the step with the trained batch's mean reward (feeds Δ); returns `oppo/*` metrics."""
        batch, self.open_batch = self.open_batch, None
        report = self.scheduler.end_step(StepStats(mean_reward, self.step_generated_tokens, self.step_gen_s))
        before, at_end = self.step_overlap_tokens
        metrics = {
            **report.metrics(),
            "oppo/generated_tokens": float(self.step_generated_tokens),
            "oppo/policy_version": float(self.step),
            "oppo/overlap_fraction": before / max(before + at_end, 1),
            "oppo/scorer_restarts": float(self.scorer_restarts),
            "oppo/aborted_requests": float(self.step_aborted),
        }
        self.scorer_restarts = self.step_reward_calls = self.step_polls = self.step_aborted = 0
        if self.reward_actors:
            # reward calls acknowledged by now; busy time summed over actors, clipped to the phase
            end = self.step_started_s + self.step_gen_s
            busy = sum(max(0.0, min(b, end) - max(a, self.step_started_s)) for a, b in self.scorer_busy)
            metrics["oppo/scorer_idle_fraction"] = 1.0 - min(1.0, busy / max(self.step_gen_s * len(self.reward_actors), 1e-9))
            self.scorer_busy = [(a, b) for a, b in self.scorer_busy if b > end]
            # KV tokens held: each actor's most after a call this step, summed; an actor without a
            # reply this step still holds what it held after its latest call
            metrics["oppo/scorer_kv_tokens"] = float(sum(m for m, _ in self.scorer_kv_tokens.values()))
            metrics["oppo/scorer_kv_budget_tokens"] = float(self.scorer_kv_budget_tokens)
            self.scorer_kv_tokens = {idx: (last, last) for idx, (_, last) in self.scorer_kv_tokens.items()}
        if self.trace_path:
            rewards = {sid: r["reward"] for sid, r in self.rule_rewards.items()} if self.reward_mode == "rule" else self.scores
            write_trace(self.trace_path, self.scheduler, batch, report, self.prompts, rewards)
        self._ledger_event("step", step=report.step, admitted=self.step_admitted,
                           trained=[[g.group_id, g.deferrals] for g in batch.groups], held=list(report.carried_groups))
        for g in batch.groups:  # trained: nothing of it is needed again
            del self.prompts[g.group_id]
            self.engine_of.pop(g.group_id, None)
            for s in g.samples:
                self.scores.pop(s.sample_id, None)
                self.rule_rewards.pop(s.sample_id, None)
                self.aborts.pop(s.sample_id, None)
                self.finished_s.pop(s.sample_id, None)
        self.step += 1
        self.progress.update()
        self.progress.set_postfix(
            reward=f"{mean_reward:.3f}", delta=report.delta, C=report.chunk_size_tokens,
            deferred=f"{report.deferred_fraction:.0%}", step_s=f"{time.time() - self.step_started_s:.1f}",
        )
        return metrics

    # ------------------------------------------------------------------ phases

    def _sampling_params(self, generate_kwargs) -> SamplingParams:
        return SamplingParams(
            temperature=generate_kwargs.get("temperature", 1.0),
            top_p=generate_kwargs.get("top_p", 1.0),
            top_k=generate_kwargs.get("top_k", -1),
            max_tokens=generate_kwargs.get("max_new_tokens"),
            min_tokens=generate_kwargs.get("min_new_tokens", 1),
            skip_special_tokens=generate_kwargs.get("skip_special_tokens", False),
            # rollout logprobs only where a correction uses them (as OpenRLHF requests them)
            logprobs=1 if self.record_logprobs else None,
        )

    def _admit(self, plan, generate_kwargs) -> None:
        """Start the plan's new groups (and, after a checkpoint load, the held ones):
        each sample on its engine and, when streaming, opened on its reward actor."""
        params = self.sampling_params = self._sampling_params(generate_kwargs)
        max_len = self.max_len = generate_kwargs.get("max_len", 2048)
        per_engine: dict[int, list[SampleRequest]] = {}
        self.step_admitted = []
        opens: dict[int, dict[int, list[int]]] = {}

        def route(gid: int, sid: int, prompt_ids: list[int], held: list[int] | None, seed: int | None) -> None:
            if self.reward_actors:
                opens.setdefault(sid % len(self.reward_actors), {})[sid] = prompt_ids
            if held is not None:  # None: finished already, nothing to decode
                per_engine.setdefault(self.engine_of[gid], []).append(self._request(gid, sid, held, seed))

        load = [0] * len(self.vllm_engines)  # groups decoding on each engine
        for idx in self.engine_of.values():
            load[idx] += 1

        def place(gid: int) -> None:
            # a whole group on the engine decoding the fewest groups (as OpenRLHF places a prompt's n samples)
            idx = self.engine_of[gid] = min(range(len(load)), key=load.__getitem__)
            load[idx] += 1

        for slot, group in enumerate(plan.admit):
            prompt, label = self.prompt_stream.next()  # the prompt at position group.prompt_index
            ids = self.tokenizer(text=prompt, add_special_tokens=False)["input_ids"]
            ids = ids[-max(1, max_len - self._budget(len(ids))):]  # as OpenRLHF's executor truncates long prompts
            self.prompts[group.group_id] = (prompt, label, ids)
            digest = hashlib.sha1(prompt.encode()).hexdigest()[:12]
            self.step_admitted.append([group.group_id, group.prompt_index, digest])
            place(group.group_id)
            for j, sid in enumerate(group.sample_ids):
                route(group.group_id, sid, ids, [], self._seed(slot, prompt, j))
        if self.needs_restart:
            # engines and reward actors hold nothing: reopen every held sample (`plan.restream`
            # re-sends its tokens) and restart the unfinished ones after the tokens they had
            self.needs_restart = False
            for slot, gid in enumerate(plan.carried, start=len(plan.admit)):
                place(gid)
                for j, sid in enumerate(self.scheduler.group_sample_ids(gid)):
                    held = None if self.scheduler.is_finished(sid) else self.scheduler.held_tokens(sid)
                    route(gid, sid, self.prompts[gid][2], held, self._seed(slot, self.prompts[gid][0], j))
        opened = {idx: self.reward_actors[idx].open_many.remote(prompts) for idx, prompts in opens.items()}
        ray.get([self.vllm_engines[i].start_samples.remote(reqs, params) for i, reqs in per_engine.items()])
        for idx, ref in opened.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                pass  # it died: its next `process` call fails and `_restart_scorer` reopens what it held
            except ray.exceptions.RayTaskError as exc:
                raise RuntimeError(f"OPPO: reward actor {idx} could not open step {self.step}'s samples: {exc}") from exc

    def _request(self, gid: int, sid: int, held: list[int], seed: int | None) -> SampleRequest:
        """Decode sample `sid` of group `gid` on from its `held` tokens (none for a new one)."""
        prompt, label, prompt_ids = self.prompts[gid]
        query = (prompt, label) if self.reward_mode == "rule" else None
        return SampleRequest(sid, prompt_ids, held, self._budget(len(prompt_ids)), seed, query)

    def _budget(self, prompt_len: int) -> int:
        """Response tokens of a sample, as OpenRLHF's executor sizes them."""
        max_tokens = self.sampling_params.max_tokens
        return max_tokens if max_tokens is not None else max(1, self.max_len - prompt_len)

    def _seed(self, slot: int, prompt: str, sample_index: int) -> int | None:
        """vLLM seed of a request started now (`--train.full_determinism_enable`), as
        OpenRLHF's schedules seed theirs (integrations.runtime.seeding); None: engine RNG."""
        if not self.args.train.full_determinism_enable:
            return None
        return request_seed(self.args.train.seed, self.step, slot, prompt, sample_index)

    def _stream_until_batch(self, wake_tokens: int) -> tuple[TrainBatch, int]:
        generated = 0
        batch = self.scheduler.take_batch()
        while batch is None:
            for idx, engine in enumerate(self.vllm_engines):
                if idx not in self.polls:
                    self.polls[idx] = engine.next_outputs.remote(POLL_S, wake_tokens)
            # sleep until an engine has output or a reward call is done, whichever is first
            ray.wait([*self.polls.values(), *(ref for ref, *_ in self.pending)], num_returns=1)
            done = set(ray.wait(list(self.polls.values()), num_returns=len(self.polls), timeout=0)[0])
            chunks: list[ChunkReady] = []
            aborted: list[SampleDelta] = []
            for idx, ref in list(self.polls.items()):
                if ref not in done:
                    continue
                del self.polls[idx]
                for d in self._engine_reply(idx, ref):
                    generated += len(d.token_ids)
                    chunks += self.scheduler.on_tokens(d.sample_id, d.token_ids, d.logprobs, d.policy_version)
                    if d.finish_reason == "abort":  # not an answer: decoded on from its tokens, never trained
                        aborted.append(d)
                    elif d.finish_reason is not None:
                        self.finished_s[d.sample_id] = d.time_s
                        for end_s, n in self.prefilled_early.pop(d.sample_id, ()):
                            self.step_overlap_tokens[0 if end_s <= d.time_s else 1] += n
                        if self.reward_mode == "rule":
                            self.rule_rewards[d.sample_id] = self._rule_reward(d)
                        chunks += self.scheduler.on_finished(d.sample_id, d.finish_reason)
            self._dispatch(chunks)
            self._restart_aborted(aborted)
            self._collect_scores()
            batch = self.scheduler.take_batch()
        return batch, generated

    def _rule_reward(self, d: SampleDelta) -> dict:
        if d.reward is None:
            raise RuntimeError(f"OPPO step {self.step}: --reward.remote_url gave no reward for sample {d.sample_id} "
                               f"(group {self.scheduler.group_of(d.sample_id)}): {d.error}")
        return d.reward

    def _restart_aborted(self, aborted: list[SampleDelta]) -> None:
        """An aborted request (an engine-side failure) decodes on from the tokens it had, on
        its group's engine; a sample aborted `ABORT_RETRIES` times fails the step."""
        per_engine: dict[int, list[SampleRequest]] = {}
        for d in aborted:
            sid = d.sample_id
            self.aborts[sid] = self.aborts.get(sid, 0) + 1
            if self.aborts[sid] > ABORT_RETRIES:
                raise RuntimeError(f"OPPO step {self.step}: sample {sid} was aborted by its engine "
                                   f"{self.aborts[sid]} times; last error: {d.error}")
            gid = self.scheduler.group_of(sid)
            held = self.scheduler.held_tokens(sid)
            # unseeded: a failure is not part of a reproducible run
            per_engine.setdefault(self.engine_of[gid], []).append(self._request(gid, sid, held, None))
            print(f"OPPO: sample {sid} aborted by its engine ({d.error}); decoding on from its {len(held)} tokens",
                  flush=True)
        self.step_aborted += len(aborted)
        if per_engine:
            ray.get([self.vllm_engines[i].start_samples.remote(reqs, self.sampling_params) for i, reqs in per_engine.items()])

    def _engine_reply(self, idx: int, ref) -> list:
        """An engine's `next_outputs`. A dead engine stops the run: a new one would hold the
        initial weights and no weight-sync group, so the run resumes from its last checkpoint
        instead (`--ckpt.load_enable`; `openrlhf-oppo train --restarts N` relaunches it),
        where the samples carried at that checkpoint decode on from their recorded tokens."""
        try:
            outputs = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise RuntimeError(
                f"OPPO: rollout engine {idx} died in step {self.step} ({type(exc).__name__}). Resume from the last "
                f"checkpoint with --ckpt.load_enable (openrlhf-oppo train --restarts N does it): carried samples "
                f"decode on from their recorded tokens"
            ) from exc
        self.step_polls += 1
        if faults.due("rollout", self.step, self.step_polls):
            ray.kill(self.vllm_engines[idx], no_restart=True)
        if faults.due("abort", self.step, self.step_polls):
            print(f"OPPO fault injection: engine {idx} aborted sample "
                  f"{ray.get(self.vllm_engines[idx].abort_one.remote())}", flush=True)
        return outputs

    def _dispatch(self, chunks: list[ChunkReady]) -> None:
        """Send chunks to the reward actors, sticky by sample, one call per actor. A
        chunk sent with its sample's final one is prefilled with it: not overlapped."""
        if not chunks:
            return
        work: dict[int, tuple[dict, dict, list]] = {}
        for ch in chunks:
            idx = ch.sample_id % len(self.reward_actors)
            extends, finishes, sent = work.setdefault(idx, ({}, {}, []))
            toks = self.scheduler.response_tokens(ch.sample_id, ch.start, ch.end)
            if ch.final:
                # chunks of one sample arriving together are prefilled as one: same result
                finishes[ch.sample_id] = extends.pop(ch.sample_id, []) + toks
            else:
                extends.setdefault(ch.sample_id, []).extend(toks)
            sent.append(ch)
        for idx, (extends, finishes, sent) in work.items():
            self.step_overlap_tokens[1] += sum(map(len, finishes.values()))
            ahead = {sid: len(toks) for sid, toks in extends.items()}
            self.pending.append((self.reward_actors[idx].process.remote(extends, finishes), idx, sent, ahead))
            self.step_reward_calls += 1
            if faults.due("reward", self.step, self.step_reward_calls):
                ray.kill(self.reward_actors[idx], no_restart=False)

    def _collect_scores(self) -> None:
        """Acknowledge finished reward calls, in submission order per actor: a sample's
        chunks must be acknowledged in order (ray.wait reports readiness in any order)."""
        if not self.pending:
            return
        refs = [ref for ref, *_ in self.pending]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        blocked: set[int] = set()  # actors with an earlier call still running
        died: set[int] = set()  # actors whose call failed: everything they held is sent again
        still = []
        for ref, idx, sent, ahead in self.pending:
            if idx in died:
                continue
            if ref in ready and idx not in blocked:
                try:
                    reply = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    died.add(idx)
                    print(f"OPPO: reward actor {idx} died in step {self.step} ({type(exc).__name__})", flush=True)
                    continue
                self.scores.update(reply.scores)
                self.scorer_busy.append((reply.start_s, reply.end_s))
                step_max, _ = self.scorer_kv_tokens.get(idx, (0, 0))
                self.scorer_kv_tokens[idx] = (max(step_max, reply.kv_tokens), reply.kv_tokens)
                self.scorer_kv_budget_tokens = reply.kv_budget_tokens * len(self.reward_actors)
                self.scheduler.on_scored_many(REWARD, sent)
                for sid, n in ahead.items():  # overlapped: the prefill was done before the sample was
                    if sid in self.finished_s:
                        self.step_overlap_tokens[0 if reply.end_s <= self.finished_s[sid] else 1] += n
                    else:  # its end is not known yet: judged when it is
                        self.prefilled_early.setdefault(sid, []).append((reply.end_s, n))
            else:
                blocked.add(idx)
                still.append((ref, idx, sent, ahead))
        self.pending = [p for p in still if p[1] not in died]
        for idx in died:
            self._restart_scorer(idx)

    def _restart_scorer(self, idx: int) -> None:
        """Ray restarts a dead reward actor empty (its constructor only): reload its model as
        OpenRLHF first loaded it, reopen its held samples and re-send every token the
        scheduler recorded for them; their scores are computed anew."""
        self.scorer_restarts += 1
        if self.scorer_restarts > SCORER_RESTARTS:
            raise RuntimeError(f"OPPO: reward actor {idx} died {self.scorer_restarts} times in step {self.step}; giving up")
        sched = self.scheduler
        held = [sid for gid in sched.in_flight_groups for sid in sched.group_sample_ids(gid)
                if sid % len(self.reward_actors) == idx]
        opens = {sid: self.prompts[sched.group_of(sid)][2] for sid in held}
        deadline = time.time() + SCORER_RESTART_TIMEOUT_S
        actor = self.reward_actors[idx]
        while True:  # calls made while Ray restarts the actor fail with ActorUnavailableError: wait for it
            try:
                ray.get(actor.init_model_from_pretrained.remote(self.strategy, self.args.reward.model_name_or_path))
                ray.get(actor.open_many.remote(opens))
                break
            except ray.exceptions.ActorUnavailableError:
                if time.time() > deadline:
                    raise RuntimeError(f"OPPO: reward actor {idx} did not come back within "
                                       f"{SCORER_RESTART_TIMEOUT_S:.0f}s of its death in step {self.step}") from None
                time.sleep(0.5)
        for sid in held:
            self.scores.pop(sid, None)
        chunks = sched.rescore(REWARD, held)
        print(f"OPPO: reward actor {idx} restarted; re-prefilling {len(held)} held samples "
              f"({sum(c.end for c in chunks)} tokens) from their recorded tokens", flush=True)
        self._dispatch(chunks)

    def _experience(self, group, sample, generate_kwargs):
        prompt, label, prompt_ids = self.prompts[group.group_id]
        tokens = sample.token_ids
        # None: OpenRLHF's reward forward scores the batch
        scored = {"stream": lambda: {"reward": self.scores[sample.sample_id]},
                  "rule": lambda: self.rule_rewards[sample.sample_id], "batch": dict}[self.reward_mode]()
        reward = scored.get("reward")
        if reward is not None and not math.isfinite(reward):
            raise ValueError(f"OPPO step {self.step}: the reward of sample {sample.sample_id} (group {group.group_id}, "
                             f"{len(tokens)} response tokens) is {reward}; refusing to train on it")
        response = {
            "prompt": prompt,
            "label": label,
            "images": None,
            "mm_train_inputs": None,
            "observation_tokens": prompt_ids + tokens,
            "action_ranges": [(len(prompt_ids), len(prompt_ids) + len(tokens))],
            "rollout_log_probs": [0.0] * len(prompt_ids) + sample.rollout_logprobs if self.record_logprobs else None,
            "truncated": sample.finish_reason == "length",
            "reward": reward,
            "scores": scored.get("scores", reward),
            "extra_logs": scored.get("extra_logs", {}),
        }
        return self._process_response_into_experience(response, **generate_kwargs)

    # ----------------------------------------------------------- weight sync hooks

    def pause_for_weight_sync(self) -> None:
        # the batch's groups have left the scheduler: with none carried (Δ = 0) nothing decodes, no pause
        self.paused = bool(self.scheduler.in_flight_groups)
        if self.paused:
            with timeline.RECORDER.timed("driver", "pause"):
                ray.get([e.pause_generation.remote(self.oppo.staleness.keep_kv_cache) for e in self.vllm_engines])

    def resume_after_weight_sync(self) -> None:
        # The engines now hold the weights trained on the open step's batch (or, on a
        # resume, the checkpoint's): tokens from here on are that policy version.
        version = self.step + (1 if self.open_batch is not None else 0)
        ray.get([e.set_policy_version.remote(version) for e in self.vllm_engines])
        if self.paused:
            with timeline.RECORDER.timed("driver", "resume"):
                ray.get([e.resume_generation.remote() for e in self.vllm_engines])
            self.paused = False

    @property
    def batch_sample_ids(self) -> list[int] | None:
        """The open batch's sample ids in the order its experiences were handed to OpenRLHF."""
        if self.open_batch is None:
            return None
        return [s.sample_id for g in sorted(self.open_batch.groups, key=lambda g: g.prompt_index) for s in g.samples]

    def ledger_checkpoint(self) -> None:
        self._ledger_event("checkpoint", step=self.step - 1)

    def _ledger_event(self, event: str, **fields) -> None:
        if self.ledger_path:
            ledger.append_event(self.ledger_path, {"event": event, **fields})

    # ---------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "step": self.step,
            "prompts": {str(gid): list(v) for gid, v in self.prompts.items()},  # in-flight groups only
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.prompts = {int(gid): (p, l, ids) for gid, (p, l, ids) in state["prompts"].items()}
        self.scores = {}  # reward actors restart empty: every held sample is re-scored
        self.needs_restart = True  # OpenRLHF restores the dataloader at scheduler.next_prompt_index
